"""The trace simulator (`fleet simulate`): replay a request trace through the real routing and
autoscaling policy objects over simulated engines, in virtual time.

Modules: `workload` (trace -> requests, load scaling, capacity and fixed sizing), `replica`
(simulated replicas, their status derived from facts, start-up model, scrapes), `events` (the
one event loop and engine stepping every simulator runs on), `config` (what the autoscaling
simulation simulates), `engine` (the autoscaling simulation), `router_views` (what its routers
know of each other and of the engines), `rollout` (canary rollouts), `preemption` (priorities
on a GPU inventory), `results` (per-request and per-decision records, the summary row),
`compare` (Fleet's policy and the baselines on one workload), `plot` (the PNG). Called by
`fleet.cli`.
"""
