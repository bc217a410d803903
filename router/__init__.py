"""Fleet's data-plane router: an OpenAI-compatible reverse proxy over per-model pools.

Rooms, bottom first (each imports only the rooms before it; tests/unit/test_layers.py checks):

- `protocol`: what clients and engines say: OpenAI error bodies, SSE events, token usage,
  depth-bounded JSON;
- `stats`: what the router measures: windowed statistics, per-request records, Prometheus metrics;
- `kv`: the KV view: vLLM's KV event format, the exact and approximate block indexes, prompt
  blocks, the pool's own tokenizer;
- `pools`: endpoints, pools, routing policies, the revision split, outlier ejection, admission;
- `signals`: what the router learns off the request path: engines' load (`/metrics` polls),
  their KV event streams;
- `request`: the request path, one step a module (parse, resolve, prepare, pick, attempt, relay);
- `http`: the HTTP edge: the ASGI app, the admin API, uvicorn, the remembered models.

Nothing here imports `fleet` but `fleet.base` (the spec base and the registry helper), nor
`autoscaler`; the control plane talks to the router over its admin API, and the autoscaler reads
the statistics over it. This package init imports nothing, so `router.pools.policies` stays cheap.
"""

from __future__ import annotations
