"""Scaling policies decide, the controller acts: context and decision types, the registry, the
shared mechanics (HPA-style stabilisation, rate limits, bounds) and Fleet's own policy.

Owns `ScalingContext` (what a policy is told), `ScalingDecision` (what it answers, with its
reason), `ReplicaBounds`, `ScalingPolicy` (base class; subclasses register by name into
`autoscaler.spec.SCALING_POLICIES`), `Stabilizer`, `limit_rate` and `FleetPolicy` (`fleet`). The
baselines (`keda-queue`, `kpa`, `fixed`) live in `autoscaler.baselines`; the package imports both
modules (autoscaler/__init__.py), so every policy is registered once `autoscaler` is imported.

How a caller drives a policy, in real or virtual time (`fleet.controller.autoscaling`, the trace
simulator): one instance per deployment, ``make_policy(spec, bounds)``; every
``policy.interval_s`` seconds build a `ScalingContext` (clock time, current target, READY and
starting replicas, `autoscaler.signals.Signals`, `autoscaler.startup.StartupEstimate`) and call
``policy.decide(ctx)``; set the deployment's target to ``decision.desired``. A policy does no
I/O and reads no clock; its only state is its own history (kept on the instance), so the same
sequence of contexts always gives the same decisions.

Fleet's policy, per decision (targets: queue time Tq, p99 TTFT Tt; pressure = the larger of
queue_time / Tq and ttft_p99 / Tt, TTFT counting only with >= 10 samples in the window):

1. Above target (pressure > 1): want ceil(R x pressure) replicas (at least 1), where R is the
   time-weighted mean READY count over the signal window: the replicas that produced the
   windowed signals (just after a scale-up the window still shows what fewer replicas did).
2. Heading above target: a robust (Theil-Sen) line through each signal's ratios over
   `trendWindowSeconds` (measured at today's READY count), projected ahead by the time a new
   replica needs to become ready (observed warm or cold start-up; never further ahead than the
   points reach back), crosses 1: want ceil(ready x projected), at least ready + 1.
3. Demand with no READY replica: want 1 (or the load floor).
4. Every signal below `scaleDownBelowFraction` of its target (hysteresis) or none measured:
   want the load floor (at least spec.replicas.min), never more than the current target (the
   floor only holds a scale-down back); with every signal under half that fraction, one
   replica below the floor (a probe, below). Between that fraction and 1: hold.
   (Between 2 and 3 a subclass may scale up early, `FleetPolicy._early_up`, and in 4 keep more
   than spec.replicas.min, `FleetPolicy._lowest`; `autoscaler.standby` does both.)
5. Replicas already starting count: a want at or below the current target is a hold.
6. HPA stabilisation (`Stabilizer`): scale up to the lowest recommendation of the scale-up
   window, down to the highest of the scale-down window (300 s by default), so one quiet
   minute after a burst never removes replicas; a scale-down also waits until the signal
   window holds only today's READY count (step down, watch a window, step again); then the
   rate limits; then the bounds.

The load floor ("never below what current load needs"): load = max(in flight + queued,
arrival rate x mean end-to-end latency) (Little's law, L = lambda W, smooths the
instantaneous count), divided by the per-replica capacity learned from observation: the
largest load per READY replica that was confirmed sustainable, i.e. whose whole signal
window later still met both targets, over the last 30 minutes. A lower bound of the true
capacity, so the floor errs toward keeping replicas; as replicas go, the observed load per
replica rises and the floor follows. Unknown capacity with load present keeps every READY
replica. The arrival rate counts the same way (the largest arrival rate per READY replica
confirmed sustainable): requests in flight alone understate what fewer replicas would carry,
as each request takes longer on fewer replicas and a replica serves only so many per second.

A floor learned as a lower bound never lets a steady load leave an over-provisioned count (the
load per replica seen is the most ever confirmed, so the floor is today's count). With every
signal far below target (under half of `scaleDownBelowFraction`), the policy probes: one
replica fewer, unless the arrival rate *and* the load each remaining replica would take both
reach `PROBE_MARGIN` of those per replica at an *overload* (a signal above target; the peak
rate and load behind it, as a windowed latency lags the load) in the last 30 minutes. A failed
probe is that overload: the policy scales back up, and the rate it failed at bars the same
probe from then on. The probe is latency-driven exploration, the upper bound its memory.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from autoscaler.signals import Signals
from autoscaler.spec import SCALING_POLICIES, AutoscalingSpec
from autoscaler.startup import StartupEstimate
from fleet.base.registry import Registered


MIN_TTFT_SAMPLES = 10
"""Completed requests a window needs before its p99 TTFT counts as a signal: the p99 of fewer
samples is their maximum, and one long prompt would then scale the deployment."""

CAPACITY_MEMORY_S = 1800.0
"""How long a confirmed per-replica capacity observation, or an overload, is remembered (seconds)."""

PROBE_BELOW_FRACTION = 0.5
"""A step below the load floor (a probe) needs every signal under this fraction of
`scaleDownBelowFraction` (with the defaults: under 0.25x its target)."""

PROBE_MARGIN = 0.8
"""A probe is barred while each remaining replica would take at least this fraction of both the
arrival rate and the load per replica of an overload seen within `CAPACITY_MEMORY_S`."""


class Direction(enum.Enum):
    UP = "up"
    DOWN = "down"
    HOLD = "hold"


@dataclass(frozen=True)
class ReplicaBounds:
    """`spec.replicas`: ``min <= initial <= max``, ``max >= 1``. Raises ValueError otherwise."""

    min: int
    max: int
    initial: int

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.initial <= self.max or self.max < 1:
            raise ValueError(f"need 0 <= min <= initial <= max and max >= 1, got {self}")

    def clamp(self, replicas: int) -> int:
        return max(self.min, min(self.max, replicas))


@dataclass(frozen=True)
class ScalingContext:
    """What a policy is told at ``now_s`` (seconds on the caller's clock, virtual or real).

    ``desired``: the deployment's current target replica count; ``ready``: READY replicas
    (serving); ``starting``: replicas counted in the target but not READY yet (pending,
    starting, warming); ``signals``: `autoscaler.signals.Signals`; ``startup``: the
    time-to-ready estimate for a replica asked for now; ``standby``: STANDBY replicas (asleep,
    not counted in ``desired``) kept now.
    """

    now_s: float
    desired: int
    ready: int
    starting: int
    signals: Signals
    startup: StartupEstimate = field(default_factory=lambda: StartupEstimate(60.0, 600.0))
    standby: int = 0


@dataclass(frozen=True)
class ScalingDecision:
    """A policy's answer: the replica count to target and why.

    ``reason`` is a short code (a metric label: see each policy), ``detail`` a sentence with the
    numbers, ``inputs`` the values it was decided on (for the event log). ``standby``: STANDBY
    replicas the policy wants kept beside ``desired`` (None: the deployment's own maximum; the
    caller clamps it to ``[0, max]``).
    """

    at_s: float
    previous: int
    desired: int
    reason: str
    detail: str
    inputs: Mapping[str, float | int | None] = field(default_factory=dict)
    standby: int | None = None

    @property
    def direction(self) -> Direction:
        if self.desired > self.previous:
            return Direction.UP
        if self.desired < self.previous:
            return Direction.DOWN
        return Direction.HOLD

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (the state file, `fleet status`)."""
        return {"at_s": self.at_s, "previous": self.previous, "desired": self.desired,
                "direction": self.direction.value, "reason": self.reason, "detail": self.detail,
                "inputs": dict(self.inputs), "standby": self.standby}  # fmt: skip


class ScalingPolicy(Registered, registry=SCALING_POLICIES):
    """Base class of scaling policies; subclasses register with ``name=...``.

    Every policy is built the same way, ``cls(spec, bounds)``, and answers `decide(ctx)`.
    ``interval_s`` is how often the caller should ask (``spec.intervalSeconds`` or the
    policy's ``default_interval_s``); ``last`` is the previous decision.
    """

    default_interval_s: ClassVar[float] = 5.0

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        self.spec = spec
        self.bounds = bounds
        self.interval_s = spec.interval_seconds or self.default_interval_s
        self.last: ScalingDecision | None = None
        self.defer_work = False
        """Set by a caller with an event loop: slow pure work (a forecast refit) waits in
        `take_background` instead of running inside `decide`."""

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        """The desired replica count for ``ctx``. Must not do I/O or read a clock."""
        raise NotImplementedError

    def prime(self, history: Sequence[tuple[float, float]]) -> None:
        """Arrival rates seen before the first decision: (bin start in seconds on the caller's
        clock, before the first ``ctx.now_s``; requests/s), oldest first. A policy that keeps no
        long history ignores them (all but `standby` with ``spec.forecast``)."""

    def history(self) -> list[tuple[float, float]]:
        """What `prime` would take back: the arrival rates this policy keeps, as (bin start in
        seconds on the caller's clock, requests/s), oldest first; [] for a policy that keeps none.
        The controller saves them, so a restart does not forget a forecast's seasons."""
        return []

    def take_background(self) -> Callable[[], Callable[[], None]] | None:
        """Work deferred by `decide` (``defer_work``), once: a callable that is safe to run in a
        worker thread (pure, touching no policy state) and returns a callable to run on the
        caller's thread to apply its result. None when nothing waits (every policy but
        `standby` with a forecast)."""
        return None

    def _decision(self, ctx: ScalingContext, desired: int, reason: str, detail: str,
                  **inputs: float | int | None) -> ScalingDecision:  # fmt: skip
        """Clamp ``desired`` to the bounds and build (and remember) the decision."""
        final = self.bounds.clamp(desired)
        if final != desired:
            edge = "max" if desired > self.bounds.max else "min"
            detail = f"{detail}; capped at spec.replicas.{edge} = {final}"
            if final == ctx.desired:
                reason = f"at_{edge}_replicas"
        decision = ScalingDecision(ctx.now_s, ctx.desired, final, reason, detail, inputs)
        self.last = decision
        return decision

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, interval_s={self.interval_s})"


def policy_names() -> list[str]:
    """Names of the registered scaling policies, sorted."""
    return SCALING_POLICIES.names()


def make_policy(spec: AutoscalingSpec, bounds: ReplicaBounds) -> ScalingPolicy:
    """A fresh instance of ``spec.policy``. Raises KeyError (listing the known names)."""
    return SCALING_POLICIES.get(spec.policy)(spec, bounds)


class Stabilizer:
    """Kubernetes HPA's stabilisation of recommendations (`stabilizeRecommendationWithBehaviors`
    in kubernetes/pkg/controller/podautoscaler/horizontal.go): remember each recommendation;
    scale up only to the lowest one of the last ``up_window_s`` and down only to the highest
    one of the last ``down_window_s`` seconds (the current one included in both)."""

    def __init__(self, up_window_s: float, down_window_s: float) -> None:
        self.up_window_s = up_window_s
        self.down_window_s = down_window_s
        self._recs: deque[tuple[float, int]] = deque()
        self._seed: tuple[float, int] | None = None

    def seed(self, now_s: float, replicas: int) -> None:
        """Count ``replicas`` as a scale-down recommendation made at ``now_s`` (the start: no
        scale-down before a whole window has passed; a scale-up is not held back)."""
        self._seed = (now_s, replicas)

    def apply(self, now_s: float, current: int, recommendation: int) -> int:
        """Record ``recommendation``; return the stabilised replica count from ``current``."""
        recs = self._recs
        up_cut_s, down_cut_s = now_s - self.up_window_s, now_s - self.down_window_s
        up = min([recommendation, *(r for t, r in recs if t > up_cut_s)])
        down = max([recommendation, *(r for t, r in recs if t > down_cut_s)])
        if self._seed is not None and self._seed[0] > down_cut_s:
            down = max(down, self._seed[1])
        recs.append((now_s, recommendation))
        keep_s = max(self.up_window_s, self.down_window_s)
        while recs and recs[0][0] <= now_s - keep_s:
            recs.popleft()
        if current < up:
            return up
        if current > down:
            return down
        return current


def limit_rate(current: int, desired: int, *, up_rate: float, up_step: int, down_rate: float) -> int:
    """Bound one decision's change: up to max(ceil(current x up_rate), current + up_step), down
    to min(floor(current / down_rate), current - 1) (one replica can always go)."""
    if desired > current:
        return min(desired, max(math.ceil(current * up_rate), current + up_step))
    if desired < current:
        return max(desired, min(math.floor(current / down_rate), current - 1))
    return desired


def _slope(points: list[tuple[float, float]]) -> float:
    """Theil-Sen slope (per second) of ``points`` (time, value): the median of the slopes
    between every pair. Unlike least squares, one outlier (a p99 spike, a momentary dip) cannot
    tilt it: it tolerates up to 29 % bad points (Sen 1968)."""
    slopes = [(v2 - v1) / (t2 - t1) for i, (t1, v1) in enumerate(points) for t2, v2 in points[i + 1:] if t2 != t1]
    if not slopes:
        return 0.0
    slopes.sort()
    mid = len(slopes) // 2
    return slopes[mid] if len(slopes) % 2 else (slopes[mid - 1] + slopes[mid]) / 2


class FleetPolicy(ScalingPolicy, name="fleet"):
    """Scale on queue time and p99 TTFT: up fast, on a breach or a projected one within the
    start-up time; down slowly, with hysteresis, stabilisation and a learned load floor (see
    the module docstring).

    Reasons: ``queue_time_above_target``, ``ttft_p99_above_target``, ``queue_time_projected``,
    ``ttft_p99_projected``, ``demand_without_replicas`` (up); ``underloaded`` (down);
    ``scale_up_in_progress``, ``within_band``, ``stabilizing``, ``at_max_replicas``,
    ``at_min_replicas`` (hold).
    """

    SIGNALS: ClassVar[tuple[str, ...]] = ("queue_time", "ttft_p99")

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        super().__init__(spec, bounds)
        self._ratios: deque[tuple[float, float | None, float | None, int]] = deque()  # (t, q, ttft, ready)
        self._ready: deque[tuple[float, int]] = deque()
        self._stabilizer = Stabilizer(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
        self._seeded = False
        # (seen at, load per READY replica, arrival rate per READY replica)
        self._pending_capacity: deque[tuple[float, float, float]] = deque()
        self._capacity: deque[tuple[float, float, float]] = deque()
        # (seen at, arrival rate, load) per READY replica, every decision: what an overload's
        # signal window was produced by (kept `window_seconds` + `trend_window_seconds`)
        self._demand: deque[tuple[float, float, float]] = deque()
        # (seen at, arrival rate, load) per READY replica at the peak behind a broken target
        self._overloads: deque[tuple[float, float, float]] = deque()

    # ----- signals ------------------------------------------------------------------------

    def _ratios_of(self, s: Signals) -> dict[str, float]:
        out = {}
        if s.queue_time_s is not None:
            out["queue_time"] = s.queue_time_s / self.spec.queue_time_target_seconds
        if s.ttft_p99_s is not None and s.ttft_samples >= MIN_TTFT_SAMPLES:
            out["ttft_p99"] = s.ttft_p99_s / self.spec.ttft_p99_target_seconds
        return out

    def _projection(self, now_s: float, horizon_s: float, ready: int) -> tuple[str, float] | None:
        """The signal whose trend (Theil-Sen) reaches highest ``horizon_s`` ahead, and that ratio;
        None without a trend (fewer than 3 points, or spanning under two intervals). Only
        points measured with today's READY count count: a trend across a scaling step is the
        step, not the load."""
        best: tuple[str, float] | None = None
        for index, signal in enumerate(self.SIGNALS, start=1):
            points: list[tuple[float, float]] = []
            for entry in self._ratios:
                ratio = entry[index]
                if ratio is not None and entry[3] == ready:
                    points.append((entry[0], ratio))  # type: ignore[arg-type]
            span_s = points[-1][0] - points[0][0] if points else 0.0
            if len(points) < 3 or span_s < 2 * self.interval_s:
                continue
            latest = points[-1][1]
            if latest < self.spec.scale_down_below_fraction:
                continue  # far below target: a slope here is noise, not a coming breach
            # Never extrapolate further ahead than the points reach back.
            projected = latest + max(0.0, _slope(points)) * min(horizon_s, span_s)
            if best is None or projected > best[1]:
                best = (signal, projected)
        return best

    def _replicas_behind_signals(self, now_s: float, ready: int) -> float:
        """Time-weighted mean of the READY count over the signal window: the replicas that
        produced the windowed signals. Right after new replicas join, the window still holds
        what fewer replicas did; sizing from today's count would overshoot."""
        history = self._ready
        history.append((now_s, ready))
        since_s = now_s - self.spec.window_seconds
        while len(history) > 1 and history[1][0] <= since_s:
            history.popleft()
        total_s = weighted = 0.0
        for (t, n), (t_next, _) in zip(history, [*list(history)[1:], (now_s, ready)]):
            span_s = t_next - max(t, since_s)
            if span_s > 0 and n > 0:  # with no READY replica nothing was served: no evidence
                total_s += span_s
                weighted += span_s * n
        return weighted / total_s if total_s > 0 else float(ready)

    # ----- capacity -----------------------------------------------------------------------

    @staticmethod
    def _load(s: Signals) -> float:
        little = s.arrival_rate_per_s * s.e2e_mean_s if s.e2e_mean_s is not None else 0.0
        return max(float(s.concurrency), little)

    def _learn_capacity(self, now_s: float, pressure: float | None, load: float, rate: float, ready: int) -> None:
        """Confirm the load and the arrival rate per replica seen a whole window ago if the
        window since met the targets; queue today's for confirmation."""
        window_s = self.spec.window_seconds
        pending = self._pending_capacity
        while pending and pending[0][0] <= now_s - window_s:
            seen_s, per_replica, rate_per_replica = pending.popleft()
            if pressure is not None and pressure <= 1.0:
                self._capacity.append((seen_s, per_replica, rate_per_replica))
        if pressure is not None and pressure <= 1.0 and ready > 0 and load > 0:
            pending.append((now_s, load / ready, rate / ready))
        elif pressure is not None and pressure > 1.0:
            pending.clear()  # the targets broke: what was pending was not sustainable
        while self._capacity and self._capacity[0][0] < now_s - CAPACITY_MEMORY_S:
            self._capacity.popleft()

    def _learn_overload(self, now_s: float, pressure: float | None, latency_s: float | None, rate: float,
                        load: float, ready: int) -> None:  # fmt: skip
        """Remember the arrival rate and the load per READY replica at which a target broke, for
        `CAPACITY_MEMORY_S`: the peak of each over the requests the broken signal describes,
        those that arrived within the signal window plus the signal's own latency ago
        (``latency_s``: the queue time or p99 TTFT measured; capped at `trend_window_seconds`).

        Not the rate of this tick: a windowed latency lags the load that caused it, so right
        after a burst ends the signal still breaks while the arrival rate has already fallen,
        and an overload remembered at that low rate would bar every probe for 30 minutes (seen
        in `tests/integration/test_autoscale_sim.py`: one client left, "overloaded" at 0.2 req/s)."""
        spec, demand = self.spec, self._demand
        if ready > 0:
            demand.append((now_s, rate / ready, load / ready))
        while demand and demand[0][0] < now_s - spec.window_seconds - spec.trend_window_seconds:
            demand.popleft()
        if pressure is not None and pressure > 1.0 and demand:
            since_s = now_s - spec.window_seconds - min(latency_s or 0.0, spec.trend_window_seconds)
            seen = [(rate_each, load_each) for t, rate_each, load_each in demand if t >= since_s]
            peak_rate, peak_load = max(r for r, _ in seen), max(x for _, x in seen)
            if peak_rate > 0:
                self._overloads.append((now_s, peak_rate, peak_load))
        while self._overloads and self._overloads[0][0] < now_s - CAPACITY_MEMORY_S:
            self._overloads.popleft()

    def per_replica_overload_rate(self) -> float | None:
        """Lowest arrival rate per READY replica remembered for an overload (requests/s; the peak
        behind a broken target, `_learn_overload`), or None."""
        return min((r for _, r, _ in self._overloads), default=None)

    def _may_probe(self, pressure: float | None, rate: float, load: float, current: int) -> bool:
        """Whether one replica fewer than the floor allows is worth trying (module docstring):
        not while what each remaining replica would take, in arrival rate AND in load, reaches
        `PROBE_MARGIN` of an overload remembered. Both count: a closed loop of few clients
        sends fast when nothing waits (a high rate at a load of one request), and that is no
        overload however high the rate."""
        if pressure is None or current - 1 < max(self.bounds.min, 1):
            return False
        if pressure >= self.spec.scale_down_below_fraction * PROBE_BELOW_FRACTION:
            return False
        rate_each, load_each = rate / (current - 1), load / (current - 1)
        return not any(rate_each >= PROBE_MARGIN * o_rate and load_each >= PROBE_MARGIN * o_load
                       for _, o_rate, o_load in self._overloads)  # fmt: skip

    def per_replica_capacity(self) -> float | None:
        """Largest confirmed sustainable load per READY replica (requests), or None."""
        return max((c for _, c, _ in self._capacity), default=None)

    def per_replica_rate_capacity(self) -> float | None:
        """Largest confirmed sustainable arrival rate per READY replica (requests/s), or None."""
        return max((r for _, _, r in self._capacity), default=None) or None

    def _load_floor(self, load: float, rate: float, ready: int) -> int:
        """Replicas the load needs at the confirmed capacities: the requests in the system per
        replica, and the arrival rate per replica (requests/s). Both count: a replica can hold
        many long requests at once yet serve only so many per second, and concurrency measured
        with more replicas understates what fewer would hold (each request takes longer)."""
        capacity = self.per_replica_capacity()
        if load <= 0:
            return 0
        if capacity is None:
            return ready
        need = math.ceil(load / capacity - 1e-9)
        rate_capacity = self.per_replica_rate_capacity()
        if rate > 0 and rate_capacity is not None:
            need = max(need, math.ceil(rate / rate_capacity - 1e-9))
        return need

    # ----- the decision -------------------------------------------------------------------

    def _early_up(self, ctx: ScalingContext, pressure: float | None, floor: int) -> tuple[int, str, str] | None:
        """A scale-up before any target is at risk: (replicas wanted, reason, detail), or None.
        Fleet's policy has none (a subclass with faster capacity at hand may: `autoscaler.standby`).
        Asked after the breach and the projection, with the pressure and the load floor of this
        decision."""
        return None

    def _lowest(self, ctx: ScalingContext) -> int:
        """Fewest replicas a scale-down may leave: ``spec.replicas.min`` (a subclass that knows
        what is coming may keep more: `autoscaler.standby`)."""
        return self.bounds.min

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        spec, s, now_s = self.spec, ctx.signals, ctx.now_s
        if not self._seeded:
            self._stabilizer.seed(now_s, ctx.desired)
            self._seeded = True
        ratios = self._ratios_of(s)
        self._ratios.append((now_s, ratios.get("queue_time"), ratios.get("ttft_p99"), ctx.ready))
        while self._ratios and self._ratios[0][0] < now_s - spec.trend_window_seconds:
            self._ratios.popleft()
        signal, pressure = max(ratios.items(), key=lambda kv: kv[1]) if ratios else (None, None)
        load = self._load(s)
        self._learn_capacity(now_s, pressure, load, s.arrival_rate_per_s, ctx.ready)
        floor = self._load_floor(load, s.arrival_rate_per_s, ctx.ready)
        horizon_s = min(ctx.startup.lead_time_s, spec.trend_window_seconds)
        projection = self._projection(now_s, horizon_s, ctx.ready)
        behind = self._replicas_behind_signals(now_s, ctx.ready)
        latency_s = {"queue_time": s.queue_time_s, "ttft_p99": s.ttft_p99_s}.get(signal) if signal else None
        self._learn_overload(now_s, pressure, latency_s, s.arrival_rate_per_s, load, ctx.ready)
        current = ctx.desired
        inputs: dict[str, float | int | None] = {
            "queue_time_s": s.queue_time_s, "ttft_p99_s": s.ttft_p99_s, "pressure": pressure,
            "projected": projection[1] if projection else None, "load": load,
            "per_replica_capacity": self.per_replica_capacity(),
            "per_replica_rate_capacity": self.per_replica_rate_capacity(), "load_floor": floor,
            "per_replica_overload_rate": self.per_replica_overload_rate(),
            "lead_time_s": ctx.startup.lead_time_s, "ready": ctx.ready, "starting": ctx.starting,
            "replicas_behind_signals": behind,
        }  # fmt: skip

        scaling_up = True
        if pressure is not None and pressure > 1.0:
            want = max(math.ceil(behind * pressure - 1e-9), 1, floor)
            reason = f"{signal}_above_target"
            detail = f"{signal} at {pressure:.2f}x target"
            if behind < ctx.ready:
                detail = f"{detail} over a window averaging {behind:.1f} READY replica(s)"
        elif projection is not None and projection[1] > 1.0 + 1e-9:
            want = max(math.ceil(ctx.ready * projection[1] - 1e-9), ctx.ready + 1, floor)
            reason = f"{projection[0]}_projected"
            detail = f"{projection[0]} heading to {projection[1]:.2f}x target within {horizon_s:.0f} s"
        elif (early := self._early_up(ctx, pressure, floor)) is not None:
            want, reason, detail = early
        elif ctx.ready == 0 and (s.concurrency > 0 or s.arrival_rate_per_s > 0):
            want, reason = max(1, floor), "demand_without_replicas"
            detail = f"{s.concurrency} requests and no READY replica"
        elif pressure is None or pressure < spec.scale_down_below_fraction:
            # The floor only holds a scale-down back: it is a lower bound of the replicas the
            # load needs (capacity is learned as a lower bound), never a reason to add any.
            scaling_up = False
            lowest = self._lowest(ctx)
            want, reason = max(min(floor, current), lowest), "underloaded"
            level = "no latency signal" if pressure is None else f"{signal} at {pressure:.2f}x target"
            detail = f"{level}, load {load:.1f} needs {floor} replica(s)"
            if floor > current:
                detail = f"{detail} at the capacity learned so far, but the {current} targeted carry it"
            if lowest < current <= want and self._may_probe(pressure, s.arrival_rate_per_s, load, current):
                want = current - 1
                detail = (f"{detail}; probing {want}: {s.arrival_rate_per_s / want:.1f} req/s and load "
                          f"{load / want:.1f} per replica, under {PROBE_MARGIN:.0%} of any overload seen")  # fmt: skip
        else:
            scaling_up = False
            want, reason = current, "within_band"
            detail = f"{signal} at {pressure:.2f}x target (scale down below {spec.scale_down_below_fraction:g}x)"

        if scaling_up and want <= current:
            reason = "scale_up_in_progress"
            detail = f"{detail}; {current} replica(s) targeted ({ctx.starting} starting) cover {want}"
            want = current
        stabilized = self._stabilizer.apply(now_s, current, want)
        if want < current and stabilized == current:
            reason = "stabilizing"
            detail = (f"{detail}; holding {current}: recommended {want}, but the highest recommendation "
                      f"of the last {spec.scale_down_stabilization_seconds:g} s is higher")  # fmt: skip
        elif want > current and stabilized == current:
            reason = "stabilizing"
            detail = f"{detail}; scale-up stabilisation window not yet passed"
        elif stabilized < current and behind > ctx.ready + 1e-9:
            # The low signals still include what more replicas did (a scale-down within the
            # window): see what today's count does before going lower. Not a recommendation.
            stabilized, reason = current, "stabilizing"
            detail = (f"{detail}; holding {current}: the signal window still averages {behind:.1f} READY "
                      f"replica(s), {ctx.ready} now")  # fmt: skip
        desired = limit_rate(current, stabilized, up_rate=spec.max_scale_up_rate, up_step=spec.max_scale_up_step,
                             down_rate=spec.max_scale_down_rate)  # fmt: skip
        if desired != stabilized:
            detail = f"{detail}; rate-limited to {desired}"
        return self._decision(ctx, desired, reason, detail, **inputs)
