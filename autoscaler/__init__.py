"""Fleet's autoscaler: signals (queue time, p99 TTFT and latency, in-flight, arrival rate) and
scaling policies that turn them into a desired replica count. Pure: no I/O, no clock reads.

Modules, in import order: `histograms` (windows over cumulative Prometheus histograms),
`engine_metrics` (parse an engine's `/metrics` text), `signals` (one deployment's signals from
router stats and engine scrapes), `startup` (observed time-to-ready, warm and cold), `spec`
(the `autoscaling:` section of a deployment), `policy` (context, decision, the policy registry
and Fleet's own policy), `baselines` (`keda-queue`, `kpa`, `fixed`), `standby` (Fleet's policy
sizing a pool of STANDBY replicas), `metrics` (Prometheus
export of decisions).

Callers: `fleet.controller.autoscaling` (the loop of `fleet up`: scrapes, decides, calls
`Controller.set_desired`) and the trace simulator, which runs the same policy objects in
virtual time. Imports only `router` (`fleet.base.registry`, `fleet.base.spec`) and itself; nothing of
`fleet` (docs/architecture.md).

Importing the package imports the built-in policies (`policy`, `baselines`, `standby`), so that the registry
of policy names (`autoscaler.spec.SCALING_POLICIES`) is complete whenever a spec is checked.
"""

from __future__ import annotations

from autoscaler import baselines, policy, standby  # noqa: F401 - the built-in scaling policies register on import
