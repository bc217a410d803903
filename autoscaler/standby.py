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
- Early wake (``load_above_capacity``): while a replica sleeps, the load floor (load over the
  capacity per replica confirmed sustainable) asking for more replicas than are targeted wakes
  up to that many sleepers once the worst latency signal reaches `WAKE_EARLY_FRACTION` of its
  target, before any target breaks. A breach shows in a windowed p99 only after the burst's
  first requests missed; the load shows at once. Found in the simulator's decision log of
  `code`: the misses were the first seconds of each burst, before the p99 crossed its target.
- Scaling ahead (``forecast_ahead``, with ``spec.forecast``): a Holt-Winters forecast of the
  arrival rate (`autoscaler.forecast.ArrivalForecaster`), used only while its recent
  out-of-sample MAPE is small, asks for the replicas its peak over the next start-up needs at
  the highest arrival rate per replica confirmed sustainable within a season; a scale-down
  stops there too (`forecast_need`).

Everything else (targets, trend, load floor, probe, stabilisation, rate limits) is Fleet's
policy unchanged. Pure and clock-injected like every policy: its state is the burst history,
the confirmed rates and the forecaster, kept on the instance.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import replace

from autoscaler.forecast import ArrivalForecaster
from autoscaler.policy import FleetPolicy, ReplicaBounds, ScalingContext, ScalingDecision
from autoscaler.spec import AutoscalingSpec

BURST_MEMORY_S = 3600.0
"""How long a burst's excess over the READY count sizes the standby pool (seconds): an hour, so
the hourly shape of a daily cycle is remembered and a single spike ages out."""


WAKE_EARLY_FRACTION = 0.3
"""A sleeper is woken early (before any target breaks) once the worst latency signal reaches
this fraction of its target while the load floor (load over the capacity per replica confirmed
sustainable, `FleetPolicy`) asks for more replicas than are targeted. Below it the floor alone,
a lower bound of capacity, over-asks on a steady load (measured on `conv`: woken at 0.1x target
every five minutes); chosen on `code` (0.5: too late for the onset of its bursts, 98.6 % within
the TTFT target against 99.8 %; docs/benchmarks.md)."""


class StandbyPolicy(FleetPolicy, name="standby"):
    """Fleet's policy plus a standby pool sized to the bursts seen, an early wake and, with
    ``spec.forecast``, scaling ahead (module docstring).

    Reasons: Fleet's (`autoscaler.policy.FleetPolicy`), ``load_above_capacity`` (early wake) and
    ``forecast_ahead`` (up)."""

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        super().__init__(spec, bounds)
        self._bursts: deque[tuple[float, int]] = deque()  # (seen at, replicas wanted beyond READY)
        self.forecaster = ArrivalForecaster(spec.forecast) if spec.forecast is not None else None
        # (seen at, arrival rate per READY replica confirmed sustainable), a season's running maximum
        self._rate_capacity: deque[tuple[float, float]] = deque()
        self._ahead: tuple[float, int | None, str] = (math.nan, None, "")  # (at, replicas, why) of this decision

    def prime(self, history: Sequence[tuple[float, float]]) -> None:
        if self.forecaster is not None:
            self.forecaster.prime(history)

    def forecast_need(self, ctx: ScalingContext) -> tuple[int | None, str]:
        """Replicas the forecast asks for ``ctx.startup``'s start-up time ahead (a new replica,
        not a wake-up: the pool is for bursts): the forecast's peak rate over that time x
        ``rate_headroom`` over the highest arrival rate per READY replica confirmed sustainable
        within a season (`FleetPolicy.per_replica_rate_capacity`, remembered a season long: a
        lower bound of a replica's capacity, so the need errs high). (None, why) when the
        forecast is off, untrusted or nothing was confirmed yet."""
        if self._ahead[0] == ctx.now_s:
            return self._ahead[1], self._ahead[2]
        need, why = None, "forecast off"
        f = self.forecaster
        if f is not None:
            spec = f.spec
            f.observe(ctx.now_s, ctx.signals.arrival_rate_per_s)
            capacity = self.per_replica_rate_capacity()
            history = self._rate_capacity  # a sliding-window maximum: values decrease left to right
            if capacity is not None:
                while history and history[-1][1] <= capacity:
                    history.pop()
                history.append((ctx.now_s, capacity))
            while history and history[0][0] < ctx.now_s - spec.season_bins * spec.bin_seconds:
                history.popleft()
            best = history[0][1] if history else None
            lead_s = ctx.startup.warm_s if ctx.startup.next_warm else ctx.startup.cold_s
            peak = f.peak_ahead(ctx.now_s, lead_s + self.interval_s)
            if peak is None:
                why = f"forecast not trusted: {f.status}"
            elif best is None:
                why = "no sustainable rate per replica confirmed yet"
            else:
                need = max(1, math.ceil(peak * spec.rate_headroom / best - 1e-9))
                why = (f"forecast peak {peak:.2f} req/s within {lead_s:.0f} s at {best:.2f} req/s per replica "
                       f"(MAPE {f.mape:.0%}) needs {need}")  # fmt: skip
        self._ahead = (ctx.now_s, need, why)
        return need, why

    def _lowest(self, ctx: ScalingContext) -> int:
        need, _ = self.forecast_need(ctx)
        return self.bounds.min if need is None else max(self.bounds.min, min(need, ctx.desired))

    def standby_target(self, now_s: float, desired: int) -> int | None:
        """STANDBY replicas to keep beside ``desired``: the largest burst excess remembered, at
        most ``bounds.max - desired``; None before any scale-up was seen."""
        bursts = self._bursts
        while bursts and bursts[0][0] < now_s - BURST_MEMORY_S:
            bursts.popleft()
        if not bursts:
            return None
        return max(0, min(max(excess for _, excess in bursts), self.bounds.max - desired))

    def _early_up(self, ctx: ScalingContext, pressure: float | None, floor: int) -> tuple[int, str, str] | None:
        """Wake sleepers as the load outgrows the targeted replicas, before a target breaks: a
        wake-up takes seconds, so a lower bound of the need (the load floor) is worth acting
        on while latency already rises (`WAKE_EARLY_FRACTION`); a start-up of a minute is not.
        At most the sleepers at hand. Otherwise the trusted forecast's need (`forecast_need`),
        when above the target."""
        if ctx.standby and pressure is not None and pressure >= WAKE_EARLY_FRACTION and floor > ctx.desired:
            want = ctx.desired + min(ctx.standby, floor - ctx.desired)
            return want, "load_above_capacity", (f"load needs {floor} replica(s) at the capacity confirmed so far, "
                                                 f"{ctx.desired} targeted, latency at {pressure:.2f}x target")
        need, why = self.forecast_need(ctx)
        if need is not None and need > ctx.desired:
            return need, "forecast_ahead", why
        return None

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        decision = super().decide(ctx)
        self.forecast_need(ctx)  # observe the rate every decision, whichever branch decided
        if decision.desired > ctx.desired and decision.reason not in ("load_above_capacity", "forecast_ahead"):
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
        inputs = {**decision.inputs, "standby": ctx.standby, "standby_target": target}
        if self.forecaster is not None:
            inputs.update(forecast_need=self._ahead[1], forecast_mape=self.forecaster.mape)
        decision = replace(decision, standby=target, detail=detail, inputs=inputs)
        self.last = decision
        return decision
