"""Canary rollouts: the `spec.rollout` section, the analysis of a canary against stable, and the
rollout state machine. Pure: no I/O, no clock reads.

Modules, in import order: `spec` (pydantic models of `spec.rollout`), `analysis` (one analysis
run: per-check values, limits, sample counts and verdicts), `machine` (steps, weights, pauses,
promote and roll back over a `RolloutState`). The router's per-request split between revisions
lives beside the routing policies (`router.pools.split`).

Callers: the controller (`fleet.controller.reconcile`, revisions of a deployment) and the trace simulator
(`fleet.tracesim.rollout`), which run the same objects in real and in virtual time. Imports
`router.stats.windows` (pure) and `fleet.base.spec`; never the reverse.
"""
