"""What `fleet up` runs on one machine: the embedded runtime of a local fleet.

Modules: `up` (`fleet up` / `fleet down`: preflight, adoption, the loops, shutdown), `state`
(the state directory), `control` (`fleet apply` and `fleet rollout` requests to a running
`fleet up`), `routerproc` (the router process: started, adopted, restarted), `backend` (the local
backend of the replica protocol: engine processes), `procs` (processes known by pid and start
time, outliving the controller).
"""
