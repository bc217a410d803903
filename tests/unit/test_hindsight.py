"""The hindsight-optimal schedule (fleet/tracesim/hindsight.py) on hand-checked cases: a step,
a spike sooner than a start-up can answer, a gap held or restarted by the price of a start, the
miss budget, the exact optimum against brute force, the model's best fixed fleet, one replica's
capacity at the SLO, and clear errors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from fleet.tracesim.hindsight import Demand, best_fixed, demand_of, drain_s_at, slo_capacity_per_s, solve
from fleet.tracesim.workload import replica_capacity_per_s
from tests.unit.test_simulate import TINY, trace_of


def demand(*arrivals: float, interval_s: float = 10.0, capacity_per_s: float = 1.0) -> Demand:
    """Intervals of 10 s; one replica serves 10 requests of an interval within the SLO."""
    return Demand(interval_s, np.full(len(arrivals), interval_s), np.array(arrivals, dtype=float), capacity_per_s)


def test_a_step_is_met_by_starts_paid_at_the_start_up_time() -> None:
    d = demand(*[10] * 20, *[30] * 20)
    s = solve(d, startup_s=30.0, min_replicas=1)
    assert list(s.replicas) == [1] * 20 + [3] * 20
    assert s.starts == 2
    assert s.replica_s == pytest.approx(20 * 10 * 1 + 20 * 10 * 3 + 2 * 30)   # READY time + a start-up per start
    assert s.missed == 0 and s.within_share == 1.0


def test_a_spike_sooner_than_a_start_up_is_met_only_by_the_replicas_there_at_the_start() -> None:
    d = demand(10, 30, *[10] * 10)          # the spike at 10-20 s; a start-up takes 30 s
    s = solve(d, startup_s=30.0, min_replicas=1)
    assert list(s.replicas[:2]) == [3, 3]   # no start could have begun before 0 s: three from the first second
    assert s.starts == 0 and list(s.replicas[2:]) == [1] * 10
    later = solve(demand(*[10] * 5, 30, *[10] * 6), startup_s=30.0, min_replicas=1)
    assert later.starts == 2 and list(later.replicas) == [1] * 5 + [3] + [1] * 6   # started in time, paid for it
    assert later.replica_s == pytest.approx(12 * 10 + 2 * 10 + 2 * 30)


@pytest.mark.parametrize(("gap", "held"), [(2, True), (5, False)])
def test_between_two_spikes_replicas_are_held_or_restarted_whichever_is_cheaper(gap: int, held: bool) -> None:
    # Holding 2 replicas across the gap costs gap x 10 s x 2; restarting them costs 2 x 30 s.
    d = demand(*[10] * 5, 30, *[10] * gap, 30, *[10] * 5)
    s = solve(d, startup_s=30.0, min_replicas=1)
    assert s.starts == (2 if held else 4)
    assert list(s.replicas[6:6 + gap]) == [3 if held else 1] * gap
    spikes = 2 * 10 * 3 + (5 + gap + 5) * 10
    extra = gap * 10 * 2 + 2 * 30 if held else 4 * 30
    assert s.replica_s == pytest.approx(spikes + extra)


def test_every_stop_pays_its_drain_so_a_gap_worth_restarting_without_it_is_held() -> None:
    # A gap of 4 intervals: holding 2 replicas costs 80 s, restarting them 2 x 30 s, plus 2 x 15 s
    # of drain for the 2 extra stops: held (a policy's scale-down drains too).
    d = demand(*[10] * 5, 30, *[10] * 4, 30, *[10] * 5)
    free = solve(d, startup_s=30.0, min_replicas=1)
    assert free.starts == 4 and free.stops == 4
    s = solve(d, startup_s=30.0, min_replicas=1, drain_s=15.0)
    assert s.starts == 2 and s.stops == 2 and list(s.replicas[6:10]) == [3] * 4
    assert s.replica_s == pytest.approx(2 * 10 * 3 + 14 * 10 + 4 * 10 * 2 + 2 * 30 + 2 * 15)


def test_a_blocked_schedule_changes_its_count_only_at_block_boundaries() -> None:
    d = demand(*[10] * 7, 30, *[10] * 7)
    s = solve(d, startup_s=30.0, min_replicas=1, block=3)
    assert list(s.replicas) == [1] * 6 + [3] * 3 + [1] * 6     # the spike's block of three held at 3
    assert s.replica_s == pytest.approx(15 * 10 + 3 * 10 * 2 + 2 * 30)
    assert s.replica_s > solve(d, startup_s=30.0, min_replicas=1).replica_s


def test_the_miss_budget_lets_a_small_spike_go_and_is_kept() -> None:
    d = demand(*[10] * 98, 15, 10)             # 5 requests over one replica's share, of 1,005
    exact = solve(d, startup_s=30.0, min_replicas=1)
    assert exact.starts == 1 and exact.missed == 0
    loose = solve(d, startup_s=30.0, min_replicas=1, miss_budget=0.01)
    assert loose.starts == 0 and loose.missed == pytest.approx(5) and loose.replica_s < exact.replica_s
    tight = solve(d, startup_s=30.0, min_replicas=1, miss_budget=0.004)   # 4.02 requests allowed: not enough
    assert tight.missed == 0 and tight.replica_s == pytest.approx(exact.replica_s)


def _brute_force(d: Demand, startup_s: float, low: int, high: int) -> float:
    best = np.inf
    first_rise = int(np.ceil(startup_s / d.interval_s - 1e-9))
    for counts in itertools.product(range(low, high + 1), repeat=len(d.seconds)):
        c = np.array(counts)
        rises = np.diff(c)
        if np.any(rises[: max(0, first_rise - 1)] > 0) or np.any(d.missed(c) > 1e-9):
            continue
        best = min(best, float((c * d.seconds).sum()) + startup_s * float(np.maximum(0, rises).sum()))
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_optimum_is_the_cheapest_of_every_schedule(seed: int) -> None:
    rng = np.random.default_rng(seed)
    d = demand(*rng.integers(0, 31, size=6).tolist())
    s = solve(d, startup_s=15.0)
    assert s.missed == 0
    assert s.replica_s == pytest.approx(_brute_force(d, 15.0, 0, int(d.need.max())))


def test_the_models_best_fixed_fleet_is_the_smallest_constant_that_keeps_the_budget() -> None:
    d = demand(*[10] * 98, 15, 30)
    assert best_fixed(d, min_replicas=1).replicas[0] == 3
    assert best_fixed(d, min_replicas=1, miss_budget=0.025).replicas[0] == 1   # 25 of 1,025 missed
    assert best_fixed(d, min_replicas=1, miss_budget=0.02).replicas[0] == 2    # 20.5 allowed: 5 missed at 2
    assert best_fixed(d, min_replicas=1).replica_s == pytest.approx(3 * 100 * 10)


def test_demand_bins_arrivals_and_the_last_interval_is_shorter() -> None:
    d = demand_of([0.0, 1.0, 9.9, 10.0, 24.0], horizon_s=25.0, capacity_per_s=0.5, interval_s=10.0)
    assert list(d.arrivals) == [3, 1, 1] and list(d.seconds) == [10, 10, 5]
    assert list(d.need) == [1, 1, 1] and d.requests == 5
    assert list(demand_of([0.0] * 11, 10.0, 1.0, 10.0).need) == [2]


def test_one_replicas_capacity_at_the_slo_is_below_saturation_and_grows_with_the_slo() -> None:
    trace = trace_of((60, 5.0))
    saturated = replica_capacity_per_s(trace, TINY)
    strict = slo_capacity_per_s(trace, TINY, ttft_slo_s=0.2, sample=200)
    lenient = slo_capacity_per_s(trace, TINY, ttft_slo_s=2.0, sample=200)
    assert 0 < strict < lenient < saturated
    assert 0 < drain_s_at(trace, TINY, strict, sample=200) < drain_s_at(trace, TINY, saturated, sample=200)


def test_bad_input_is_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="capacity_per_s must be > 0"):
        demand_of([1.0], 10.0, 0.0)
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        demand_of([1.0], 10.0, 1.0, interval_s=0.0)
    with pytest.raises(ValueError, match=r"miss_budget must be in \[0, 1\)"):
        solve(demand(10), 30.0, miss_budget=1.0)
    with pytest.raises(ValueError, match="startup_s must be >= 0"):
        solve(demand(10), -1.0)
    with pytest.raises(ValueError, match="drain_s must be >= 0"):
        solve(demand(10), 30.0, drain_s=-1.0)
    with pytest.raises(ValueError, match="block must be >= 1"):
        solve(demand(10), 30.0, block=0)
    with pytest.raises(ValueError, match="rate_per_s must be > 0"):
        drain_s_at(trace_of((10, 1.0)), TINY, 0.0)
    with pytest.raises(ValueError, match="share must be in"):
        slo_capacity_per_s(trace_of((10, 1.0)), TINY, 2.0, share=0.0)
