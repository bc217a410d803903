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
- Pool target (``ScalingDecision.standby``, `StandbyPool`, ``spec.standbyPool``): the heaviest
  burst excess seen, each halved every ``halfLifeSeconds``; before any burst a starting pool
  (``initialReplicas``; None: the caller keeps the deployment's maximum) released after
  ``initialSeconds`` on steady traffic (`STEADY_PEAK_TO_MEAN`); with a trusted forecast and
  ``forecastAheadSeconds``, at least the replicas its peak asks for beyond the target; never
  above `ScalingPolicy.bounds.max` less the target. The caller clamps it to
  ``[0, spec.standby.maxReplicas]`` and stops the sleepers beyond it.
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

- Burst over (``burst_over``): a burst in Azure `code` lasts 10-20 s, a start-up a minute. While
  the load now fits the READY replicas at the capacity per replica confirmed sustainable (the
  load floor at most ``ready``), a breach still in the windowed signals is the burst's memory: a
  scale-up takes only the sleepers at hand, and replicas still starting are stopped (never below
  a trusted forecast's need). Found in the decision log of day 3 of the synthetic daily trace
  (`loadtests/daily_trace.py`): each burst started 6-13 replicas that became READY a minute
  after it ended and were kept five minutes more by the stabilisation window.

- Burst floor (``standbyPool.floorHalfLifeSeconds``): a burst shorter than a start-up is met by
  what is awake or asleep when it starts. On a scale-up the policy remembers the replicas the
  burst reached within seconds (its target, at most the READY and standby replicas then), each
  such count halving every ``floorHalfLifeSeconds`` (`DecayingPeak`); a scale-down keeps at
  least that many. The replicas it keeps beyond what the load needs are the burst's reserve
  awake, so the pool keeps that many fewer sleepers (`_held_by_floor`), but never fewer than one
  while it holds any burst: a burst larger than the floor's then wakes one in seconds. Found on
  day 4 of seed 7 of the synthetic daily trace: between bursts of 450-607 requests a minute the
  policy stepped down to 1-2 READY replicas, and the next burst met those; the one sleeper on
  Azure `code`: the floor's 4 awake replicas had taken every sleeper's place, and its first burst
  larger than the floor met 4 READY replicas and none asleep (docs/benchmarks.md, "Standby on a
  held-out day").

Everything else (targets, trend, load floor, probe, stabilisation, rate limits) is Fleet's
policy unchanged. Pure and clock-injected like every policy: its state is the pool, the
confirmed rates and the forecaster, kept on the instance. With ``defer_work`` (set by the
controller) a forecast refit is not run inside `decide` but handed out by `take_background`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from autoscaler.forecast import ArrivalForecaster
from autoscaler.policy import FleetPolicy, ReplicaBounds, ScalingContext, ScalingDecision
from autoscaler.spec import AutoscalingSpec, StandbyPoolSpec

STEADY_PEAK_TO_MEAN = 2.0
"""Before any burst, traffic whose windowed arrival rate peaked under this multiple of its mean is
steady: the starting pool is released after ``initialSeconds`` (`StandbyPool`). Azure `conv`'s
30 s rate stays within 1.3x of its mean; `code`'s swings from 0 to 7x in its first 200 s."""


WAKE_EARLY_FRACTION = 0.3
"""A sleeper is woken early (before any target breaks) once the worst latency signal reaches
this fraction of its target while the load floor (load over the capacity per replica confirmed
sustainable, `FleetPolicy`) asks for more replicas than are targeted. Below it the floor alone,
a lower bound of capacity, over-asks on a steady load (measured on `conv`: woken at 0.1x target
every five minutes); chosen on `code`, where 0.5 wakes too late for the onset of its bursts."""


class DecayingPeak:
    """The heaviest of values seen, each halving every ``half_life_s`` seconds: a value ``v`` seen
    ``age`` seconds ago weighs ``v * 0.5 ** (age / half_life_s)``. Used for the standby pool's
    bursts (`StandbyPool`) and the burst floor (`StandbyPolicy`, ``standbyPool.floorHalfLifeSeconds``).

    Pure: every method takes the caller's time (seconds). Memory: values whose weight fell under
    half a unit are dropped, and so is one outweighed by a later one (both decay alike), so at most
    a handful are kept. ``len()``: values kept."""

    def __init__(self, half_life_s: float) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.half_life_s = half_life_s
        self._seen: deque[tuple[float, int]] = deque()  # (seen at, value), heaviest first

    def __len__(self) -> int:
        return len(self._seen)

    def weight(self, now_s: float, seen_s: float, value: int) -> float:
        """A value's weight at ``now_s`` (fractional)."""
        return value * 0.5 ** (max(0.0, now_s - seen_s) / self.half_life_s)

    def observe(self, now_s: float, value: int) -> None:
        """``value`` seen at ``now_s`` (values <= 0 are ignored)."""
        if value <= 0:
            return
        seen = self._seen
        while seen and self.weight(now_s, *seen[-1]) <= value:
            seen.pop()   # lighter now and decaying at the same rate: never the heaviest again
        seen.append((now_s, value))

    def value(self, now_s: float) -> int:
        """The heaviest weight at ``now_s``, rounded to the nearest unit (0 when none is kept)."""
        seen = self._seen
        while seen and self.weight(now_s, *seen[0]) < 0.5:
            seen.popleft()
        return int(self.weight(now_s, *seen[0]) + 0.5) if seen else 0


class StandbyPool:
    """The standby pool's size from the bursts seen (``spec``: `autoscaler.spec.StandbyPoolSpec`).

    A burst of excess ``e`` replicas (wanted beyond those READY on a scale-up, `observe`) seen
    ``age`` seconds ago weighs ``e * 0.5 ** (age / halfLifeSeconds)``; the pool is the heaviest
    weight rounded to the nearest replica (a burst of 1 keeps one sleeper for one half-life, of 4
    about three), at least ``extra`` (a trusted forecast's need beyond the target, `target`).
    Before any burst: ``initialReplicas`` (None: the caller's maximum, `target` returns None)
    for ``initialSeconds`` from the first call, then only while the arrival rate looks bursty
    (`observe_rate`, `steady`), else none. So steady traffic, which never scales up, keeps no
    sleeper, and the caller releases (stops) the sleepers beyond the target.

    Pure: every method takes the caller's time (seconds). Memory: bursts whose weight fell
    under half a replica are dropped, and so is one outweighed by a later one (both decay alike)."""

    def __init__(self, spec: StandbyPoolSpec) -> None:
        self.spec = spec
        self._bursts = DecayingPeak(spec.half_life_seconds)  # the burst excesses seen
        self._start_s: float | None = None
        self._seen = False
        self._rates = [0.0, 0.0, 0.0]  # sum, samples, peak of the arrival rate before the first burst

    def observe_rate(self, now_s: float, rate_per_s: float) -> None:
        """An arrival-rate sample (requests/s, windowed) at ``now_s``: while no burst was seen,
        its peak over its mean says whether the traffic is bursty (`STEADY_PEAK_TO_MEAN`)."""
        if self._start_s is None:
            self._start_s = now_s
        r = self._rates
        r[0], r[1], r[2] = r[0] + rate_per_s, r[1] + 1, max(r[2], rate_per_s)

    @property
    def seen(self) -> bool:
        """Whether a burst was observed."""
        return self._seen

    @property
    def steady(self) -> bool:
        """No burst seen and the arrival rate's peak stayed under `STEADY_PEAK_TO_MEAN` x its mean."""
        total, n, peak = self._rates
        return not self._seen and n > 0 and total > 0 and peak < STEADY_PEAK_TO_MEAN * total / n

    def weight(self, now_s: float, seen_s: float, excess: int) -> float:
        """A burst's weight at ``now_s`` (replicas, fractional)."""
        return self._bursts.weight(now_s, seen_s, excess)

    def observe(self, now_s: float, excess: int) -> None:
        """A burst at ``now_s``: a scale-up wanting ``excess`` replicas beyond those READY."""
        if self._start_s is None:
            self._start_s = now_s
        if excess <= 0:
            return
        self._seen = True
        self._bursts.observe(now_s, excess)

    def target(self, now_s: float, extra: int = 0) -> int | None:
        """Standby replicas to keep at ``now_s``: the heaviest burst rounded (before any burst:
        the starting pool), at least ``extra``; None for the caller's maximum (the starting pool
        unset, within ``initialSeconds``)."""
        if self._start_s is None:
            self._start_s = now_s
        if not self._seen:
            if now_s - self._start_s < self.spec.initial_seconds or not self.steady:
                initial = self.spec.initial_replicas
                return None if initial is None else max(initial, extra)
            return max(0, extra)
        return max(self._bursts.value(now_s), extra)


class StandbyPolicy(FleetPolicy, name="standby"):
    """Fleet's policy plus a standby pool sized to the bursts seen, an early wake and, with
    ``spec.forecast``, scaling ahead (module docstring).

    Reasons: Fleet's (`autoscaler.policy.FleetPolicy`), ``load_above_capacity`` (early wake),
    ``forecast_ahead`` (up) and ``burst_over`` (start-ups stopped or not asked for)."""

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        super().__init__(spec, bounds)
        self.pool = StandbyPool(spec.standby_pool_params)
        floor_half_life_s = spec.standby_pool_params.floor_half_life_seconds
        self.burst_floor = DecayingPeak(floor_half_life_s) if floor_half_life_s > 0 else None
        self.forecaster = ArrivalForecaster(spec.forecast) if spec.forecast is not None else None
        # (seen at, arrival rate per READY replica confirmed sustainable), a season's running maximum
        self._rate_capacity: deque[tuple[float, float]] = deque()
        self._ahead: tuple[float, int | None, str] = (math.nan, None, "")  # (at, replicas, why) of this decision

    def prime(self, history: Sequence[tuple[float, float]]) -> None:
        if self.forecaster is not None:
            self.forecaster.prime(history)

    def history(self) -> list[tuple[float, float]]:
        return self.forecaster.history() if self.forecaster is not None else []

    def take_background(self) -> Callable[[], Callable[[], None]] | None:
        """The forecast's deferred refit (`ArrivalForecaster.take_fit`): run it in a worker
        thread, then apply what it returns on the caller's thread (`ArrivalForecaster.install`)."""
        f = self.forecaster
        job = None if f is None else f.take_fit()
        if f is None or job is None:
            return None

        def work() -> Callable[[], None]:
            result = job.run()
            return lambda: f.install(result)

        return work

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
            f.defer_fits = self.defer_work
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
            peak = f.peak_ahead(ctx.now_s, lead_s + self.interval_s, upper=spec.bound == "upper")
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
        """Fewest replicas a scale-down may leave: ``spec.replicas.min``, a trusted forecast's need
        (`forecast_need`) and the burst floor (`burst_floor_of`), neither above the target."""
        need, _ = self.forecast_need(ctx)
        lowest = self.bounds.min if need is None else max(self.bounds.min, min(need, ctx.desired))
        return max(lowest, min(self.burst_floor_of(ctx.now_s), ctx.desired))

    def _held_by_floor(self, ctx: ScalingContext, decision: ScalingDecision) -> int:
        """READY-or-starting replicas kept only by the burst floor: the target (at most the floor)
        beyond what the load needs now (the load floor, at least ``spec.replicas.min``). They are
        the burst's reserve awake, so the standby pool keeps that many fewer sleepers (at least
        one while the pool holds any burst, `decide`)."""
        floor = self.burst_floor_of(ctx.now_s)
        load_floor = decision.inputs.get("load_floor")
        if floor <= 0 or not isinstance(load_floor, int):
            return 0
        return max(0, min(decision.desired, floor) - max(load_floor, self.bounds.min))

    def burst_floor_of(self, now_s: float) -> int:
        """Replicas the burst floor keeps at ``now_s`` (module docstring, "Burst floor"): the
        heaviest count a burst reached within seconds, halved every ``floorHalfLifeSeconds``;
        0 when off."""
        return 0 if self.burst_floor is None else self.burst_floor.value(now_s)

    def pool_forecast_need(self, ctx: ScalingContext) -> int | None:
        """Replicas a trusted forecast asks for over ``standbyPool.forecastAheadSeconds`` (the
        peak rate of those bins over the highest rate per replica confirmed sustainable), or
        None (off, untrusted, nothing confirmed)."""
        f, ahead_s = self.forecaster, self.spec.standby_pool_params.forecast_ahead_seconds
        if f is None or ahead_s <= 0 or not self._rate_capacity:
            return None
        peak = f.peak_ahead(ctx.now_s, ahead_s, upper=f.spec.bound == "upper")
        if peak is None:
            return None
        return max(1, math.ceil(peak * f.spec.rate_headroom / self._rate_capacity[0][1] - 1e-9))

    def standby_target(self, ctx: ScalingContext, desired: int) -> int | None:
        """STANDBY replicas to keep beside ``desired``: `StandbyPool.target` (at least what a
        trusted forecast asks for beyond ``desired``, `pool_forecast_need`), at most
        ``bounds.max - desired``; None while the pool is left to the caller."""
        need = self.pool_forecast_need(ctx)
        target = self.pool.target(ctx.now_s, 0 if need is None else need - desired)
        return None if target is None else max(0, min(target, self.bounds.max - desired))

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

    def _start_not_needed(self, ctx: ScalingContext, decision: ScalingDecision) -> ScalingDecision:
        """``decision`` without the start-ups a burst that is over asked for (module docstring,
        "Burst over"): while the load now fits the READY replicas at the capacity per replica
        confirmed sustainable (the load floor, `FleetPolicy._load_floor`, at most ``ready``), a
        scale-up takes only the sleepers at hand, and replicas still starting are stopped, down
        to the READY count (never below `_lowest`: a trusted forecast's need). A windowed signal
        still shows a burst seconds after it ended; a replica started then serves a minute later,
        to no one, and the stabilisation window keeps it five minutes more."""
        floor = decision.inputs.get("load_floor")
        if (not isinstance(floor, int) or self.per_replica_capacity() is None or ctx.ready < 1
                or floor > ctx.ready or decision.reason == "forecast_ahead"):  # fmt: skip
            return decision
        keep = max(ctx.ready, self._lowest(ctx))
        if decision.desired > ctx.desired:
            desired = max(min(decision.desired, ctx.desired + ctx.standby), keep, ctx.desired - ctx.starting)
            if desired >= decision.desired:
                return decision
        elif ctx.starting > 0 and decision.desired >= ctx.desired and keep < ctx.desired:
            desired = max(keep, ctx.desired - ctx.starting)
            if desired >= ctx.desired:
                return decision
        else:
            return decision
        detail = (f"{decision.detail}; but the load now needs {floor} replica(s) at the capacity confirmed, "
                  f"{ctx.ready} READY: the burst is over before a start-up would serve, so {desired} "
                  f"({ctx.starting} starting, {ctx.standby} asleep)")  # fmt: skip
        self.last = replace(decision, desired=desired, reason="burst_over", detail=detail)
        return self.last

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        decision = super().decide(ctx)
        self.forecast_need(ctx)  # observe the rate every decision, whichever branch decided
        self.pool.observe_rate(ctx.now_s, ctx.signals.arrival_rate_per_s)
        if decision.desired > ctx.desired and decision.reason != "forecast_ahead":
            self.pool.observe(ctx.now_s, decision.desired - ctx.ready)
        decision = self._start_not_needed(ctx, decision)
        if self.burst_floor is not None and decision.desired > ctx.desired and decision.reason != "forecast_ahead":
            self.burst_floor.observe(ctx.now_s, min(decision.desired, ctx.ready + ctx.standby))
        target = self.standby_target(ctx, decision.desired)
        held = self._held_by_floor(ctx, decision)
        if target is not None and held > 0:
            target = max(target - held, min(target, 1))
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
            why = (f"largest burst excess seen, halved every {self.pool.spec.half_life_seconds:g} s"
                   if self.pool.seen else "starting pool, no burst seen yet")
            detail = f"{detail}; standby pool {target} ({why})"
        inputs = {**decision.inputs, "standby": ctx.standby, "standby_target": target,
                  "burst_floor": self.burst_floor_of(ctx.now_s)}  # fmt: skip
        if self.forecaster is not None:
            inputs.update(forecast_need=self._ahead[1], forecast_mape=self.forecaster.mape)
        decision = replace(decision, standby=target, detail=detail, inputs=inputs)
        self.last = decision
        return decision
