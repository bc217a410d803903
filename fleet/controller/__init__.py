"""The controller: one reconcile loop that converges each deployment's desired replicas to the
observed ones, through a backend (`fleet.local` processes or `fleet.k8s` pods).

Modules: `reconcile` (the `Controller` and its tick), `targets` (what is persisted and read back:
desired replicas and revisions per deployment), `lifecycle` (replica facts and the status derived
from them), `backend` (the protocol every backend implements), `restart` (taking over from a
previous controller: adoption), `rollouts` (the rollout driver: new specs, canary steps),
`autoscaling` (the loop that asks each deployment's scaling policy), `router_admin` (the client
that publishes pools to the router). Run by `fleet.local.up` and `fleet.k8s.operator`.
"""
