"""The trace simulators' one event loop and their replicas' derived status (fleet/tracesim/events.py,
fleet/tracesim/replica.py): events run in time, kind and push order, arrivals after events of
the same instant, the horizon leaves later ones unrun; a replica's status follows from the facts
recorded about it, in any order at one instant; the preemption scenario's replicas are the
controller's own records."""

from __future__ import annotations

import math

import pytest

from fleet.controller.lifecycle import ReplicaStatus
from fleet.enginesim.model import EngineModel
from fleet.enginesim.profiles import get_profile
from fleet.tracesim.events import FIRST_OWN_KIND, READY, STEP_END, WAKE, EventLoop
from fleet.tracesim.preemption import PreemptionSimulation, demo_config
from fleet.tracesim.replica import VirtualReplica


def recording_loop(kinds: range) -> tuple[EventLoop, list[tuple[float, int, object]]]:
    loop, seen = EventLoop(), []
    for kind in kinds:
        loop.on(kind, lambda payload, now_s, kind=kind: seen.append((now_s, kind, payload)))
    return loop, seen


def test_events_run_by_time_then_kind_then_push_order_and_arrivals_after_events_of_their_instant() -> None:
    loop, seen = recording_loop(range(FIRST_OWN_KIND + 1))
    loop.push(2.0, FIRST_OWN_KIND, "tick")
    loop.push(1.0, READY, "b")
    loop.push(1.0, STEP_END, "a")
    loop.push(1.0, READY, "c")
    end_s = loop.run(lambda: False, arrivals=[0.5, 1.0, 3.0], on_arrival=lambda i, t: seen.append((t, -1, i)))
    assert seen == [(0.5, -1, 0), (1.0, STEP_END, "a"), (1.0, READY, "b"), (1.0, READY, "c"), (1.0, -1, 1),
                    (2.0, FIRST_OWN_KIND, "tick"), (3.0, -1, 2)]  # fmt: skip
    assert end_s == 3.0 and loop.now_s == 3.0


def test_a_handler_schedules_more_and_the_loop_stops_when_done_or_past_the_horizon() -> None:
    loop, seen = EventLoop(), []

    def tick(_: object, now_s: float) -> None:
        seen.append(now_s)
        loop.push(now_s + 1.0, FIRST_OWN_KIND)

    loop.on(FIRST_OWN_KIND, tick)
    loop.push(0.0, FIRST_OWN_KIND)
    assert loop.run(lambda: len(seen) == 3) == 2.0 and seen == [0.0, 1.0, 2.0]
    assert loop.run(lambda: False, horizon_s=4.5) == 4.0 and seen[-1] == 4.0   # 5.0 is left unrun
    assert loop.run(lambda: False, horizon_s=5.0) == 5.0


def test_the_loop_ends_when_nothing_is_left_and_an_unhandled_kind_is_an_error() -> None:
    loop, _ = recording_loop(range(1))
    assert loop.run(lambda: False) == 0.0
    loop.push(1.0, WAKE)
    with pytest.raises(KeyError):
        loop.run(lambda: False)


def replica() -> VirtualReplica:
    profile = get_profile("h100-llama-8b")
    return VirtualReplica("m-0", 0, EngineModel(profile.config, profile.cost), 0.0, 10.0, True, 0)


def test_a_replicas_status_is_derived_from_its_facts() -> None:
    r = replica()
    assert r.status is ReplicaStatus.STARTING and not r.woken
    r.record_ready(10.0)
    assert r.status is ReplicaStatus.READY
    r.record_drain(20.0)
    assert r.status is ReplicaStatus.DRAINING
    r.record_sleep(30.0)                      # drained into the standby pool
    assert r.status is ReplicaStatus.STANDBY and r.drain_s is None
    r.record_wake(40.0)
    assert r.status is ReplicaStatus.STARTING and r.woken
    r.record_ready(43.0)
    assert r.status is ReplicaStatus.READY and not r.woken
    r.record_stop(50.0)
    assert r.status is ReplicaStatus.TERMINATED
    assert r.standby_spans == [[30.0, 40.0]] and r.standby_s(math.inf) == 10.0 and r.cost_s(60.0) == 50.0


def test_facts_recorded_at_one_instant_derive_the_status_of_the_last_one() -> None:
    r = replica()
    r.record_ready(10.0)
    r.record_sleep(10.0)                      # a refill READY and asleep at once
    r.record_wake(10.0)                       # and woken by the tick of the same instant
    assert r.status is ReplicaStatus.STARTING and r.woken
    r.record_sleep(10.0)                      # a woken replica drained goes back to sleep
    assert r.status is ReplicaStatus.STANDBY
    r.record_stop(10.0)
    assert r.status is ReplicaStatus.TERMINATED and r.standby_spans == [[10.0, 10.0], [10.0, 10.0]]


def test_the_preemption_scenarios_replicas_are_the_controllers_records() -> None:
    sim = PreemptionSimulation(demo_config())
    sim.run()
    replicas = [r for st in sim.states.values() for r in st.replicas]
    statuses = {r.status for r in replicas}
    assert ReplicaStatus.FAILED_START in statuses and ReplicaStatus.TERMINATED in statuses
    for r in replicas:
        assert r.status is r.record.status
        if r.status is ReplicaStatus.FAILED_START:
            assert r.record.failure is not None and r.record.failure.reason == "crashed on start"
        if r.record.preempted_for is not None:
            assert r.record.drain_requested_at_s is not None or r.record.exited_at_s is not None
