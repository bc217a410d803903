"""`fleet up`'s control plane fails soft: a write that fails (a full disk: ENOSPC; a pipe whose
reader has gone: EPIPE) is counted, backed off and tried again, and never reaches the loop, the
supervisors or the data plane. Faults are injected at the write seams (`os.write` of the output
streams, `write_atomically` of the state directory, the controller's event and state sinks);
fake time throughout. The same faults against real processes: tests/integration/."""

from __future__ import annotations

import asyncio
import errno
import json
import os

import pytest

import fleet.local.backend as backend_module
import fleet.local.state as state_module
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.local import up as up_module
from fleet.local.control import ControlServer, rollout_request
from fleet.local.failsoft import FailSoftStream, WriteErrors
from fleet.local.state import StateStore, StateUnreadable
from tests.support.fakes import FakeClock
from tests.support.controller import write_deployment
from tests.support.waits import async_wait_until
from tests.unit.test_controller_restart import Machine


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


# ----- WriteErrors: count, back off, try again -------------------------------------------------

def test_a_failed_write_is_counted_and_backed_off_then_tried_again():
    clock = FakeClock(0.0)
    errors = WriteErrors(clock, base_s=1.0, max_s=8.0)
    assert errors.attempt("state", enospc) is False
    assert errors.attempt("state", lambda: None) is False          # backing off: not even tried
    assert errors.state("state").dropped == 1
    clock.advance(1.0)
    assert errors.attempt("state", enospc) is False                 # second failure: 2 s
    assert errors.state("state").retry_at_s == pytest.approx(3.0)
    for _ in range(5):
        clock.advance(60)
        errors.attempt("state", enospc)
    assert errors.state("state").delay_s == 8.0                     # capped
    clock.advance(8.0)
    assert errors.attempt("state", lambda: None) is True
    snap = errors.snapshot()["state"]
    assert snap["errors"] == 7 and snap["failing"] is False and "ENOSPC" in snap["last_error"]
    [family] = list(errors.collect())
    assert family.name == "fleet_control_write_errors"
    assert [(s.name, s.labels, s.value) for s in family.samples if s.name.endswith("_total")] == [
        ("fleet_control_write_errors_total", {"target": "state"}, 7.0)]


def test_output_to_a_pipe_whose_reader_is_gone_is_dropped_and_counted(tmp_path):
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    errors = WriteErrors(FakeClock(0.0))
    out = FailSoftStream(write_fd, "stdout", errors, tee=tmp_path / "fleet-up.log")
    try:
        assert out.write("chat-0  READY\n") == len("chat-0  READY\n")   # EPIPE, not raised
        print("second line", file=out)                       # backing off: dropped (text, then newline)
        out.flush()
    finally:
        os.close(write_fd)
        out.close()
    state = errors.state("stdout")
    assert state.errors == 1 and state.dropped == 2 and "EPIPE" in state.last_error
    assert (tmp_path / "fleet-up.log").read_text() == "chat-0  READY\nsecond line\n"  # the log copy goes on


def test_output_to_a_full_disk_is_dropped_then_written_once_it_has_room(tmp_path):
    clock = FakeClock(0.0)
    errors = WriteErrors(clock)
    full = os.open("/dev/full", os.O_WRONLY)   # every write: ENOSPC
    out = FailSoftStream(full, "log", errors)
    try:
        out.write("a line\n")
        assert errors.state("log").errors == 1 and "ENOSPC" in errors.state("log").last_error
        target = tmp_path / "log"
        fd = os.open(target, os.O_WRONLY | os.O_CREAT)
        out.fd = fd                              # the disk was freed
        out.write("lost while backing off\n")
        clock.advance(1.0)
        out.write("written again\n")
        os.close(fd)
    finally:
        os.close(full)
    assert target.read_text() == "written again\n" and not errors.state("log").failing


# ----- the controller: nothing it writes escapes `run` ------------------------------------------

async def test_a_transition_that_cannot_be_printed_or_saved_never_leaves_the_loop(tmp_path):
    m = Machine(tmp_path, [write_deployment(tmp_path, replicas=2)])

    def broken_pipe(event):
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    m.c.on_event = broken_pipe
    m.sink.save = enospc
    await m.ready(2)                             # transitions were reported (and failed) all along
    stop = asyncio.Event()
    ticks = []

    def after_tick():
        ticks.append(1)
        if len(ticks) == 3:
            stop.set()
        raise OSError(errno.ENOSPC, "No space left on device")   # e.g. the file_sd file

    await asyncio.wait_for(m.c.run(stop, interval_s=0.0, after_tick=after_tick), timeout=30)
    assert len(ticks) == 3 and m.status() == {"chat-0": S.READY, "chat-1": S.READY}
    assert all(p.signals == [] for p in m.backend.procs.values())   # nothing drained or stopped


# ----- the state file: written soft, read strictly -----------------------------------------------

def test_a_state_write_on_a_full_disk_keeps_the_last_whole_file(tmp_path, monkeypatch):
    clock = FakeClock(0.0)
    store = StateStore(tmp_path, WriteErrors(clock))
    assert store.save({"replicas": [], "deployments": {"chat": {"next_index": 3}}}) is True
    monkeypatch.setattr(state_module, "write_atomically", enospc)
    assert store.save({"replicas": ["x"]}) is False
    assert store.save({"replicas": ["y"]}) is False and store.write_errors.state("state").dropped == 1
    assert store.read()["replicas"] == []
    monkeypatch.undo()
    assert store.save({"replicas": ["z"]}, force=True) is True
    saved = store.read()
    assert saved["replicas"] == ["z"] and saved["control_write_errors"]["state"]["errors"] == 1


@pytest.mark.parametrize("content, why", [
    ('{"format": 3, "replicas": [{"id": "ch', "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", "not a JSON object"),
    ('{"format": 3, "replicas": {"chat-0": {}}}', "'replicas' is a dict, not a list"),
    (b"\xff\xfe{", "codec"),
])  # fmt: skip
def test_an_unreadable_state_file_is_an_error_naming_the_file_and_why(tmp_path, content, why):
    store = StateStore(tmp_path)
    (tmp_path / "state.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(StateUnreadable) as err:
        store.read()
    assert str(tmp_path / "state.json") in str(err.value) and why in err.value.reason
    assert store.read_or_none() is None
    assert StateStore(tmp_path / "none").read() is None             # no file: a fresh start


def test_replica_numbers_outlive_the_state_file(tmp_path):
    store = StateStore(tmp_path)
    store.log_dir.mkdir()
    (store.log_dir / "chat-4.log").write_text("")
    (store.log_dir / "router.log").write_text("")
    store.save({"deployments": {"chat": {"next_index": 2}, "embed": {"next_index": 7}}})
    (tmp_path / "state.json").write_text("{trunc")
    again = StateStore(tmp_path)
    assert again.replica_numbers() == {"chat": 5, "embed": 7}


def test_the_lock_says_who_holds_it(tmp_path):
    store = StateStore(tmp_path)
    assert store.holder_pid() is None
    store.acquire()
    try:
        assert StateStore(tmp_path).holder_pid() == os.getpid()
    finally:
        store.release()
    assert store.holder_pid() is None


# ----- the replica records and the control channel --------------------------------------------

def test_replica_records_that_cannot_be_written_are_written_at_the_next_look(tmp_path, monkeypatch):
    from fleet.inventory import NodeInventory

    clock = FakeClock(0.0)
    errors = WriteErrors(clock)
    monkeypatch.setattr(backend_module, "write_atomically", enospc)
    backend = backend_module.LocalBackend(tmp_path, "f", NodeInventory(name="n"), write_errors=errors)  # no raise
    assert backend._unsaved and errors.state("replicas").errors == 1
    monkeypatch.undo()
    clock.advance(1.0)
    asyncio.run(backend.observe())
    assert not backend._unsaved and json.loads((tmp_path / "replicas.json").read_text()) == {"replicas": []}
    status = backend_module.LocalBackend(tmp_path / "ro", "f", NodeInventory(name="n"), read_only=True)
    assert status.records_path.parent.exists() is False              # `fleet status` writes nothing


def test_a_reply_that_cannot_be_written_leaves_the_request_for_the_next_look(tmp_path, monkeypatch):
    import fleet.local.control as control_module

    class Ctl:
        calls = 0

        def rollout_command(self, deployment, command):
            Ctl.calls += 1
            return {"message": "paused"}

    (tmp_path / "control").mkdir()
    (tmp_path / "control" / "1.json").write_text(json.dumps({**rollout_request("chat", "pause"), "id": "1"}))
    clock = FakeClock(0.0)
    server = ControlServer(tmp_path, Ctl(), write_errors=WriteErrors(clock))
    monkeypatch.setattr(control_module, "_write_atomically", enospc)
    server.handle_pending()
    assert (tmp_path / "control" / "1.json").exists() and server.write_errors.state("control").errors == 1
    monkeypatch.undo()
    server.handle_pending()
    assert not (tmp_path / "control" / "1.json").exists() and Ctl.calls == 2
    assert json.loads((tmp_path / "control" / "1.reply.json").read_text())["ok"] is True


# ----- the router supervisor ------------------------------------------------------------------

class _Admin:
    def __init__(self) -> None:
        self.synced = 0

    async def mark_synced(self) -> None:
        self.synced += 1


class _Router:
    """A router whose check fails first with a full disk (its record), then restarts it."""

    url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.starts = self.restarts = 1
        self.admin = _Admin()
        self.checks = 0
        self.persisted = 0

    async def ensure_running(self) -> bool:
        self.checks += 1
        if self.checks == 1:
            raise OSError(errno.ENOSPC, "No space left on device: router.json")
        if self.checks == 2:
            self.starts += 1     # restarted (its start wrote no record: the disk is full)
            self.restarts += 1
            return True
        return False

    def persist(self) -> bool:
        self.persisted += 1
        return True


class _Controller:
    def __init__(self) -> None:
        self.forgotten = 0
        self.published = False

    def forget_published_pools(self) -> None:
        self.forgotten += 1
        self.published = False

    def wake(self) -> None:
        self.published = True   # the next tick publishes every pool

    def pools_published(self) -> bool:
        return self.published


async def test_the_router_supervisor_survives_a_failed_write_and_republishes_after_a_restart(monkeypatch):
    monkeypatch.setattr(up_module, "ROUTER_CHECK_INTERVAL_S", 0.01)
    router, controller, stop = _Router(), _Controller(), asyncio.Event()
    said = []
    progress = type("P", (), {"say": lambda self, text, style="": said.append(text)})()
    task = asyncio.get_running_loop().create_task(up_module._supervise_router(router, controller, stop, progress))

    def republished() -> bool:
        assert not task.done(), task.exception()
        return router.admin.synced >= 1 and router.checks >= 4

    await async_wait_until(republished, 10, what="the pools published again after four checks",
                           explain=lambda: f"checks {router.checks}, synced {router.admin.synced}")
    stop.set()
    await asyncio.wait_for(task, timeout=10)
    assert controller.forgotten == 1 and router.admin.synced == 1
    assert any("router restarted" in line for line in said)


# ----- the router's record when the disk is full ------------------------------------------------

def test_the_router_record_and_token_are_written_once_the_disk_has_room(tmp_path, monkeypatch):
    import fleet.local.routerproc as routerproc_module
    from fleet.local.procs import ProcessRecord

    clock = FakeClock(0.0)
    store = StateStore(tmp_path, WriteErrors(clock))
    router = routerproc_module.RouterProcess(store, "127.0.0.1", 1)
    router.record = ProcessRecord(os.getpid(), 1, ("router",), None, 0.0)
    router._unpersisted = "tok"
    monkeypatch.setattr(state_module, "write_atomically", enospc)
    assert router.persist() is False and store.write_errors.state("admin_token").errors == 1
    monkeypatch.undo()
    assert router.persist() is False            # backing off
    clock.advance(1.0)
    assert router.persist() is True
    assert store.admin_token() == "tok" and json.loads(router.record_path.read_text())["url"] == router.url
    assert oct((tmp_path / "admin-token").stat().st_mode & 0o777) == "0o600"



async def test_a_router_restarted_on_a_full_disk_keeps_the_token_the_controller_and_the_file_hold(tmp_path, monkeypatch):
    """The restarted router gets its predecessor's admin token (held in memory), so the token file
    that could not be written again, the controller's client and `fleet status` stay right."""
    from fleet.controller.router_admin import RouterAdminClient
    from fleet.local.routerproc import RouterProcess
    from tests.unit.test_routerproc_models_file import FakeProcesses

    async def healthy(self) -> bool:
        return True

    monkeypatch.setattr(RouterAdminClient, "healthy", healthy)
    store = StateStore(tmp_path, WriteErrors(FakeClock(0.0)))
    processes = FakeProcesses()
    envs = []
    spawn = processes.spawn
    processes.spawn = lambda argv, env, log_path, **kw: envs.append(env) or spawn(argv, env, log_path)
    router = RouterProcess(store, "127.0.0.1", 0, processes)
    try:
        await router.start()
        token = store.admin_token()
        router.record = None                        # the router's process is gone
        monkeypatch.setattr(state_module, "write_atomically", enospc)   # and the disk is full
        assert await router.ensure_running() is True
        assert store.write_errors.state("admin_token").errors == 1   # the file was not written again...
        assert envs[0]["FLEET_ROUTER_ADMIN_TOKEN"] == envs[1]["FLEET_ROUTER_ADMIN_TOKEN"] == token   # ...nor needed
        assert router.admin._http.headers["Authorization"] == f"Bearer {token}" and store.admin_token() == token
    finally:
        await router.stop()


def test_a_process_started_on_a_full_disk_logs_through_the_relay_rather_than_die(tmp_path, monkeypatch):
    from fleet.local.failsoft import log_target

    errors = WriteErrors(FakeClock(0.0))
    log = tmp_path / "logs" / "chat-3.log"
    log.parent.mkdir()
    assert log_target(log, errors, "engine_log") == (log, False)
    full = os.statvfs_result((4096, 4096, 1024, 0, 0, 100, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    assert log_target(log, errors, "engine_log") == (log, True)
    assert errors.state("engine_log").errors == 1 and "ENOSPC" in errors.state("engine_log").last_error


def test_the_log_relay_drops_output_while_the_disk_is_full_and_writes_again_once_it_has_room(tmp_path, monkeypatch):
    """The output of a process started on a full disk (fleet/local/logrelay.py): dropped while
    writes fail, tried again on the backoff, then written after a line saying what was dropped."""
    from fleet.local import logrelay

    clock = FakeClock(0.0)
    log = tmp_path / "router.log"
    relay = logrelay.LogRelay(log, WriteErrors(clock))
    real_write = os.write
    monkeypatch.setattr(logrelay.os, "write", enospc)
    assert relay.feed(b"fleet router listening on http://127.0.0.1:8080\n") is False
    assert relay.feed(b"second line\n") is False          # backing off: not even tried
    assert relay.errors.state("log").errors == 1 and relay.errors.state("log").dropped == 1
    clock.advance(1.0)
    assert relay.feed(b"third line\n") is False           # tried again, still full: the backoff doubles
    assert relay.errors.state("log").delay_s == 2.0
    monkeypatch.setattr(logrelay.os, "write", real_write)  # the disk has room again
    assert relay.feed(b"fourth line\n") is False          # not before the backoff ends
    clock.advance(2.0)
    assert relay.feed(b"fifth line\n") is True
    relay.close()
    dropped = len(b"fleet router listening on http://127.0.0.1:8080\n second line\n third line\n fourth line\n") - 3
    assert log.read_text() == f"[fleet: {dropped} bytes of output dropped while {log} could not be written]\nfifth line\n"


async def test_a_loop_that_raises_is_started_again_until_stop():
    stop, runs = asyncio.Event(), []

    async def loop_body():
        runs.append(1)
        if len(runs) < 3:
            raise OSError(errno.EPIPE, "Broken pipe")
        await stop.wait()

    task = asyncio.get_running_loop().create_task(up_module._keep_running("control channel", loop_body, stop, 0.0))

    def ran_three_times() -> bool:
        assert not task.done(), task.exception()
        return len(runs) >= 3

    await async_wait_until(ran_three_times, 10, what="the loop run a third time after two broken pipes")
    stop.set()
    await asyncio.wait_for(task, timeout=10)
    assert len(runs) == 3
