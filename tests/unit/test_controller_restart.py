"""A controller that dies and a new one that takes over: the state is read back, running replicas
are adopted (not restarted), the target is what was last set, and a crash at any point of a
scale-up, a warm-up or a drain leaves no duplicate, no orphan and nothing stuck. Fake time, the
fake backend (shared by both controllers, as the machine's processes are) and fake engines."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest

from fleet.controller.reconcile import Controller, ControllerSettings
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.spec import load_deployments
from tests.support.fakes import ControllerCrash, FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink
from tests.support.controller import CPU_NODE, ControllerHarness, write_deployment


class RecordingSink:
    """The state file: keeps the last snapshot written (what a restart reads back)."""

    def __init__(self) -> None:
        self.last: dict | None = None
        self.writes = 0

    def save(self, snapshot: dict) -> None:
        self.last = copy.deepcopy(snapshot)
        self.writes += 1


class Machine(ControllerHarness):
    """One machine's processes (the fake backend), engines and router outlive any controller."""

    def __init__(self, tmp_path: Path, files: list[Path]) -> None:
        self.files = files
        self.clock = FakeClock()
        self.backend = FakeBackend(CPU_NODE)
        self.engines = FakeEngineAPI()
        self.pools = FakePoolSink()
        self.sink = RecordingSink()
        self.c = self.controller()

    def controller(self, files: list[Path] | None = None) -> Controller:
        return Controller(load_deployments(files or self.files), backend=self.backend, engine_api=self.engines,
                          pool_sink=self.pools, clock=self.clock, sleep=self.clock.sleep, state_sink=self.sink,
                          settings=ControllerSettings(drain_timeout_s=120))  # fmt: skip

    async def restart(self, files: list[Path] | None = None) -> Controller:
        """`kill -9` of the controller, then a new one on the same state."""
        for task in list(self.c.health.warmups.values()):
            task.cancel()
        self.c = self.controller(files)
        await self.c.start(self.sink.last)
        return self.c

    def healthy_all(self) -> None:
        for p in self.backend.procs.values():
            self.engines.healthy.add(p.spec.port)

    def status(self) -> dict[str, S]:
        return {rid: r.status for rid, r in self.c.replicas.items()}

    def pids(self) -> dict[str, int]:
        return {p.spec.replica_id: pid for pid, p in self.backend.procs.items() if p.exit_code is None}

    async def ready(self, n: int) -> None:
        await self.tick()
        self.healthy_all()
        await self.tick(3)
        assert list(self.status().values()).count(S.READY) == n, self.status()


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


async def test_ready_replicas_are_adopted_as_they_run_and_stay_in_the_pool(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=2)])
    await m.ready(2)
    pids, updates = m.pids(), m.pools.updates
    c = await m.restart()
    assert {rid: r.adopted_at_s is not None for rid, r in c.replicas.items()} == {"chat-0": True, "chat-1": True}
    await m.tick(3)
    assert m.status() == {"chat-0": S.READY, "chat-1": S.READY}
    assert m.pids() == pids                                   # same processes: nothing restarted
    assert [p.signals for p in m.backend.procs.values()] == [[], []]
    assert sorted(e.id for e in m.pools.pools["chat-model"]) == ["chat-0", "chat-1"]
    # each endpoint keeps where its engine publishes KV events (the backend's facts, as before the restart)
    assert [e.kv_events.publisher for e in m.pools.pools["chat-model"]] == [
        "ipc:///fleet-fake/kv/chat-0.pub", "ipc:///fleet-fake/kv/chat-1.pub"]
    assert m.pools.updates == updates + 1                     # the new controller republished once, same pool
    await m.tick()
    assert c.replicas["chat-0"].id == "chat-0" and len(m.backend.procs) == 2


async def test_the_target_last_set_is_restored_and_new_ids_never_collide(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=1)])
    await m.ready(1)
    m.c.set_desired("chat", 3, reason="autoscaler: queue_time_above_target")
    c = await m.restart()
    assert c.deployments["chat"].desired == 3
    assert c.deployments["chat"].desired_reason == "autoscaler: queue_time_above_target"
    await m.tick()
    m.healthy_all()
    await m.tick(3)
    assert m.status() == {"chat-0": S.READY, "chat-1": S.READY, "chat-2": S.READY}


@pytest.mark.parametrize("ensures_before_crash", [0, 1, 2])
async def test_a_crash_in_the_middle_of_a_scale_up_leaves_no_duplicate_and_no_orphan(tmp_path, ensures_before_crash):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=1)])
    await m.ready(1)
    m.c.set_desired("chat", 4, reason="set")
    m.backend.crash_after_ensures = 1 + ensures_before_crash  # chat-0's ensure already counted
    with pytest.raises(ControllerCrash):
        await m.tick()
    started = sorted(m.pids())
    assert len(started) == 1 + ensures_before_crash
    m.backend.crash_after_ensures = None
    c = await m.restart()
    await m.tick()
    m.healthy_all()
    await m.tick(3)
    assert m.status() == {f"chat-{i}": S.READY for i in range(4)}, m.status()
    assert c.deployments["chat"].desired == 4
    assert sorted(m.pids()) == [f"chat-{i}" for i in range(4)]   # one process each, none extra
    assert all(pid_started == sorted(m.pids())[i] for i, pid_started in enumerate(started))
    assert m.backend.ensure_calls.count("chat-0") == 1            # the serving replica was never re-asked


async def test_a_crash_during_warm_up_warms_the_same_process_again(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=1)])
    m.engines.gate = asyncio.Event()          # warm-up requests hang until the gate opens
    await m.tick()
    m.healthy_all()
    await m.tick()
    assert m.status() == {"chat-0": S.WARMING}
    pids = m.pids()
    c = await m.restart()
    assert c.replicas["chat-0"].status is S.STARTING     # probed again, then warmed again
    m.engines.gate.set()
    await m.tick(3)
    assert m.status() == {"chat-0": S.READY}
    assert m.pids() == pids
    assert [e.id for e in m.pools.pools["chat-model"]] == ["chat-0"]


async def test_a_crash_during_a_drain_finishes_the_drain_and_keeps_the_target(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=2)])
    await m.ready(2)
    m.pools.in_flight_by_id = {"chat-1": 2}
    m.c.set_desired("chat", 1, reason="autoscaler: below target")
    await m.tick()
    assert m.status()["chat-1"] is S.DRAINING
    c = await m.restart()
    await m.tick(2)
    assert c.replicas["chat-1"].status is S.DRAINING
    assert m.backend.by_replica("chat-1").signals == []      # requests still in flight: not stopped yet
    assert [(e.id, e.draining) for e in m.pools.pools["chat-model"]] == [("chat-0", False), ("chat-1", True)]
    m.pools.in_flight_by_id = {}
    await m.tick(2)
    assert m.status() == {"chat-0": S.READY, "chat-1": S.TERMINATED}
    assert m.backend.by_replica("chat-0").signals == [] and c.deployments["chat"].desired == 1
    assert list(m.pids()) == ["chat-0"]


async def test_a_replica_that_died_while_no_controller_ran_is_failed_and_replaced(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=2)])
    await m.ready(2)
    m.backend.exit("chat-1", 137)
    c = await m.restart()
    assert c.replicas["chat-1"].status is S.FAILED_CRASHED
    assert c.replicas["chat-1"].failure.reason == "engine exited while no controller was running"
    m.clock.advance(11)                                       # the replacement's backoff
    await m.tick()
    m.healthy_all()
    await m.tick(3)
    assert m.status() == {"chat-0": S.READY, "chat-1": S.FAILED_CRASHED, "chat-2": S.READY}


async def test_an_owned_replica_no_record_names_is_stopped(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=1)])
    await m.ready(1)
    snapshot = copy.deepcopy(m.sink.last)
    m.c.set_desired("chat", 2)
    await m.tick()                      # chat-1 starts, but the state file is lost after it
    m.sink.last = snapshot
    c = await m.restart()
    assert m.backend.by_replica("chat-1").signals == ["SIGTERM"]
    assert c.replicas["chat-1"].status in (S.DRAINING, S.TERMINATED)
    await m.tick()
    m.healthy_all()
    await m.tick(3)
    assert m.status()["chat-0"] is S.READY and list(m.status().values()).count(S.READY) == 1
    assert "chat-1" not in m.pids()


async def test_a_changed_spec_drains_and_replaces_adopted_replicas(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=1)])
    await m.ready(1)
    changed = write_deployment(tmp_path, replicas=1, engine={"args": ["--max-model-len", "512"]})
    c = await m.restart([changed])
    assert c.replicas["chat-0"].status is S.DRAINING
    await m.tick()
    m.healthy_all()
    await m.tick(3)
    assert m.status() == {"chat-0": S.TERMINATED, "chat-1": S.READY}
    assert m.backend.by_replica("chat-1").spec.argv[-2:] == ["--max-model-len", "512"]


async def test_a_deployment_no_longer_declared_is_drained_and_its_pool_deleted(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=1), write_deployment(tmp_path, name="other", replicas=1)])
    await m.ready(2)
    m.pools.in_flight_by_id = {"other-0": 1}
    c = await m.restart([tmp_path / "chat.yaml"])
    await m.tick()
    assert c.replicas["other-0"].status is S.DRAINING
    assert [(e.id, e.draining) for e in m.pools.pools["other-model"]] == [("other-0", True)]
    m.pools.in_flight_by_id = {}
    await m.tick(2)
    assert c.replicas["other-0"].status is S.TERMINATED
    assert "other-model" not in m.pools.pools and m.pools.deleted == ["other-model"]
    assert m.status()["chat-0"] is S.READY
