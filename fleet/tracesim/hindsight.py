"""The hindsight-optimal schedule: the cheapest replica count per interval that keeps the SLO on a
trace known in advance, paying every start-up. The yardstick `fleet simulate` holds each scaling
policy to (replica-hours, and cost with ``--prices``), beside the best fixed fleet.

Owns `slo_capacity_per_s` (one replica's throughput at the SLO), `drain_s_at` (the seconds a
stopped replica drains), `Demand` (`demand_of`: arrivals and replicas needed per interval),
`Schedule` (`schedule_of`: what given counts pay and miss), `solve` (dynamic programming over
replica counts per interval), and `best_fixed` (the cheapest constant count in the model).
Called by `fleet simulate` (`fleet/cli/simulate.py`) through `yardsticks` and by the benchmarks
`loadtests/hindsight_replay.py` and `loadtests/oracle_bound.py`. Pure: no I/O, no clock; numpy
for the DP.

The model, stated once (docs/autoscaling.md, "The hindsight-optimal schedule"):

- Capacity at the SLO (`slo_capacity_per_s`): the highest Poisson arrival rate of the trace's
  request mix (a stride sample, as `fleet.tracesim.workload.replica_capacity_per_s` takes it)
  at which ONE simulated replica (`fleet.enginesim.model.EngineModel` under the profile's
  calibrated step cost, run by `run_virtual` in virtual time) answers at least ``share`` of the
  requests within the TTFT SLO; found by bisection between 0 and its saturated throughput.
- Demand (`demand_of`): the trace cut into intervals of ``interval_s`` (`yardsticks`: the TTFT
  SLO, since a request's first token is due that long after it arrives); ``n`` replicas serve
  ``n x capacity x interval`` requests of an interval within the SLO, and the arrivals beyond
  that count as missed. An interval's need is ``ceil(arrivals / (capacity x interval))``.
  Queues carried from one interval into the next are not modelled (each interval on its own).
- Keeping the SLO (`solve`): at most ``miss_budget`` of all requests missed (0: every interval's
  need met; 0.01: at least 99 % of the requests within the SLO).
- Cost: replica-seconds. A replica READY in interval t was started ``startup_s`` before it (the
  warm start-up) and is paid from then: each start costs ``startup_s`` replica-seconds and
  cannot begin before the trace does (so a burst sooner than ``startup_s`` after the start is
  met only by the replicas there at 0 s; the first interval's count is free, READY at 0 s, as
  the simulator's first replicas are). A replica stopped at an interval's end leaves the pool
  then and drains: its requests in flight finish, as a scale-down in the simulator and the
  controller drains a READY replica; each stop pays ``drain_s`` replica-seconds (`drain_s_at`:
  the mix's mean end-to-end latency at one replica's capacity at the SLO). Between
  ``min_replicas`` (``spec.replicas.min``) and the need of the busiest interval;
  ``spec.replicas.max`` is not applied (as for the fixed fleets).
- Standby counted as the policies count it: a STANDBY replica holds its GPU and is paid like
  a READY one (`fleet.tracesim.replica.VirtualReplica.cost_s`), so in hindsight a sleeper is never
  cheaper than the same replica awake: the optimum sleeps none, and the wake-up time never binds.

`solve` with a miss budget is a Lagrangian relaxation: each missed request costs ``price``
replica-seconds, the DP minimises replica-seconds + price x misses exactly, and the price is
bisected to the lowest at which the misses fit the budget. The schedule it returns keeps the
budget; its cost is optimal for its own number of misses, and may exceed the optimum at exactly
the budget by the duality gap (reported as ``missed``: what it actually misses).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fleet.enginesim.model import Arrival, EngineModel, FinishedRequest, run_virtual
from fleet.enginesim.profiles import Profile
from fleet.tracesim.config import SimConfig
from fleet.tracesim.traces import Trace
from fleet.tracesim.workload import Workload, prompt_ids, replica_capacity_per_s

SLO_CAPACITY_SAMPLE = 1000
"""Requests of the trace's mix a capacity probe replays (a stride sample)."""

SLO_CAPACITY_STEPS = 12
"""Bisection steps of `slo_capacity_per_s`: the rate to within 2**-12 of the saturated throughput."""

PRICE_STEPS = 30
"""Bisection steps on the price of a missed request (`solve`): to 2**-30 of the highest price."""


def _probe(trace: Trace, profile: Profile, rate_per_s: float, sample: int, seed: int) -> list[FinishedRequest]:
    """A stride sample of ``trace`` through one replica, arriving as a Poisson process of
    ``rate_per_s``: the requests as they finished."""
    reqs = trace.requests
    picked = reqs[:: max(1, math.ceil(len(reqs) / sample))]
    rng = random.Random(f"slo-capacity:{seed}")
    at_s, arrivals = 0.0, []
    for i, r in enumerate(picked):
        at_s += rng.expovariate(rate_per_s)
        arrivals.append(Arrival(at_s, str(i), prompt_ids(i, r, seed), r.output_tokens))
    return run_virtual(EngineModel(profile.config, profile.cost), arrivals)


def _share_within(trace: Trace, profile: Profile, rate_per_s: float, ttft_slo_s: float, sample: int,
                  seed: int) -> float:  # fmt: skip
    """Share of a stride sample of ``trace`` answered within ``ttft_slo_s`` by one replica when it
    arrives as a Poisson process of ``rate_per_s``."""
    finished = _probe(trace, profile, rate_per_s, sample, seed)
    within = sum(1 for f in finished if f.first_token_s is not None and f.first_token_s - f.arrival_s <= ttft_slo_s)
    return within / len(finished) if finished else 1.0


def drain_s_at(trace: Trace, profile: Profile, rate_per_s: float, *, sample: int = SLO_CAPACITY_SAMPLE,
               seed: int = 0) -> float:  # fmt: skip
    """Seconds a replica stopped at ``rate_per_s`` keeps running to finish its requests in flight
    (module docstring, "Cost"): the mean end-to-end latency of the trace's mix at that rate
    (the same probe as `slo_capacity_per_s`). Raises ValueError for an empty trace or a
    non-positive rate."""
    if not trace.requests:
        raise ValueError("trace: no requests to measure a drain on")
    if not rate_per_s > 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    finished = _probe(trace, profile, rate_per_s, sample, seed)
    return sum(f.finished_s - f.arrival_s for f in finished) / len(finished)


def slo_capacity_per_s(trace: Trace, profile: Profile, ttft_slo_s: float, share: float = 0.99, *,
                       sample: int = SLO_CAPACITY_SAMPLE, seed: int = 0) -> float:  # fmt: skip
    """Requests/s one replica takes while answering ``share`` of them within ``ttft_slo_s``
    seconds (module docstring, "Capacity at the SLO"): bisection between 0 and the saturated
    throughput (`replica_capacity_per_s`). Raises ValueError for an empty trace, a non-positive
    SLO or ``share`` outside (0, 1]."""
    if not trace.requests:
        raise ValueError("trace: no requests to measure a replica's capacity on")
    if ttft_slo_s <= 0:
        raise ValueError(f"ttft_slo_s must be > 0, got {ttft_slo_s}")
    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1], got {share}")
    hi = replica_capacity_per_s(trace, profile, sample=sample)
    lo = 0.0
    for _ in range(SLO_CAPACITY_STEPS):
        mid = (lo + hi) / 2
        if _share_within(trace, profile, mid, ttft_slo_s, sample, seed) >= share:
            lo = mid
        else:
            hi = mid
    return lo if lo > 0 else hi / 2 ** SLO_CAPACITY_STEPS


@dataclass(frozen=True)
class Demand:
    """A trace in intervals: ``interval_s`` each (the last one shorter when the horizon ends
    inside it: ``seconds``), ``arrivals`` per interval, ``capacity_per_s`` of one replica at the
    SLO; ``need``: replicas each interval needs (ceil of arrivals over one replica's share)."""

    interval_s: float
    seconds: np.ndarray
    arrivals: np.ndarray
    capacity_per_s: float

    @property
    def need(self) -> np.ndarray:
        return np.ceil(self.arrivals / (self.capacity_per_s * self.seconds) - 1e-9).astype(int)

    @property
    def requests(self) -> int:
        return int(self.arrivals.sum())

    def missed(self, replicas: np.ndarray) -> np.ndarray:
        """Requests per interval beyond what ``replicas`` (one count per interval) serve within the SLO."""
        return np.maximum(0.0, self.arrivals - replicas * self.capacity_per_s * self.seconds)


def demand_of(arrivals_s: Sequence[float], horizon_s: float, capacity_per_s: float,
              interval_s: float = 10.0) -> Demand:  # fmt: skip
    """The `Demand` of arrivals at ``arrivals_s`` (seconds from the trace's start) over
    ``[0, horizon_s]``. Raises ValueError for a non-positive capacity, interval or horizon."""
    for name, value in (("capacity_per_s", capacity_per_s), ("interval_s", interval_s), ("horizon_s", horizon_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    bins = max(1, math.ceil(horizon_s / interval_s - 1e-9))
    seconds = np.full(bins, float(interval_s))
    seconds[-1] = horizon_s - (bins - 1) * interval_s
    index = np.minimum(bins - 1, (np.asarray(arrivals_s, dtype=float) // interval_s).astype(int))
    arrivals = np.bincount(index, minlength=bins).astype(float) if len(index) else np.zeros(bins)
    return Demand(float(interval_s), seconds, arrivals, capacity_per_s)


@dataclass(frozen=True)
class Schedule:
    """Replicas READY per interval (``replicas``), ``starts`` (replicas started after 0 s),
    ``stops``, ``replica_s`` (replica-seconds paid: READY time plus ``startup_s`` per start and
    ``drain_s`` per stop), ``missed`` (requests beyond the capacity at the SLO, by the model) of
    ``requests``."""

    demand: Demand
    replicas: np.ndarray
    starts: int
    replica_s: float
    missed: float
    requests: int
    stops: int = 0

    @property
    def replica_hours(self) -> float:
        return self.replica_s / 3600.0

    @property
    def within_share(self) -> float:
        """Share of the requests the model counts within the SLO."""
        return 1.0 - self.missed / self.requests if self.requests else 1.0

    def to_dict(self) -> dict[str, object]:
        return {"replica_hours": self.replica_hours, "starts": self.starts, "stops": self.stops,
                "peak_replicas": int(self.replicas.max()),
                "within_slo_model": self.within_share, "interval_s": self.demand.interval_s,
                "capacity_per_replica_at_slo_per_s": self.demand.capacity_per_s}  # fmt: skip


def _dp(demand: Demand, startup_s: float, low: int, high: int, price: float | None, drain_s: float = 0.0,
        block: int = 1) -> np.ndarray:  # fmt: skip
    """The replica count per interval that minimises replica-seconds (+ ``price`` x missed
    requests; None: every interval's need met, a hard constraint), each start paying
    ``startup_s`` and each stop ``drain_s``; counts change only every ``block`` intervals.
    Exact over counts ``low..high``; ties go to fewer replicas."""
    counts = np.arange(high + 1, dtype=float)
    held = demand.seconds[:, None] * counts[None, :]                        # [interval, count]
    per_replica = demand.capacity_per_s * demand.seconds                     # requests one replica serves
    missed = np.maximum(0.0, demand.arrivals[:, None] - counts[None, :] * per_replica[:, None])
    stage = held + (np.where(missed > 1e-9, np.inf, 0.0) if price is None else price * missed)
    stage[:, counts < low] = np.inf
    t_count = len(demand.seconds)
    if block > 1:
        stage = np.add.reduceat(stage, np.arange(0, t_count, block), axis=0)   # [block, count]
    step = counts[None, :] - counts[:, None]                                  # [from, to]
    rise = np.maximum(0.0, step) * startup_s + np.maximum(0.0, -step) * drain_s   # the starts and drains paid
    frozen = np.where(step > 0, np.inf, rise)                               # no start can have begun yet
    first_rise = min(len(stage), math.ceil(startup_s / (demand.interval_s * block) - 1e-9))
    back = np.zeros(stage.shape, dtype=np.int32)
    columns = np.arange(high + 1)
    value = stage[0]
    for t in range(1, len(stage)):
        cost = value[:, None] + (frozen if t < first_rise else rise)
        back[t] = best = np.argmin(cost, axis=0)
        value = cost[best, columns] + stage[t]
    n = int(np.argmin(value))
    if not np.isfinite(value[n]):
        raise ValueError("no schedule within the counts meets every interval's need")
    out = np.zeros(len(stage), dtype=int)
    for t in range(len(stage) - 1, -1, -1):
        out[t] = n
        n = int(back[t][n])
    return np.repeat(out, block)[:t_count]


def schedule_of(demand: Demand, replicas: np.ndarray, startup_s: float, drain_s: float = 0.0) -> Schedule:
    """The `Schedule` of ``replicas`` (one count per interval of ``demand``): what it pays, each
    start ``startup_s`` and each stop ``drain_s``, and what it misses, by the model."""
    steps = np.diff(replicas)
    starts, stops = int(np.maximum(0, steps).sum()), int(np.maximum(0, -steps).sum())
    paid_s = float((replicas * demand.seconds).sum()) + startup_s * starts + drain_s * stops
    return Schedule(demand, replicas, starts, paid_s, float(demand.missed(replicas).sum()), demand.requests, stops)


def solve(demand: Demand, startup_s: float, *, min_replicas: int = 0, miss_budget: float = 0.0,
          drain_s: float = 0.0, block: int = 1) -> Schedule:  # fmt: skip
    """The hindsight-optimal schedule of ``demand`` (module docstring): replicas per interval,
    at least ``min_replicas``, each start paying ``startup_s`` seconds and begun at or after 0 s,
    each stop paying ``drain_s`` seconds (its requests in flight finish), missing at most
    ``miss_budget`` (a share, 0..1) of the requests. ``block`` > 1: the count changes only
    every ``block`` intervals (the optimum of a fleet that acts at that resolution).

    Raises ValueError for a negative ``startup_s``, ``drain_s`` or ``min_replicas``, a ``block``
    below 1, or ``miss_budget`` outside [0, 1)."""
    for name, value in (("startup_s", startup_s), ("drain_s", drain_s), ("min_replicas", min_replicas)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if not 0 <= miss_budget < 1:
        raise ValueError(f"miss_budget must be in [0, 1), got {miss_budget}")
    high = max(min_replicas, int(demand.need.max()))

    def schedule(price: float | None) -> Schedule:
        counts = _dp(demand, startup_s, min_replicas, high, price, drain_s, block)
        return schedule_of(demand, counts, startup_s, drain_s)

    exact = schedule(None)
    allowed = miss_budget * demand.requests
    if allowed <= 0:
        return exact
    lo, hi = 0.0, (float(demand.seconds.sum()) + startup_s + drain_s) * max(1, high)   # hi: no miss is worth it
    best = exact
    for _ in range(PRICE_STEPS):
        price = (lo + hi) / 2
        s = schedule(price)
        if s.missed <= allowed + 1e-9:
            hi = price
            if s.replica_s <= best.replica_s:
                best = s
        else:
            lo = price
    return best


def best_fixed(demand: Demand, *, min_replicas: int = 0, miss_budget: float = 0.0) -> Schedule:
    """The cheapest constant replica count (READY from 0 s, no start paid) that misses at most
    ``miss_budget`` of the requests in the same model: the model's counterpart of the best
    fixed fleet the simulator finds by running fixed sizes."""
    allowed = miss_budget * demand.requests
    n = max(1, min_replicas)
    while float(demand.missed(np.full(len(demand.seconds), n)).sum()) > allowed + 1e-9:
        n += 1
    return schedule_of(demand, np.full(len(demand.seconds), n), 0.0)


@dataclass(frozen=True)
class Yardsticks:
    """What a policy's replica-hours are held to on one workload: ``optimum`` (`solve`) and the
    model's ``fixed`` (`best_fixed`), both missing at most ``1 - share`` of the requests; every
    start pays ``startup_s`` and every stop of the optimum ``drain_s``."""

    optimum: Schedule
    fixed: Schedule
    share: float
    startup_s: float
    drain_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        fixed = {**self.fixed.to_dict(), "replicas": int(self.fixed.replicas[0])}
        return {"model": "fleet/tracesim/hindsight.py", "within_slo_share": self.share, "startup_s": self.startup_s,
                "drain_s": self.drain_s, "optimum": self.optimum.to_dict(), "best_fixed_model": fixed}


def yardsticks(workload: Workload, profile: Profile, config: SimConfig, share: float = 0.99,
               interval_s: float | None = None) -> Yardsticks:  # fmt: skip
    """The hindsight-optimal schedule and the model's best fixed fleet of ``workload`` for the
    replicas ``profile`` models, under ``config``'s SLO (``ttft_slo_s``), warm start-up
    (``warm_startup_s``: every start pays it), drain (`drain_s_at` one replica's capacity at the
    SLO: every stop pays it) and ``bounds.min``; intervals of ``interval_s`` (default: the TTFT
    SLO). Raises ValueError as `slo_capacity_per_s` and `solve` do."""
    capacity = slo_capacity_per_s(workload.trace, profile, config.ttft_slo_s, share, seed=config.seed)
    drain_s = drain_s_at(workload.trace, profile, capacity, seed=config.seed)
    demand = demand_of([r.arrival_s for r in workload.requests], max(workload.duration_s, 1e-9), capacity,
                       config.ttft_slo_s if interval_s is None else interval_s)  # fmt: skip
    budget = 1.0 - share
    optimum = solve(demand, config.warm_startup_s, min_replicas=config.bounds.min, miss_budget=budget, drain_s=drain_s)
    return Yardsticks(optimum, best_fixed(demand, min_replicas=config.bounds.min, miss_budget=budget), share,
                      config.warm_startup_s, drain_s)  # fmt: skip
