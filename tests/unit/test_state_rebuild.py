"""A state file that cannot be read: `fleet up` takes over from what survives beside it (the
backend's records and markers, the router's pools, the replica numbers ever used) and adopts
what runs instead of stopping it; `fleet status` names the file and shows what still runs; old
ended replicas leave `fleet status`. Fake time, the fake backend (tests/support/fakes.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from fleet.cli import app
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.local.rebuild import pooled_endpoint_ids, rebuild_snapshot
from fleet.spec import load_deployments
from tests.support.controller import write_deployment
from tests.unit.test_controller_restart import Machine


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


async def _rebuilt(m: Machine, files, pooled: set[str] | None, numbers: dict[str, int]) -> dict:
    facts = await m.backend.observe()
    return rebuild_snapshot(load_deployments(files), facts, {}, pooled, numbers, m.clock())


async def test_running_replicas_the_router_serves_are_adopted_ready_without_a_restart(tmp_path):
    files = [write_deployment(tmp_path, replicas=2)]
    m = Machine(tmp_path, files)
    await m.ready(2)
    m.c.set_desired("chat", 3)
    await m.tick()
    m.healthy_all()
    await m.tick(3)
    pids, served = m.pids(), {e.id for e in m.pools.pools["chat-model"]}
    assert served == {"chat-0", "chat-1", "chat-2"}
    m.sink.last = await _rebuilt(m, files, served, {"chat": 3})    # state.json was truncated
    c = await m.restart()
    assert {rid: r.status for rid, r in c.replicas.items()} == {"chat-0": S.READY, "chat-1": S.READY,
                                                                "chat-2": S.READY}  # fmt: skip
    assert c.deployments["chat"].desired == 3                       # not scaled back to spec.replicas.initial
    await m.tick(3)
    assert m.pids() == pids and all(p.signals == [] for p in m.backend.procs.values())
    assert {e.id for e in m.pools.pools["chat-model"]} == served     # the pool never lost an endpoint


async def test_replicas_the_router_does_not_serve_warm_again_and_ids_are_never_reused(tmp_path):
    files = [write_deployment(tmp_path, replicas=1)]
    m = Machine(tmp_path, files)
    await m.ready(1)
    pids = m.pids()
    m.sink.last = await _rebuilt(m, files, pooled=None, numbers={"chat": 5})   # a new router: pools unknown
    c = await m.restart()
    assert c.replicas["chat-0"].status is S.STARTING and c.replicas["chat-0"].adopted_at_s is not None
    assert c.deployments["chat"].next_index == 5
    await m.tick(3)
    assert m.status() == {"chat-0": S.READY} and m.pids() == pids    # probed and warmed, not restarted
    c.set_desired("chat", 2)
    await m.tick()
    assert "chat-5" in c.replicas                                     # numbers 1..4 were used before


def test_pooled_endpoint_ids_reads_the_admin_answer():
    pools = {"chat-model": {"endpoints": [{"id": "chat-0"}, {"id": "chat-1", "draining": True}, "junk"]},
             "other": None}  # fmt: skip
    assert pooled_endpoint_ids(pools) == {"chat-0"}
    assert pooled_endpoint_ids(None) is None


# ----- `fleet status` from whatever survives --------------------------------------------------

def _status(state_dir, *args):
    return CliRunner().invoke(app, ["status", "--state-dir", str(state_dir), *args], terminal_width=250)


def test_fleet_status_names_an_unreadable_state_file_and_does_not_crash(tmp_path):
    (tmp_path / "state.json").write_text('{"format": 3, "repl')
    result = _status(tmp_path)
    assert result.exit_code == 1, result.output
    assert "state.json is unreadable" in result.output and "not JSON" in result.output


def test_fleet_status_lists_failed_writes_and_hides_replicas_that_ended_long_ago(tmp_path):
    ended = {"id": "chat-0", "deployment": "chat", "status": "TERMINATED", "created_at_s": 0.0,
             "exited_at_s": 10.0, "failure": None}  # fmt: skip
    ready = {"id": "chat-1", "deployment": "chat", "status": "READY", "created_at_s": 900.0, "failure": None,
             "endpoint": "http://127.0.0.1:9"}  # fmt: skip
    state = {"format": 3, "clock_s": 1000.0, "phase": "stopped", "pid": None, "deployments": {},
             "replicas": [ended, ready], "control_write_errors": {"state": {
                 "errors": 4, "dropped": 9, "last_error": "[Errno 28] No space left on device (ENOSPC)",
                 "last_error_at_unix": 0, "failing": True}}}  # fmt: skip
    (tmp_path / "state.json").write_text(json.dumps(state))
    result = _status(tmp_path)
    assert result.exit_code == 0, result.output
    assert "Writes of state failed 4 time(s)" in result.output and "ENOSPC" in result.output
    assert "chat-1" in result.output and "chat-0" not in result.output.split("Replicas")[1].split("not shown")[0]
    assert "1 replica(s) that ended over 10 min ago not shown" in result.output
    assert "chat-0" in _status(tmp_path, "--all").output
