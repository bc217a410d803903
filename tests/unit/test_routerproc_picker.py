"""`fleet up --picker-port`: the endpoint picker is started before the router, the router is told
where it is, a dead picker is restarted, and `fleet down` stops a recorded one
(fleet.local.routerproc.PickerProcess). Fake processes: nothing is started; the picker's port is a
listening socket of the test's own."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest

from fleet.controller.router_admin import RouterAdminClient
from fleet.local.routerproc import PickerProcess, RouterProcess, stop_recorded_picker
from fleet.local.state import StateStore
from tests.unit.test_routerproc_models_file import FakeProcesses


def test_the_picker_starts_first_restarts_when_gone_and_fleet_down_stops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def healthy(self: RouterAdminClient) -> bool:
        return True

    monkeypatch.setattr(RouterAdminClient, "healthy", healthy)
    store = StateStore(tmp_path)
    with socket.socket() as listening:   # the picker's port, as `python -m router.picker` would listen
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        picker_processes = FakeProcesses()
        picker = PickerProcess(store, "127.0.0.1", port, picker_processes)
        router_processes = FakeProcesses()
        router = RouterProcess(store, "127.0.0.1", 1, router_processes)
        router.picker = picker.address

        async def scenario() -> None:
            await picker.start()
            await router.start()
            assert not await picker.ensure_running()
            picker_processes.alive = False   # killed
            assert await picker.ensure_running() and picker.restarts == 1
            await router.stop()

        def spawn_alive(argv, env, log_path, _spawn=picker_processes.spawn, **kwargs):
            picker_processes.alive = True
            return _spawn(argv, env, log_path, **kwargs)

        picker_processes.spawn = spawn_alive   # type: ignore[method-assign]
        asyncio.run(scenario())
    assert picker_processes.started[0][1:3] == ["-m", "router.picker"] and len(picker_processes.started) == 2
    argv = router_processes.started[0]
    assert argv[argv.index("--picker") + 1] == f"127.0.0.1:{port}"
    assert (tmp_path / "picker.json").exists()
    monkeypatch.setattr("fleet.local.routerproc.LocalProcesses", lambda: picker_processes)
    picker_processes.is_ours = lambda record: True   # type: ignore[method-assign]
    assert asyncio.run(stop_recorded_picker(store))
    assert not picker_processes.alive and not (tmp_path / "picker.json").exists()
    assert not asyncio.run(stop_recorded_picker(store))   # nothing recorded any more
