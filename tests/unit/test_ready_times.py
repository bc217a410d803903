"""Times to READY count from the event a person waits on: a woken STANDBY replica's from its wake,
not from its creation hours before (the transition line `fleet up` prints and the operator sends
as an Event, `fleet status`, the start-up the autoscaler learns from, and the exported estimate)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import ScalingContext, ScalingDecision
from autoscaler.signals import Signals
from autoscaler.startup import StartupEstimate
from fleet.cli import app
from fleet.controller.autoscaling import startup_of
from fleet.controller.lifecycle import Replica, ReplicaStatus as S
from fleet.controller.report import TransitionReport, ready_note
from fleet.controller.targets import FleetRecords
from fleet.local.state import StateStore
from tests.support.controller import Harness, write_deployment


def first_ready() -> Replica:
    """Created at 0 s, placed at 1 s, READY at 6 s."""
    return Replica(id="chat-0", deployment="chat", revision="r1", created_at_s=0.0, placed_at_s=1.0,
                   launched_at_s=1.0, image_ready_at_s=1.0, weights_ready_at_s=1.0, healthy_at_s=5.0,
                   warmup_started_at_s=5.0, warmup_passed_at_s=6.0, endpoint="http://127.0.0.1:9000")  # fmt: skip


def woken_long_after() -> Replica:
    """READY at 6 s, asleep at 10 s, woken at 3600 s and READY again 0.8 s later."""
    r = first_ready()
    r.record_sleep(10.0)
    r.record_wake(3600.0)
    r.warmup_started_at_s, r.warmup_passed_at_s = 3600.5, 3600.8
    return r


def test_a_first_ready_counts_from_creation() -> None:
    r = first_ready()
    assert r.ready_after() == ("creation", pytest.approx(6.0))
    assert ready_note(r) == " (6.0 s to ready)"


def test_a_woken_replica_counts_from_its_wake_not_its_creation() -> None:
    r = woken_long_after()
    assert r.status is S.READY
    assert r.ready_after() == ("wake", pytest.approx(0.8))
    assert r.time_to_ready_s() is None          # its first READY was overwritten: no creation figure to give
    assert ready_note(r) == " (0.8 s from wake to ready)"


def test_a_woken_replica_still_warming_has_no_ready_time() -> None:
    r = first_ready()
    r.record_sleep(10.0)
    r.record_wake(3600.0)
    assert r.status is S.WARMING and r.ready_after() is None and ready_note(r) == ""


def test_the_transition_line_of_a_wake_gives_the_wake_time() -> None:
    r = first_ready()
    records = FleetRecords({}, {r.id: r})
    report = TransitionReport(records, {}, history_per_deployment=5)
    [event] = list(report.transitions(6.0))
    assert event.new is S.READY and event.detail == "http://127.0.0.1:9000 (6.0 s to ready)"
    r.record_sleep(10.0)
    [event] = list(report.transitions(10.0))
    assert event.new is S.STANDBY
    r.record_wake(3600.0)
    r.warmup_started_at_s, r.warmup_passed_at_s = 3600.5, 3600.8
    events = list(report.transitions(3601.0))
    assert [e.new for e in events] == [S.READY]  # WARMING passed between two ticks
    assert events[0].detail == "http://127.0.0.1:9000 (0.8 s from wake to ready)"
    assert "3600" not in events[0].detail and "3594" not in events[0].detail


def test_the_autoscaler_learns_no_start_up_from_a_wake() -> None:
    assert startup_of(first_ready()) == (True, pytest.approx(5.0))   # placement 1 s -> READY 6 s
    assert startup_of(woken_long_after()) is None                   # not a start-up of 3599.8 s


def test_the_wake_estimate_is_exported_beside_the_start_up_estimates() -> None:
    metrics = AutoscalerMetrics()
    decision = ScalingDecision(0.0, 2, 3, "queue_time", "")
    ctx = ScalingContext(0.0, 2, 2, 0, Signals(0.0, 30.0), StartupEstimate(60.0, 600.0, wake_s=0.8), standby=1)
    metrics.record("chat", ctx, decision)
    value = metrics.registry.get_sample_value
    assert value("fleet_autoscaler_startup_seconds", {"deployment": "chat", "kind": "wake"}) == pytest.approx(0.8)
    assert value("fleet_autoscaler_startup_seconds", {"deployment": "chat", "kind": "warm"}) == pytest.approx(60.0)
    asleep_none = ScalingContext(1.0, 3, 3, 0, Signals(1.0, 30.0), StartupEstimate(60.0, 600.0))
    metrics.record("chat", asleep_none, decision)
    assert math.isnan(value("fleet_autoscaler_startup_seconds", {"deployment": "chat", "kind": "wake"}))


async def test_fleet_up_and_fleet_status_count_a_wake_from_the_wake(tmp_path: Path) -> None:
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, engine={"kind": "sim"},
                                            standby={"maxReplicas": 1})])  # fmt: skip
    await h.tick()
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)
    assert h.status()["chat-1"] is S.STANDBY
    await h.tick(n=600, seconds=6.0)            # an hour asleep
    h.c.set_desired("chat", 2)
    await h.tick(n=3)
    r = h.c.replicas["chat-1"]
    assert r.status is S.READY and r.woke_at_s is not None
    [line] = [e.detail for e in h.events if e.replica_id == "chat-1" and e.new is S.READY and e.at_s > r.woke_at_s]
    assert line.endswith(f"({r.wake_to_ready_s():.1f} s from wake to ready)") and r.wake_to_ready_s() < 10
    store = StateStore(tmp_path / "state")
    store.root.mkdir()
    h.c.state_sink = store
    store.set_extra(pid=None, phase="running")
    h.c._save()
    result = CliRunner().invoke(app, ["status", "--state-dir", str(store.root)], terminal_width=250)
    assert result.exit_code == 0, result.output
    assert f"woken: {r.wake_to_ready_s():.1f} s from wake to ready" in result.output
