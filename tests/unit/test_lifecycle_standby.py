"""`ReplicaStatus.STANDBY`: derived from the sleep and wake facts, out of the serving count, and
drained like any live replica when the controller stops."""

from __future__ import annotations

import pytest

from fleet.controller.lifecycle import Replica, ReplicaStatus as S


def ready(rid: str = "chat-0") -> Replica:
    return Replica(id=rid, deployment="chat", revision="r1", created_at_s=0.0, placed_at_s=0.0, launched_at_s=1.0,
                   image_ready_at_s=1.0, weights_ready_at_s=1.0, healthy_at_s=5.0, warmup_started_at_s=5.0,
                   warmup_passed_at_s=6.0)  # fmt: skip


def test_standby_holds_devices_but_is_not_a_serving_slot():
    assert S.STANDBY.standby() and not S.STANDBY.serving() and not S.STANDBY.terminal()
    assert not S.STANDBY.counts_toward_desired()
    assert [s for s in S if s.standby()] == [S.STANDBY]


def test_sleep_then_wake_then_warm_up_again_before_ready():
    r = ready()
    r.record_sleep(10.0)
    assert r.status is S.STANDBY and r.asleep and r.engine_alive
    r.record_wake(20.0)
    assert r.status is S.WARMING            # the warm-up gate runs again after a wake
    assert r.wake_to_ready_s() is None
    r.warmup_passed_at_s = 21.5
    assert r.status is S.READY and r.wake_to_ready_s() == pytest.approx(1.5)
    r.record_sleep(30.0)                    # a second sleep after a wake
    assert r.status is S.STANDBY and r.wake_to_ready_s() == pytest.approx(1.5)  # still the latest wake's


def test_only_ready_sleeps_and_only_standby_wakes():
    r = ready()
    with pytest.raises(ValueError, match="only a STANDBY replica can be woken"):
        r.record_wake(7.0)
    r.drain_requested_at_s = 8.0
    with pytest.raises(ValueError, match="chat-0 is DRAINING: only a READY replica"):
        r.record_sleep(9.0)


def test_drain_exit_and_failure_win_over_standby():
    r = ready()
    r.record_sleep(10.0)
    r.drain_requested_at_s = 11.0
    assert r.status is S.DRAINING
    r.exited_at_s = 12.0
    assert r.status is S.TERMINATED


def test_the_facts_survive_the_state_file():
    r = ready()
    r.record_sleep(10.0)
    back = Replica.from_dict(r.to_dict())
    assert back.status is S.STANDBY and back.to_dict()["status"] == "STANDBY"
