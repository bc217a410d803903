"""Fleet's scaling policy on fake time: up on queue time, on p99 TTFT and on a projected crossing
within the start-up time; down only after the stabilisation window, with hysteresis, never
below the load; bounds and rate limits (autoscaler.policy)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest

from autoscaler.policy import (
    Direction,
    ReplicaBounds,
    ScalingContext,
    ScalingDecision,
    Stabilizer,
    limit_rate,
    make_policy,
)
from autoscaler.signals import Signals
from autoscaler.spec import AutoscalingSpec
from autoscaler.startup import StartupEstimate, StartupTracker

TQ, TT = 0.5, 2.0  # the default targets: queue time 0.5 s, p99 TTFT 2 s


def fleet(min_: int = 1, max_: int = 16, initial: int = 2, **spec: object):
    return make_policy(AutoscalingSpec(**spec), ReplicaBounds(min_, max_, initial))  # type: ignore[arg-type]


def signals(now_s: float, *, queue: float | None = None, ttft: float | None = None, ttft_samples: int = 100,
            in_flight: int = 0, queued: int = 0, rate: float = 0.0, e2e: float | None = None) -> Signals:  # fmt: skip
    return Signals(at_s=now_s, window_s=30.0, router_queue_time_mean_s=queue, ttft_p99_s=ttft,
                   ttft_samples=ttft_samples, in_flight=in_flight, queued=queued, arrival_rate_per_s=rate,
                   e2e_mean_s=e2e)  # fmt: skip


def ctx(now_s: float, desired: int, s: Signals, *, ready: int | None = None, starting: int = 0,
        startup: StartupEstimate | None = None) -> ScalingContext:  # fmt: skip
    return ScalingContext(now_s, desired, desired if ready is None else ready, starting, s,
                          startup or StartupEstimate(60.0, 600.0))  # fmt: skip


def run(policy, seconds: float, desired: int, make: Callable[[float, int], Signals], start_s: float = 0.0,
        **kw: object) -> tuple[int, list[ScalingDecision]]:  # fmt: skip
    """Decide every interval for ``seconds``; replicas become READY at once. Returns the final
    desired count and every decision."""
    decisions = []
    t = start_s
    while t < start_s + seconds:
        d = policy.decide(ctx(t, desired, make(t, desired), **kw))  # type: ignore[arg-type]
        decisions.append(d)
        desired = d.desired
        t += policy.interval_s
    return desired, decisions


def test_queue_time_above_target_scales_up_at_once_in_proportion() -> None:
    p = fleet()
    d = p.decide(ctx(0.0, 2, signals(0.0, queue=2 * TQ)))
    assert (d.desired, d.direction, d.reason) == (4, Direction.UP, "queue_time_above_target")
    assert "2.00x target" in d.detail and d.inputs["pressure"] == pytest.approx(2.0)


def test_ttft_p99_above_target_scales_up_but_only_with_enough_samples() -> None:
    d = fleet().decide(ctx(0.0, 3, signals(0.0, queue=0.1, ttft=1.5 * TT)))
    assert (d.desired, d.reason) == (5, "ttft_p99_above_target")  # ceil(3 x 1.5)
    few = fleet().decide(ctx(0.0, 3, signals(0.0, queue=0.3, ttft=5 * TT, ttft_samples=9)))
    assert few.direction is Direction.HOLD and few.reason == "within_band"  # the p99 of 9 is their max


def test_a_signal_heading_above_target_within_the_start_up_time_scales_up_early() -> None:
    def rising(t: float, n: int) -> Signals:  # on 2 replicas the ratio climbs 0.01x target per second
        return signals(t, queue=TQ * (0.5 + 0.01 * t) * 2 / n)

    def first_up(startup: StartupEstimate) -> ScalingDecision | None:
        _, decisions = run(fleet(trend_window_seconds=60), 50.0, 2, rising, startup=startup)
        return next((d for d in decisions if d.direction is Direction.UP), None)

    # A cold start takes 30 s: at t=30 the ratio is 0.8 and heading to 1.1 by the time a
    # replica would be ready, so the replica is asked for now.
    cold = first_up(StartupEstimate(5.0, 30.0, next_warm=False))
    assert cold is not None
    assert (cold.at_s, cold.reason, cold.desired) == (30.0, "queue_time_projected", 3)
    assert cold.inputs["projected"] == pytest.approx(1.1) and cold.inputs["pressure"] == pytest.approx(0.8)
    # The same trend with a 5 s warm start: no need to act before t=50 (1.0 + 0.05).
    assert first_up(StartupEstimate(5.0, 30.0, next_warm=True)) is None


def test_scale_down_waits_for_the_stabilization_window_then_halves_once_per_signal_window() -> None:
    p = fleet(min_=1, initial=8, scale_down_stabilization_seconds=300, window_seconds=30)
    desired, decisions = run(p, 400.0, 8, lambda t, n: signals(t, queue=0.01))
    downs = [(d.at_s, d.previous, d.desired) for d in decisions if d.direction is Direction.DOWN]
    assert all(d.reason == "stabilizing" for d in decisions if d.at_s < 300)
    assert downs[0][0] == 300.0  # the seed (8 at t=0) leaves the window only now
    # Halving (maxScaleDownRate 2), and each next step only once the 30 s window saw the new count.
    assert downs == [(300.0, 8, 4), (335.0, 4, 2), (370.0, 2, 1)]
    held = next(d for d in decisions if d.at_s == 305.0)
    assert held.reason == "stabilizing" and "window still averages 8.0 READY" in held.detail
    assert desired == 1


def test_a_short_dip_never_scales_down_and_a_signal_near_target_never_flaps() -> None:
    def wobbling(t: float, n: int) -> Signals:
        # Offered load wobbles +-10 % around 2 replicas' worth; one 5 s dip to almost nothing every 10 min.
        load = 2.0 * (1.1 if int(t // 5) % 2 else 0.9)
        if int(t) % 600 == 300:
            load = 0.2
        return signals(t, queue=TQ * load / n, in_flight=int(10 * load))

    p = fleet(min_=1, initial=2)
    desired, decisions = run(p, 3600.0, 2, wobbling)
    changes = [(d.direction, d.previous, d.desired) for d in decisions if d.direction is not Direction.HOLD]
    assert changes == [(Direction.UP, 2, 3)]  # 1.1x once; then 0.6..0.73x: inside the band for an hour
    assert desired == 3


def test_never_below_what_the_load_needs() -> None:
    p = fleet(min_=1, initial=4, window_seconds=30)
    # 40 requests in flight on 4 replicas with both targets met: 10 per replica is sustainable.
    desired, _ = run(p, 120.0, 4, lambda t, n: signals(t, queue=0.4 * TQ, ttft=0.7 * TT, in_flight=40))
    assert desired == 4 and p.per_replica_capacity() == pytest.approx(10.0)
    # Latency falls below the scale-down band but 25 requests remain: 3 replicas, not the minimum of 1.
    desired, decisions = run(p, 900.0, 4, lambda t, n: signals(t, queue=0.1 * TQ, ttft=0.3 * TT, in_flight=25),
                             start_s=120.0)  # fmt: skip
    assert desired == 3
    assert decisions[-1].inputs["load_floor"] == 3
    # Little's law counts too: 2 requests/s x 10 s = 20 in the system even when few are in flight now.
    d = p.decide(ctx(1100.0, 3, signals(1100.0, queue=0.0, in_flight=1, rate=2.0, e2e=10.0)))
    assert d.inputs["load"] == pytest.approx(20.0) and d.inputs["load_floor"] == 2


def test_unknown_capacity_keeps_every_ready_replica_while_requests_run() -> None:
    p = fleet(min_=1, initial=4)
    desired, decisions = run(p, 900.0, 4, lambda t, n: signals(t, queue=None, in_flight=3))
    assert desired == 4 and decisions[-1].inputs["load_floor"] == 4


def test_bounds_cap_the_target_and_say_so() -> None:
    d = fleet(max_=4).decide(ctx(0.0, 4, signals(0.0, queue=3 * TQ)))
    assert (d.desired, d.direction, d.reason) == (4, Direction.HOLD, "at_max_replicas")
    d = fleet(max_=5).decide(ctx(0.0, 4, signals(0.0, queue=3 * TQ)))
    assert (d.desired, d.reason) == (5, "queue_time_above_target") and "capped at spec.replicas.max" in d.detail
    desired, _ = run(fleet(min_=2, initial=3), 1000.0, 3, lambda t, n: signals(t, queue=0.0))
    assert desired == 2  # spec.replicas.min


def test_one_decision_grows_by_at_most_x2_or_plus_4() -> None:
    d = fleet(max_=100).decide(ctx(0.0, 2, signals(0.0, queue=10 * TQ)))
    assert d.desired == 6 and "rate-limited to 6" in d.detail  # wants 20: max(2 x 2, 2 + 4)
    d = fleet(max_=100).decide(ctx(0.0, 10, signals(0.0, queue=10 * TQ)))
    assert d.desired == 20  # max(10 x 2, 10 + 4)
    assert limit_rate(10, 1, up_rate=2, up_step=4, down_rate=2) == 5
    assert limit_rate(1, 0, up_rate=2, up_step=4, down_rate=2) == 0  # one replica can always go
    assert limit_rate(0, 3, up_rate=2, up_step=4, down_rate=2) == 3


def test_starting_replicas_count_toward_the_scale_up() -> None:
    p = fleet()
    d = p.decide(ctx(0.0, 4, signals(0.0, queue=2 * TQ), ready=2, starting=2))
    assert (d.desired, d.reason) == (4, "scale_up_in_progress")  # ceil(2 x 2) = 4 already coming
    d = p.decide(ctx(5.0, 4, signals(5.0, queue=3 * TQ), ready=2, starting=2))
    assert (d.desired, d.reason) == (6, "queue_time_above_target")


def test_demand_with_no_ready_replica_scales_from_zero() -> None:
    p = fleet(min_=0, initial=0)
    d = p.decide(ctx(0.0, 0, signals(0.0, queued=3, rate=0.5)))
    assert (d.desired, d.reason) == (1, "demand_without_replicas")
    desired, _ = run(fleet(min_=0, initial=1), 1000.0, 1, lambda t, n: signals(t))
    assert desired == 0  # no traffic for longer than the window: back to zero


def test_same_contexts_give_the_same_decisions() -> None:
    def load(t: float, n: int) -> Signals:  # a 20-minute burst in a quiet hour, a wave on top
        demand = (4.0 if 600 <= t < 1800 else 0.5) * (1 + 0.3 * math.sin(t / 60))
        return signals(t, queue=TQ * demand / max(n, 1), ttft=TT * 0.8 * demand / max(n, 1), in_flight=int(8 * demand))

    runs = [run(fleet(), 3600.0, 2, load)[1] for _ in range(2)]
    assert runs[0] == runs[1]
    assert {d.direction for d in runs[0]} == {Direction.UP, Direction.DOWN, Direction.HOLD}


def test_stabilizer_follows_kubernetes_hpa() -> None:
    s = Stabilizer(up_window_s=10, down_window_s=30)
    s.seed(0.0, 5)
    assert s.apply(5.0, 5, 8) == 8  # the seed never holds a scale-up back
    assert s.apply(6.0, 8, 12) == 8  # up window (-4, 6]: min(8, 12)
    assert s.apply(16.0, 8, 12) == 12  # up window (6, 16]: only 12
    assert s.apply(20.0, 12, 2) == 12  # down window (-10, 20]: max(5, 8, 12, 12, 2) = current: hold
    assert s.apply(47.0, 12, 3) == 3  # down window (17, 47]: max(2, 3)


def test_startup_tracker_uses_the_median_of_observed_start_ups() -> None:
    t = StartupTracker(warm_s=60, cold_s=600)
    assert t.estimate().lead_time_s == 60 and t.estimate(next_warm=False).lead_time_s == 600
    for i, seconds in enumerate((30.0, 34.0, 200.0)):
        assert t.observe(f"r{i}", True, seconds)
    assert not t.observe("r0", True, 1.0)  # once per replica
    assert t.estimate().warm_s == 34.0  # one slow start does not move the median far
    t.observe("c0", False, 300.0)
    assert t.estimate(next_warm=False).lead_time_s == 300.0


def test_the_load_floor_never_adds_replicas_while_latency_is_far_below_target() -> None:
    p = fleet(min_=1, initial=1, window_seconds=30)
    # 2 requests in flight on one replica, both targets met for a whole window: 2 per replica is
    # confirmed sustainable (a lower bound of the real capacity).
    desired, _ = run(p, 60.0, 1, lambda t, n: signals(t, queue=0.1 * TQ, ttft=0.2 * TT, in_flight=2))
    assert desired == 1 and p.per_replica_capacity() == pytest.approx(2.0)
    # A momentary 13 in flight with latency still far below target: the floor says 7, but a floor
    # built on a lower bound only holds a scale-down back; it is no evidence for more replicas.
    d = p.decide(ctx(60.0, 1, signals(60.0, queue=0.1 * TQ, ttft=0.3 * TT, in_flight=13)))
    assert d.inputs["load_floor"] == 7
    assert (d.desired, d.direction, d.reason) == (1, Direction.HOLD, "underloaded")
    assert "the 1 targeted carry it" in d.detail



def test_the_floor_counts_throughput_and_a_failed_probe_bars_the_same_step() -> None:
    # Two replicas serve 18 requests/s (9 each) within both targets, 44 in flight each; one
    # replica alone would be overloaded at that rate (queue time 1.5x its target).
    def load(rate: float) -> Callable[[float, int], Signals]:
        def make(t: float, n: int) -> Signals:
            if rate / n > 12:
                return signals(t, queue=1.5 * TQ, ttft=1.2 * TT, in_flight=60, rate=rate)
            return signals(t, queue=0.05 * TQ, ttft=0.2 * TT, in_flight=int(5 * rate), rate=rate)
        return make

    p = fleet(min_=1, initial=2, window_seconds=30, scale_down_stabilization_seconds=60)
    run(p, 120.0, 2, lambda t, n: signals(t, queue=0.3 * TQ, ttft=0.6 * TT, in_flight=88, rate=18.0))
    assert p.per_replica_capacity() == pytest.approx(44.0) and p.per_replica_rate_capacity() == pytest.approx(9.0)
    # Latency far below target and 90 in flight: by requests in flight one replica would do, by
    # throughput (18/s, 9 per replica confirmed) two are needed. Every signal under 0.25x its
    # target: the policy probes one replica, sees it overloaded, goes back to two and remembers.
    desired, decisions = run(p, 600.0, 2, load(18.0), start_s=120.0)
    assert desired == 2
    moves = [(d.previous, d.desired, d.reason) for d in decisions if d.direction is not Direction.HOLD]
    assert moves[:2] == [(2, 1, "underloaded"), (1, moves[1][1], "queue_time_above_target")], moves
    assert sum(d.direction is Direction.DOWN and "probing" in d.detail for d in decisions) == 1, moves
    # The overload is counted per replica behind the window's signals (1 to 2 READY): 9..18 req/s.
    assert 9.0 <= p.per_replica_overload_rate() <= 18.0
    assert decisions[-1].inputs["load_floor"] == 2
    # At 8 requests/s, one replica takes under 80 % of the rate that overloaded it: it goes, and stays.
    desired, decisions = run(p, 600.0, 2, load(8.0), start_s=720.0)
    assert desired == 1
    assert [d.direction for d in decisions].count(Direction.UP) == 0


def test_a_probe_needs_every_signal_far_below_target() -> None:
    # A steady load the two replicas have always carried: the floor is today's count.
    p = fleet(min_=1, initial=2, window_seconds=30, scale_down_stabilization_seconds=60)
    desired, decisions = run(p, 600.0, 2, lambda t, n: signals(t, queue=0.1 * TQ, ttft=0.3 * TT, in_flight=10,
                                                                rate=4.0))  # fmt: skip
    assert desired == 2 and decisions[-1].inputs["load_floor"] == 2  # 0.3x: below the band, no probe
    desired, decisions = run(p, 600.0, 2, lambda t, n: signals(t, queue=0.1 * TQ, ttft=0.2 * TT, in_flight=10,
                                                                rate=4.0), start_s=600.0)  # fmt: skip
    assert desired == 1  # 0.2x: one fewer is tried


def test_a_fast_closed_loop_client_is_no_overload() -> None:
    # Ten clients overloaded one replica: 1.1 requests/s at a load of 10 (queue time 1.6x).
    p = fleet(min_=1, initial=1, window_seconds=4, interval_seconds=1, scale_down_stabilization_seconds=6)
    desired, _ = run(p, 3.0, 1, lambda t, n: signals(t, queue=1.6 * TQ, in_flight=2, queued=8, rate=1.1))
    assert desired > 1 and p.per_replica_overload_rate() is not None
    # One client is left; alone it sends faster (1.9 requests/s, one request at a time) than the
    # ten got through. Its rate is above the overload's, its load far below: one replica goes.
    desired, decisions = run(p, 60.0, 2, lambda t, n: signals(t, queue=0.0, in_flight=1, rate=1.9, e2e=0.5),
                             start_s=3.0)  # fmt: skip
    assert desired == 1, decisions[-1].detail


def test_a_signal_lagging_behind_a_burst_that_ended_is_no_overload_at_the_rate_after_it() -> None:
    # The shape of tests/integration/test_autoscale_sim.py, numbers from its decisions. One client (0.5
    # requests/s) on one replica for a while: 0.5 requests/s per replica is confirmed sustainable.
    p = fleet(min_=1, max_=3, initial=1, window_seconds=4, interval_seconds=1, scale_down_stabilization_seconds=6)
    desired, _ = run(p, 10.0, 1, lambda t, n: signals(t, queue=0.0, in_flight=1, rate=0.5, e2e=0.5))
    assert desired == 1 and p.per_replica_rate_capacity() == pytest.approx(0.5)
    # The burst overloads one replica, then three; it ends, and for one decision the windowed
    # queue time still shows it (1.05x) while the arrival rate has fallen to the one client's.
    desired, _ = run(p, 3.0, 1, lambda t, n: signals(t, queue=1.5 * TQ, in_flight=2, queued=7, rate=3.5), start_s=10.0)
    assert desired == 3
    desired, _ = run(p, 5.0, 3, lambda t, n: signals(t, queue=1.3 * TQ, in_flight=6, queued=1, rate=6.2), start_s=13.0)
    p.decide(ctx(18.0, 3, signals(18.0, queue=1.05 * TQ, in_flight=1, rate=0.64, e2e=0.5)))
    # What broke the target was the burst behind the window, not 0.2 requests/s per replica.
    assert p.per_replica_overload_rate() >= 2.0
    # The one client stays, a little faster than the rate confirmed (the floor says 2): the
    # probe is not barred by the lag, and the deployment comes back to one replica.
    desired, decisions = run(p, 60.0, 3, lambda t, n: signals(t, queue=0.0, in_flight=1, rate=0.8, e2e=0.5),
                             start_s=19.0)  # fmt: skip
    assert desired == 1, decisions[-1].detail
    assert any("probing 1" in d.detail for d in decisions), [d.detail for d in decisions]
