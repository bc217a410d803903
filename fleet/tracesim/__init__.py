"""The trace simulator (`fleet simulate`): replay a request trace through the real routing and
autoscaling policy objects over simulated engines, in virtual time.

Modules: `workload` (trace -> requests, load scaling, capacity and fixed sizing), `replica`
(simulated replicas, start-up model, scrapes), `engine` (the discrete-event loop), `results`
(per-request and per-decision records, the summary row), `compare` (Fleet's policy and the
baselines on one workload), `plot` (the PNG). Called by `fleet.cli`.
"""
