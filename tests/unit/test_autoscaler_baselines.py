"""The baselines on fake time: KEDA/HPA's ceil formula with tolerance and stabilisation, Knative
KPA's stable and panic modes, fixed (autoscaler.baselines)."""

from __future__ import annotations

import pytest

from autoscaler.baselines import KpaPolicy
from autoscaler.policy import Direction, ReplicaBounds, ScalingContext, make_policy
from autoscaler.signals import Signals
from autoscaler.spec import AutoscalingSpec


def policy(name: str, min_: int = 1, max_: int = 50, initial: int = 2, **spec: object):
    return make_policy(AutoscalingSpec(policy=name, **spec), ReplicaBounds(min_, max_, initial))  # type: ignore[arg-type]


def ctx(now_s: float, desired: int, *, waiting: float | None = None, concurrency: int = 0,
        ready: int | None = None) -> ScalingContext:  # fmt: skip
    s = Signals(at_s=now_s, window_s=30.0, engine_waiting=waiting, in_flight=concurrency)
    return ScalingContext(now_s, desired, desired if ready is None else ready, 0, s)


def test_every_policy_is_registered_with_its_native_cadence() -> None:
    assert {n: policy(n).interval_s for n in ("fleet", "keda-queue", "kpa", "fixed")} == {
        "fleet": 5.0, "keda-queue": 15.0, "kpa": 2.0, "fixed": 5.0}  # fmt: skip
    assert policy("kpa", interval_seconds=1).interval_s == 1.0


def test_fixed_holds_its_replica_count() -> None:
    p = policy("fixed", initial=6)
    for t, desired in ((0.0, 6), (5.0, 2)):  # even if something else moved the target
        d = p.decide(ctx(t, desired, waiting=500, concurrency=900))
        assert (d.desired, d.reason) == (6, "fixed")


def test_keda_queue_uses_the_hpa_ceil_formula_and_tolerance() -> None:
    p = policy("keda-queue", keda_queue={"targetWaitingPerReplica": 5})
    d = p.decide(ctx(0.0, 2, waiting=23))
    assert (d.desired, d.direction, d.reason) == (5, Direction.UP, "queue_above_target")  # ceil(23 / 5)
    d = p.decide(ctx(15.0, 5, waiting=26))  # 26 / (5 x 5) = 1.04: inside the 10 % tolerance
    assert (d.desired, d.reason) == (5, "within_tolerance")
    d = p.decide(ctx(30.0, 5, waiting=100))  # wants 20: at most max(5 x 2, 5 + 4) = 10 per decision
    assert d.desired == 10
    d = p.decide(ctx(45.0, 10, waiting=None))
    assert (d.desired, d.reason) == (10, "no_signal")


def test_keda_queue_scales_down_only_after_the_hpa_window() -> None:
    p = policy("keda-queue", keda_queue={"targetWaitingPerReplica": 5}, max_scale_down_rate=1000)
    d = p.decide(ctx(0.0, 2, waiting=40))
    assert d.desired == 6
    desired, t = d.desired, 15.0
    while t < 300.0:
        d = p.decide(ctx(t, desired, waiting=0))
        assert (d.desired, d.reason) == (desired, "stabilizing")
        t += 15.0
    d = p.decide(ctx(315.0, desired, waiting=0))
    assert (d.desired, d.direction, d.reason) == (1, Direction.DOWN, "queue_below_target")  # ceil(0) -> min 1


def kpa(**params: object) -> KpaPolicy:
    p = policy("kpa", kpa={"targetConcurrencyPerReplica": 10, "targetUtilizationPercentage": 100, **params})
    assert isinstance(p, KpaPolicy)
    return p


def test_kpa_stable_mode_targets_the_windowed_average_concurrency() -> None:
    p = kpa()
    desired = 3
    for t in range(0, 62, 2):
        d = p.decide(ctx(float(t), desired, concurrency=30))
        desired = d.desired
    assert (desired, d.reason, p.panicking) == (3, "kpa_stable", False)  # ceil(30 / 10)
    # Load falls to 10: the 60 s average follows slowly, and one decision at most halves.
    seen = []
    for t in range(62, 180, 2):
        d = p.decide(ctx(float(t), desired, concurrency=10))
        desired = d.desired
        seen.append(desired)
    assert seen[0] == 3 and desired == 1 and sorted(seen, reverse=True) == seen


def test_kpa_panics_on_a_burst_holds_through_it_and_calms_after_a_stable_window() -> None:
    p = kpa()
    desired = 2
    for t in range(0, 60, 2):  # steady: 20 requests on 2 replicas
        desired = p.decide(ctx(float(t), desired, concurrency=20)).desired
    assert desired == 2 and not p.panicking
    # Burst to 60: the 6 s panic average reaches 2x the ready replicas' capacity within a few ticks.
    t, entered = 60.0, None
    while entered is None:
        d = p.decide(ctx(t, desired, concurrency=60, ready=2))
        if p.panicking:
            entered = t
        desired = d.desired
        t += 2.0
    assert entered <= 66.0 and d.reason == "kpa_panic" and d.desired >= 4
    for _ in range(10):  # the new replicas are still starting; the burst goes on: ceil(60 / 10)
        desired = p.decide(ctx(t, desired, concurrency=60, ready=2)).desired
        t += 2.0
    assert desired == 6
    last_over = t - 2.0  # 60 / 10 = 6 wanted on 2 ready: over the 200 % threshold until here
    # The burst ends: no scale-down while panicking, then stable mode after a whole stable window.
    while True:
        d = p.decide(ctx(t, desired, concurrency=5))
        if not p.panicking:
            break
        assert (d.desired, d.reason) == (6, "kpa_panic")
        t += 2.0
    assert last_over + 60.0 < t <= last_over + 62.0
    assert d.reason == "kpa_stable" and d.desired == 3  # halved at most: floor(6 / 2)


@pytest.mark.parametrize("concurrency", [0, 3])
def test_kpa_scales_from_zero_ready_replicas(concurrency: int) -> None:
    p = policy("kpa", min_=0, initial=0, kpa={"targetConcurrencyPerReplica": 10, "targetUtilizationPercentage": 100})
    d = p.decide(ctx(0.0, 0, concurrency=concurrency, ready=0))
    assert d.desired == (1 if concurrency else 0)
