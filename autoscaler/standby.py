"""The `standby` scaling policy: Fleet's policy (`autoscaler.policy.FleetPolicy`) that also sizes
a pool of STANDBY replicas (placed, loaded, asleep: `fleet.controller.lifecycle.ReplicaStatus`)
to the bursts it has seen, and says which kind of capacity a scale-up takes.

Three kinds of capacity, fastest first (seconds until a replica asked for now serves): wake a
standby replica (`autoscaler.startup.StartupEstimate.wake_s`: seconds), start on a warm node
(image and weights cached: ``warm_s``, a minute), start cold (``cold_s``, minutes). A standby
replica costs what a serving one costs (it holds its GPUs), so the pool is kept only as large
as the bursts need:

- Burst excess: on every scale-up, the replicas wanted beyond those READY (``desired - ready``).
  A burst shorter than a start-up is over before a new replica serves; only capacity that
  wakes in seconds catches it.
- Pool target (``ScalingDecision.standby``): the largest burst excess of the last
  `BURST_MEMORY_S` seconds; None before the first scale-up (the caller keeps the deployment's
  maximum); never above `ScalingPolicy.bounds.max` less the target. The caller clamps it to
  ``[0, spec.standby.maxReplicas]``.
- Scale-up: Fleet's policy decides how many; the lead time it projects over is the fastest
  kind at hand (a wake-up while any replica is asleep). The decision's detail says how many
  wake and how many start warm or cold.

Everything else (targets, trend, load floor, probe, stabilisation, rate limits) is Fleet's
policy unchanged. Pure and clock-injected like every policy: its only state is the burst
history kept on the instance.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import replace

from autoscaler.policy import FleetPolicy, ReplicaBounds, ScalingContext, ScalingDecision
from autoscaler.spec import AutoscalingSpec

BURST_MEMORY_S = 3600.0
"""How long a burst's excess over the READY count sizes the standby pool (seconds): an hour, so
the hourly shape of a daily cycle is remembered and a single spike ages out."""


class StandbyPolicy(FleetPolicy, name="standby"):
    """Fleet's policy plus a standby pool sized to the bursts seen (module docstring).

    Reasons: Fleet's (`autoscaler.policy.FleetPolicy`)."""

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        super().__init__(spec, bounds)
        self._bursts: deque[tuple[float, int]] = deque()  # (seen at, replicas wanted beyond READY)

    def standby_target(self, now_s: float, desired: int) -> int | None:
        """STANDBY replicas to keep beside ``desired``: the largest burst excess remembered, at
        most ``bounds.max - desired``; None before any scale-up was seen."""
        bursts = self._bursts
        while bursts and bursts[0][0] < now_s - BURST_MEMORY_S:
            bursts.popleft()
        if not bursts:
            return None
        return max(0, min(max(excess for _, excess in bursts), self.bounds.max - desired))

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        decision = super().decide(ctx)
        if decision.desired > ctx.desired:
            self._bursts.append((ctx.now_s, decision.desired - ctx.ready))
        target = self.standby_target(ctx.now_s, decision.desired)
        detail = decision.detail
        added = decision.desired - ctx.desired
        if added > 0:
            woken = min(added, ctx.standby)
            started = added - woken
            kind = "warm" if ctx.startup.next_warm else "cold"
            parts = [f"wake {woken} standby"] if woken else []
            if started:
                lead_s = ctx.startup.warm_s if ctx.startup.next_warm else ctx.startup.cold_s
                parts.append(f"start {started} ({kind}, ~{math.ceil(lead_s)} s)")
            detail = f"{detail}; {' and '.join(parts)}"
        if target is not None:
            detail = f"{detail}; standby pool {target} (largest burst excess of the last {BURST_MEMORY_S:g} s)"
        decision = replace(decision, standby=target, detail=detail,
                           inputs={**decision.inputs, "standby": ctx.standby, "standby_target": target})  # fmt: skip
        self.last = decision
        return decision
