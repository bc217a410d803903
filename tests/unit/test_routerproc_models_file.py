"""`fleet up`'s router is started with its models file beside the admin token, and a deliberate
stop removes the file (fleet.local.routerproc, router.http.remembered). Fake processes: nothing is
started."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleet.controller.router_admin import RouterAdminClient
from fleet.local.procs import LocalProcesses, ProcessRecord
from fleet.local.routerproc import ROUTER_MODELS_FILE, RouterProcess
from fleet.local.state import StateStore


class FakeProcesses(LocalProcesses):
    def __init__(self) -> None:
        self.started: list[list[str]] = []
        self.alive = True

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path | None,
              pass_fds: tuple[int, ...] = (), relay: bool = False) -> ProcessRecord:  # fmt: skip
        self.started.append(argv)
        return ProcessRecord(4242, 1, tuple(argv), str(log_path), 0.0)

    def poll(self, record: ProcessRecord) -> tuple[bool, int | None]:
        return self.alive, None

    def stop(self, record: ProcessRecord) -> None:
        self.alive = False


def test_the_router_gets_its_models_file_and_a_stop_removes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async def healthy(self: RouterAdminClient) -> bool:
        return True

    monkeypatch.setattr(RouterAdminClient, "healthy", healthy)
    store = StateStore(tmp_path)
    processes = FakeProcesses()
    router = RouterProcess(store, "127.0.0.1", 0, processes)

    async def scenario() -> None:
        await router.start()
        (tmp_path / ROUTER_MODELS_FILE).write_text('{"version": 1, "models": ["m"]}')  # the router wrote it
        await router.stop()

    asyncio.run(scenario())
    argv = processes.started[0]
    assert argv[argv.index("--models-file") + 1] == str(tmp_path / ROUTER_MODELS_FILE)
    assert (tmp_path / "admin-token").exists() and not (tmp_path / ROUTER_MODELS_FILE).exists()
