"""Windowed router statistics on a fake clock: nearest-rank percentiles, sliding windows, ring
overflow, per-second rates (router.stats.windows)."""

from __future__ import annotations

import random

import pytest

from router.stats.metrics import RouterMetrics
from router.pools.pool import PoolTable
from router.pools.spec import PoolSpec
from router.stats.windows import LatencySummary, ModelStats, RateWindow, SampleWindow, nearest_rank


def test_nearest_rank_matches_the_definition() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert nearest_rank(values, 0.5) == 50.0
    assert nearest_rank(values, 0.9) == 90.0
    assert nearest_rank(values, 0.99) == 99.0  # ceil(0.99 * 100) = 99, despite float error
    assert nearest_rank(values, 1.0) == 100.0
    assert nearest_rank([7.0], 0.99) == 7.0
    assert nearest_rank([1.0, 2.0, 3.0], 0.5) == 2.0  # ceil(1.5) = 2nd
    with pytest.raises(ValueError):
        nearest_rank([], 0.5)
    with pytest.raises(ValueError):
        nearest_rank(values, 0.0)


def test_latency_summary_is_exact_against_a_brute_force_reference() -> None:
    rng = random.Random(7)
    values = [rng.lognormvariate(0, 1) for _ in range(1013)]
    s = LatencySummary.of(values)
    ordered = sorted(values)
    n = len(values)
    # Reference: the smallest value with at least q * n values at or below it.
    for q, got in ((0.5, s.p50), (0.9, s.p90), (0.99, s.p99)):
        ref = next(v for i, v in enumerate(ordered, start=1) if i >= q * n)
        assert got == ref
    assert s.samples == n and s.max == ordered[-1]
    assert s.mean == pytest.approx(sum(values) / n)
    assert LatencySummary.of([]) == LatencySummary(0, None, None, None, None, None)


def test_sample_window_slides_with_the_clock() -> None:
    w = SampleWindow(capacity=100)
    for t in range(10):
        w.add(1000.0 + t, float(t))
    values, covered_s = w.values(1009.0, 5.0)  # [1004, 1009]
    assert values == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0]
    assert covered_s == 5.0
    values, _ = w.values(1020.0, 5.0)
    assert values == []  # everything aged out


def test_sample_window_that_overflows_reports_the_span_it_covers() -> None:
    w = SampleWindow(capacity=4)
    for t in range(10):
        w.add(float(t), float(t))
    values, covered_s = w.values(9.0, 30.0)
    assert sorted(values) == [6.0, 7.0, 8.0, 9.0]  # only the newest `capacity` samples
    assert covered_s == 3.0  # from the oldest kept sample (t=6) to now


def test_rate_window_counts_per_second_slices_and_forgets_old_ones() -> None:
    r = RateWindow(started_s=100.0, retention_s=10)
    for t in (100.2, 100.7, 101.5, 103.0, 103.9):
        r.add(t)
    count, covered_s = r.count(104.5, 10.0)
    assert count == 5
    assert covered_s == pytest.approx(4.5)  # never reaches back before the start
    count, covered_s = r.count(104.5, 2.0)  # slices 103 and 104
    assert count == 2
    assert covered_s == pytest.approx(1.5)
    # 20 s later the old slices are gone, even though the ring wrapped around.
    r.add(124.1, n=3)
    assert r.count(124.5, 10.0)[0] == 3


def test_model_stats_snapshot_on_fake_time() -> None:
    s = ModelStats(started_s=0.0)
    # 60 s of 2 requests/s; queue time 0 for the first 30 s, then 1 s; TTFT 0.1 then 2.0 s.
    for i in range(120):
        t = i * 0.5
        late = t >= 30.0
        s.arrivals.add(t)
        s.queue_time.add(t, 1.0 if late else 0.0)
        s.ttft.add(t, 2.0 if late else 0.1)
        s.e2e.add(t, 3.0 if late else 0.5)
    s.rejected.add(59.0)
    snap = s.snapshot(59.9, 30.0, in_flight=4, queued=2)
    assert snap["arrivals"] == 60  # slices 30..59
    assert snap["arrival_rate_per_s"] == pytest.approx(60 / 29.9)
    assert (snap["in_flight"], snap["queued"], snap["rejected"]) == (4, 2, 1)
    assert snap["queue_time_s"]["p99"] == 1.0 and snap["queue_time_s"]["mean"] == pytest.approx(1.0)
    assert snap["ttft_s"]["p50"] == 2.0
    assert snap["covered_s"] == 30.0
    # A window reaching back over the fast period mixes both.
    wide = s.snapshot(59.9, 60.0)
    assert wide["ttft_s"]["p50"] == 0.1 and wide["ttft_s"]["p99"] == 2.0


def test_pool_table_keeps_stats_across_pool_replacement_and_drops_them_on_delete() -> None:
    now = [50.0]
    table = PoolTable(RouterMetrics(), wall_clock=lambda: 1.7e9, clock=lambda: now[0])
    spec = PoolSpec.model_validate({"endpoints": [{"id": "a", "url": "http://h:1"}]})
    pool = table.put("m", spec)
    pool.shared.stats.arrivals.add(50.5)
    pool.shared.stats.ttft.add(50.5, 0.25)
    now[0] = 51.0
    again = table.put("m", PoolSpec.model_validate({"endpoints": [{"id": "b", "url": "http://h:2"}]}))
    assert again.shared is pool.shared
    snap = table.stats(30.0)["m"]
    assert snap["arrivals"] == 1 and snap["ttft_s"]["p99"] == 0.25
    assert table.delete("m")
    fresh = table.put("m", spec)
    assert fresh.shared is not pool.shared
    assert table.stats(30.0)["m"]["arrivals"] == 0
