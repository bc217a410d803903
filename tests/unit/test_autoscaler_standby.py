"""The `standby` scaling policy (autoscaler/standby.py): Fleet's decisions, a standby pool sized to
the largest burst excess remembered, the kind of capacity a scale-up takes, and the lead time a
sleeping replica gives; and the STANDBY replica state (fleet/controller/lifecycle.py)."""

from __future__ import annotations


from autoscaler.policy import ReplicaBounds, ScalingContext, make_policy
from autoscaler.signals import Signals
from autoscaler.spec import AutoscalingSpec
from autoscaler.standby import BURST_MEMORY_S, StandbyPolicy
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
    policy = make_policy(AutoscalingSpec(policy="standby", **spec), ReplicaBounds(1, max_, 2))  # type: ignore[arg-type]
    assert isinstance(policy, StandbyPolicy)
    return policy


def test_standby_is_a_registered_policy_and_decides_as_fleet_does() -> None:
    fleet = make_policy(AutoscalingSpec(), ReplicaBounds(1, 16, 2))
    p = standby_policy()
    for t, queue in ((0.0, 2 * TQ), (5.0, 3 * TQ), (10.0, 0.1 * TQ)):
        mine, theirs = p.decide(ctx(t, 2, queue)), fleet.decide(ctx(t, 2, queue))
        assert (mine.desired, mine.reason) == (theirs.desired, theirs.reason)


def test_before_any_burst_the_pool_is_left_to_the_deployment() -> None:
    d = standby_policy().decide(ctx(0.0, 2, 0.5 * TQ))
    assert d.standby is None and d.to_dict()["standby"] is None


def test_the_pool_is_the_largest_burst_excess_remembered_then_forgotten() -> None:
    p = standby_policy()
    up = p.decide(ctx(0.0, 2, 3 * TQ, ready=2))        # wants 6 with 2 READY: an excess of 4
    assert (up.desired, up.standby) == (6, 4)
    assert "standby pool 4" in up.detail and up.inputs["standby_target"] == 4
    hold = p.decide(ctx(5.0, 6, 0.8 * TQ))              # within band: the burst is still remembered
    assert (hold.desired, hold.standby) == (6, 4)
    later = p.decide(ctx(BURST_MEMORY_S + 1.0, 6, 0.8 * TQ))
    assert later.standby is None                        # aged out: back to the deployment's maximum


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
    assert d.standby is None  # an early wake is no burst seen: the pool is not resized on it


def test_no_early_wake_without_sleepers_or_while_latency_is_low() -> None:
    assert _confirmed().decide(_loaded(40.0, 10, 0.4 * TQ, standby=0)).desired == 2   # no sleeper: a start-up
    low = _confirmed().decide(_loaded(40.0, 10, 0.2 * TQ, standby=2))                  # under WAKE_EARLY_FRACTION
    assert low.desired == 2 and low.reason != "load_above_capacity"
