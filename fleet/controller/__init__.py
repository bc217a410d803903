"""The controller: one reconcile loop that converges each deployment's desired replicas to the
observed ones, through a backend (`fleet.local` processes or `fleet.k8s` pods).

Modules: `reconcile` (the `Controller` and its tick), with the collaborators of its steps: `launch`
(placement and launch), `drain` (drain and stop), `pools` (the router's pools), `report` (status
transitions and the history kept), `preemption` (lower priorities preempted), `model_memory` (the
memory a replica needs, for placement); `targets` (what is persisted and read back:
desired replicas and revisions per deployment), `lifecycle` (replica facts and the status derived
from them), `backend` (the protocol every backend implements), `restart` (taking over from a
previous controller: adoption), `rollouts` (the rollout driver: new specs, canary steps),
`autoscaling` (the loop that asks each deployment's scaling policy), `router_admin` (the client
that publishes pools to the router). Run by `fleet.local.up` and `fleet.k8s.operator`.
"""
