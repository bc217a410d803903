"""The `standby` scaling policy (autoscaler/standby.py): Fleet's decisions, a standby pool sized to
the bursts seen (`StandbyPool`: the heaviest decaying burst excess, a starting pool released on
steady traffic, a trusted forecast's need), the kind of capacity a scale-up takes, and the lead time a
sleeping replica gives; and the STANDBY replica state (fleet/controller/lifecycle.py)."""

from __future__ import annotations

import pytest


from autoscaler.policy import ReplicaBounds, ScalingContext, make_policy
from autoscaler.signals import Signals
from autoscaler.spec import AutoscalingSpec, StandbyPoolSpec
from autoscaler.standby import DecayingPeak, StandbyPolicy, StandbyPool
from autoscaler.startup import StartupEstimate
from fleet.controller.lifecycle import ReplicaStatus

TQ = 0.5  # the default queue time target (seconds)


def signals(now_s: float, queue: float | None) -> Signals:
    return Signals(at_s=now_s, window_s=30.0, router_queue_time_mean_s=queue, ttft_p99_s=None, ttft_samples=0,
                   in_flight=0, queued=0, arrival_rate_per_s=0.0, e2e_mean_s=None)  # fmt: skip


def ctx(now_s: float, desired: int, queue: float | None, *, standby: int = 0, ready: int | None = None,
        startup: StartupEstimate | None = None) -> ScalingContext:  # fmt: skip
    return ScalingContext(now_s, desired, desired if ready is None else ready, 0, signals(now_s, queue),
                          startup or StartupEstimate(60.0, 600.0), standby)  # fmt: skip


def standby_policy(max_: int = 16, **spec: object) -> StandbyPolicy:
    """A `standby` policy; the burst floor off unless ``standby_pool`` sets floorHalfLifeSeconds
    (the tests of the pool alone predate it)."""
    pool = spec.get("standby_pool") or StandbyPoolSpec()
    assert isinstance(pool, StandbyPoolSpec)
    if "floor_half_life_seconds" not in pool.model_fields_set:
        spec["standby_pool"] = pool.model_copy(update={"floor_half_life_seconds": 0.0})
    policy = make_policy(AutoscalingSpec(policy="standby", **spec), ReplicaBounds(1, max_, 2))  # type: ignore[arg-type]
    assert isinstance(policy, StandbyPolicy)
    return policy


def test_standby_is_a_registered_policy_and_decides_as_fleet_does() -> None:
    fleet = make_policy(AutoscalingSpec(), ReplicaBounds(1, 16, 2))
    p = standby_policy()
    for t, queue in ((0.0, 2 * TQ), (5.0, 3 * TQ), (10.0, 0.1 * TQ)):
        mine, theirs = p.decide(ctx(t, 2, queue)), fleet.decide(ctx(t, 2, queue))
        assert (mine.desired, mine.reason) == (theirs.desired, theirs.reason)


def test_before_any_burst_the_starting_pool_is_kept_and_unset_leaves_it_to_the_deployment() -> None:
    d = standby_policy().decide(ctx(0.0, 2, 0.5 * TQ))
    assert d.standby == 2 and d.to_dict()["standby"] == 2            # StandbyPoolSpec.initialReplicas
    unset = standby_policy(standby_pool=StandbyPoolSpec(initial_replicas=None)).decide(ctx(0.0, 2, 0.5 * TQ))
    assert unset.standby is None                                      # the deployment's maxReplicas


def test_the_pool_is_the_largest_burst_excess_seen_decaying() -> None:
    p = standby_policy(standby_pool=StandbyPoolSpec(half_life_seconds=600.0))
    up = p.decide(ctx(0.0, 2, 3 * TQ, ready=2))        # wants 6 with 2 READY: an excess of 4
    assert (up.desired, up.standby) == (6, 4)
    assert "standby pool 4" in up.detail and up.inputs["standby_target"] == 4
    hold = p.decide(ctx(5.0, 6, 0.8 * TQ))              # within band: the burst weighs ~4 still
    assert (hold.desired, hold.standby) == (6, 4)
    assert p.decide(ctx(600.0, 6, 0.8 * TQ)).standby == 2      # one half-life
    assert p.decide(ctx(3 * 600.0 + 1, 6, 0.8 * TQ)).standby == 0   # 4 / 8 < half a replica: released


def test_the_pool_never_takes_the_target_past_spec_replicas_max() -> None:
    p = standby_policy(max_=7)
    d = p.decide(ctx(0.0, 2, 3 * TQ, ready=2))          # 6 targeted, excess 4, but only 1 more fits
    assert (d.desired, d.standby) == (6, 1)


def test_a_scale_up_says_how_many_wake_and_how_many_start() -> None:
    p = standby_policy()
    d = p.decide(ctx(0.0, 2, 3 * TQ, ready=2, standby=3))
    assert d.desired == 6 and "wake 3 standby and start 1 (warm, ~60 s)" in d.detail
    cold = standby_policy().decide(ctx(0.0, 2, 3 * TQ, ready=2, startup=StartupEstimate(60.0, 600.0, next_warm=False)))
    assert "start 4 (cold, ~600 s)" in cold.detail


def test_a_sleeping_replica_is_the_lead_time_when_one_is_kept() -> None:
    assert StartupEstimate(60.0, 600.0).lead_time_s == 60.0
    assert StartupEstimate(60.0, 600.0, next_warm=False, wake_s=3.0).lead_time_s == 3.0


def test_standby_holds_devices_but_no_desired_slot() -> None:
    s = ReplicaStatus.STANDBY
    assert s.standby() and not s.serving() and not s.terminal() and not s.counts_toward_desired()
    assert not ReplicaStatus.READY.standby() and ReplicaStatus.READY.counts_toward_desired()


def test_same_contexts_give_the_same_decisions() -> None:
    contexts = [ctx(t, 2, q, ready=2) for t, q in ((0.0, 3 * TQ), (5.0, 0.1 * TQ), (10.0, 2 * TQ))]
    a, b = standby_policy(), standby_policy()
    assert [a.decide(c) for c in contexts] == [b.decide(c) for c in contexts]
    assert a.last is not None and a.last.standby == 4


def _loaded(now_s: float, in_flight: int, queue: float, *, standby: int) -> ScalingContext:
    s = Signals(at_s=now_s, window_s=30.0, router_queue_time_mean_s=queue, in_flight=in_flight, queued=0,
                arrival_rate_per_s=0.0, e2e_mean_s=None)  # fmt: skip
    return ScalingContext(now_s, 2, 2, 0, s, StartupEstimate(60.0, 600.0, wake_s=3.0 if standby else None), standby)


def _confirmed(**spec: object) -> StandbyPolicy:
    """A policy that confirmed 2 requests per READY replica sustainable (a window at 0.2x target)."""
    p = standby_policy(**spec)
    for t in range(0, 40, 5):
        p.decide(_loaded(float(t), 4, 0.2 * TQ, standby=2))
    assert p.per_replica_capacity() == 2.0
    return p


def test_sleepers_wake_early_when_the_load_outgrows_the_confirmed_capacity_and_latency_rises() -> None:
    d = _confirmed().decide(_loaded(40.0, 10, 0.4 * TQ, standby=2))    # load 10 needs 5; 2 asleep
    assert (d.desired, d.reason) == (4, "load_above_capacity") and "wake 2 standby" in d.detail
    assert d.standby == 2  # an early wake is a burst too (excess 2 over READY): it keeps the pool


def test_no_early_wake_without_sleepers_or_while_latency_is_low() -> None:
    assert _confirmed().decide(_loaded(40.0, 10, 0.4 * TQ, standby=0)).desired == 2   # no sleeper: a start-up
    low = _confirmed().decide(_loaded(40.0, 10, 0.2 * TQ, standby=2))                  # under WAKE_EARLY_FRACTION
    assert low.desired == 2 and low.reason != "load_above_capacity"


def pool(**spec: object) -> StandbyPool:
    return StandbyPool(StandbyPoolSpec(**spec))  # type: ignore[arg-type]


def test_a_starting_pool_on_steady_traffic_is_released_after_initial_seconds() -> None:
    p = pool(initial_replicas=2, initial_seconds=60.0)
    for t in range(0, 120, 5):
        p.observe_rate(float(t), 5.0 + (t % 10) / 10)    # steady: peak within 2x the mean
    assert p.steady and p.target(30.0) == 2 and p.target(60.0) == 0


def test_a_starting_pool_on_bursty_traffic_is_kept_until_a_burst_sizes_it() -> None:
    p = pool(initial_replicas=2, initial_seconds=60.0, half_life_seconds=100.0)
    for t, rate in ((0.0, 0.0), (5.0, 0.0), (10.0, 3.0), (15.0, 0.0)):
        p.observe_rate(t, rate)                          # peak 3 over a mean of 0.75: bursty
    assert not p.steady and p.target(1000.0) == 2
    p.observe(1000.0, 3)
    assert p.target(1000.0) == 3 and p.target(1100.0) == 2 and p.target(1300.0) == 0


def test_a_heavier_later_burst_replaces_lighter_ones_and_extra_is_a_floor() -> None:
    p = pool(initial_replicas=0, half_life_seconds=100.0)
    p.observe(0.0, 1)
    p.observe(10.0, 4)
    p.observe(20.0, 1)
    assert len(p._bursts) == 2 and p.target(20.0) == 4   # the first burst is outweighed for good
    assert p.target(20.0, extra=6) == 6 and p.target(1000.0) == 0 and not p._bursts


def test_a_trusted_forecast_can_size_the_pool() -> None:
    p = standby_policy(standby_pool=StandbyPoolSpec(forecast_ahead_seconds=3600.0))

    class Trusted:
        spec = AutoscalingSpec(policy="standby", forecast={}).forecast  # type: ignore[arg-type]

        def peak_ahead(self, now_s: float, ahead_s: float, upper: bool = False) -> float:
            return 10.0

    p.forecaster = Trusted()  # type: ignore[assignment]
    p._rate_capacity.append((0.0, 2.0))   # 2 req/s per replica confirmed: 10 req/s needs 5
    assert p.pool_forecast_need(ctx(0.0, 2, 0.5 * TQ)) == 5
    assert p.standby_target(ctx(0.0, 2, 0.5 * TQ), 2) == 3   # 5 - 2 targeted, above the starting 2


def load_ctx(now_s: float, desired: int, ready: int, starting: int, queue: float, in_flight: int, *,
             standby: int = 0) -> ScalingContext:  # fmt: skip
    s = Signals(at_s=now_s, window_s=30.0, router_queue_time_mean_s=queue, in_flight=in_flight,
                arrival_rate_per_s=in_flight / 2.0, e2e_mean_s=1.0)  # fmt: skip
    return ScalingContext(now_s, desired, ready, starting, s, StartupEstimate(60.0, 600.0), standby)


def confirmed(p: StandbyPolicy) -> StandbyPolicy:
    p._capacity.append((0.0, 5.0, 3.0))   # 5 requests and 3 req/s per READY replica confirmed sustainable
    return p


def test_start_ups_a_burst_asked_for_are_stopped_once_the_load_fits_the_ready_replicas() -> None:
    # The windowed queue time still shows the burst (3x target) but only 4 requests are in the
    # system: 1 replica's worth at the capacity confirmed. The 6 starting would serve a minute
    # from now, to no one: stopped, down to the READY count.
    d = confirmed(standby_policy()).decide(load_ctx(100.0, 8, 2, 6, 3 * TQ, 4))
    assert (d.desired, d.reason) == (2, "burst_over") and "the burst is over" in d.detail
    # Still in the burst (40 in the system: 8 replicas' worth): the start-ups go on.
    on = confirmed(standby_policy()).decide(load_ctx(100.0, 8, 2, 6, 3 * TQ, 40))
    assert on.desired == 8 and on.reason != "burst_over"
    # Nothing confirmed yet: no capacity to judge the load by, so nothing is stopped.
    assert standby_policy().decide(load_ctx(100.0, 8, 2, 6, 3 * TQ, 4)).desired == 8


def test_a_stale_breach_wakes_sleepers_but_starts_nothing() -> None:
    # 2 READY carry the load now; the breach is the window's memory of a burst. A sleeper wakes in
    # seconds (kept: cheap insurance), a start-up is not asked for.
    d = confirmed(standby_policy()).decide(load_ctx(100.0, 2, 2, 0, 3 * TQ, 4, standby=1))
    assert (d.desired, d.reason) == (3, "burst_over")
    assert confirmed(standby_policy()).decide(load_ctx(100.0, 2, 2, 0, 3 * TQ, 4)).desired == 2


def test_a_decaying_peak_keeps_the_heaviest_value_halving_every_half_life() -> None:
    peak = DecayingPeak(100.0)
    peak.observe(0.0, 4)
    peak.observe(10.0, 1)                      # lighter now, but the 4 is dropped first: kept
    assert peak.value(0.0) == 4 and peak.value(100.0) == 2 and len(peak) == 2
    peak.observe(100.0, 3)                     # outweighs both from now on: they are dropped
    assert len(peak) == 1 and peak.value(100.0) == 3 and peak.value(300.0) == 1   # 3/4 rounds to 1
    assert peak.value(400.0) == 0 and len(peak) == 0                               # 3/8 < 0.5: dropped
    peak.observe(500.0, 0)
    assert len(peak) == 0
    with pytest.raises(ValueError, match="half_life_s"):
        DecayingPeak(0.0)


def _after_a_burst(**pool: object) -> tuple[StandbyPolicy, int]:
    """A burst at t = 0 met by 2 READY and 2 asleep (wants 6: wakes 2, starts 2), then quiet at 4 READY
    once the stabilisation window (300 s) has passed: the replicas the scale-down leaves."""
    p = standby_policy(standby_pool=StandbyPoolSpec(**pool))  # type: ignore[arg-type]
    up = p.decide(ctx(0.0, 2, 3 * TQ, ready=2, standby=2))
    assert up.desired == 6
    return p, p.decide(ctx(301.0, 4, 0.01 * TQ, ready=4)).desired


def test_the_burst_floor_holds_the_replicas_a_burst_reached_between_bursts() -> None:
    p, kept = _after_a_burst(floor_half_life_seconds=3600.0)
    assert kept == 4                              # min(6 wanted, 2 READY + 2 asleep), 4 x 0.94 rounds to 4
    assert p.last is not None and p.last.inputs["burst_floor"] == 4
    assert p.burst_floor_of(3600.0) == 2          # one half-life
    assert p.decide(ctx(4 * 3600.0, 4, 0.01 * TQ, ready=4)).desired < 4   # 4 / 16: released
    _, off = _after_a_burst(floor_half_life_seconds=0.0)   # off: the step-down before the floor
    assert off < 4


def test_the_burst_floor_only_holds_a_scale_down_back() -> None:
    p, _ = _after_a_burst(floor_half_life_seconds=3600.0)
    d = p.decide(ctx(310.0, 2, 0.01 * TQ, ready=2))    # a target of 2 (set elsewhere): kept, not raised to 4
    assert d.desired <= 2


def test_replicas_held_awake_by_the_burst_floor_count_as_the_pool_but_one_sleeper_stays() -> None:
    p, _ = _after_a_burst(floor_half_life_seconds=3600.0)
    # pool 3 (4 halved over 301 s of 900) - 3 held awake = 0, but one sleeper stays for a larger burst
    assert p.last is not None and p.last.standby == 1
    q, _ = _after_a_burst(floor_half_life_seconds=0.0)
    assert q.last is not None and q.last.standby == 3      # no floor: the pool sleeps beside the target
    later = p.decide(ctx(3 * 3600.0, 4, 0.01 * TQ, ready=4))
    assert later.standby == 0                              # the pool's bursts have decayed: no sleeper kept


def test_the_burst_floor_is_on_by_default_and_off_at_zero() -> None:
    assert StandbyPoolSpec().floor_half_life_seconds == 3600.0
    p = make_policy(AutoscalingSpec(policy="standby"), ReplicaBounds(1, 16, 2))
    assert isinstance(p, StandbyPolicy) and p.burst_floor is not None and p.burst_floor.half_life_s == 3600.0
    off = AutoscalingSpec.model_validate({"policy": "standby", "standbyPool": {"floorHalfLifeSeconds": 0}})
    p = make_policy(off, ReplicaBounds(1, 16, 2))
    assert isinstance(p, StandbyPolicy) and p.burst_floor is None
    spec = AutoscalingSpec.model_validate({"policy": "standby", "standbyPool": {"floorHalfLifeSeconds": 10_800}})
    p = make_policy(spec, ReplicaBounds(1, 16, 2))
    assert isinstance(p, StandbyPolicy) and p.burst_floor is not None and p.burst_floor.half_life_s == 10_800.0
