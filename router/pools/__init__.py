"""Each model's pool: its endpoints, their live state, and how one is picked for a request.

The admin API's pool documents (`spec`), one endpoint's live load and latency (`endpoint`), outlier
ejection (`outlier`), the admission queue (`admission`), the revision split between stable and
canary (`split`), the routing policies by name (`policies`), and `Pool`/`PoolTable`, which hold
them together (`pool`). Pure, clock-injected: the trace simulator runs the same objects.
"""
