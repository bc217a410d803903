"""In-repo fakes of the wrappers around side effects: process backend, engine HTTP, router
admin API, clock. Unit tests of the controller use these; nothing here starts a process or
opens a socket."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleet.backends.base import LaunchError, LaunchSpec, ProcessHandle
from fleet.controller import PoolEndpoint, PoolSettings
from warmup.client import EngineRequestError


class FakeClock:
    def __init__(self, start_s: float = 1000.0) -> None:
        self.now_s = start_s

    def __call__(self) -> float:
        return self.now_s

    def advance(self, seconds: float) -> None:
        self.now_s += seconds

    async def sleep(self, seconds: float) -> None:
        """Sleep on fake time: advance the clock, then let other tasks run once."""
        self.advance(seconds)
        await asyncio.sleep(0)


@dataclass
class FakeProcess:
    spec: LaunchSpec
    exit_code: int | None = None
    signals: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


class FakeBackend:
    """Processes as records. A test decides when one exits (`exit`), or marks an argv/env
    pattern to fail at launch. SIGTERM makes a process exit with 0 unless `ignore_sigterm`."""

    def __init__(self) -> None:
        self.procs: dict[int, FakeProcess] = {}
        self.next_pid = 100
        self.next_port = 9000
        self.ignore_sigterm = False
        self.fail_launch: str | None = None

    def allocate_port(self) -> int:
        self.next_port += 1
        return self.next_port

    def launch(self, spec: LaunchSpec) -> ProcessHandle:
        if self.fail_launch:
            raise LaunchError(self.fail_launch)
        self.next_pid += 1
        self.procs[self.next_pid] = FakeProcess(spec, log=[f"starting {spec.replica_id}"])
        return ProcessHandle(spec.replica_id, self.next_pid, spec.port, spec.log_path)

    def poll(self, handle: ProcessHandle) -> int | None:
        return self.procs[handle.pid].exit_code

    def stop(self, handle: ProcessHandle) -> None:
        p = self.procs[handle.pid]
        p.signals.append("SIGTERM")
        if not self.ignore_sigterm and p.exit_code is None:
            p.exit_code = 0

    def kill(self, handle: ProcessHandle) -> None:
        p = self.procs[handle.pid]
        p.signals.append("SIGKILL")
        if p.exit_code is None:
            p.exit_code = -9

    def log_tail(self, handle: ProcessHandle, lines: int = 20) -> list[str]:
        return self.procs[handle.pid].log[-lines:]

    # test helpers
    def by_replica(self, replica_id: str) -> FakeProcess:
        return next(p for p in self.procs.values() if p.spec.replica_id == replica_id)

    def exit(self, replica_id: str, code: int, log_line: str = "") -> None:
        p = self.by_replica(replica_id)
        if log_line:
            p.log.append(log_line)
        p.exit_code = code

    def alive(self) -> list[str]:
        return [p.spec.replica_id for p in self.procs.values() if p.exit_code is None]


class FakeEngineAPI:
    """Engines answer /health once `healthy` holds their port; warm-up fails for ports in
    `warmup_fails`; `/metrics` answers `metrics_text[port]` (EngineRequestError if absent)."""

    def __init__(self) -> None:
        self.healthy: set[int] = set()
        self.warmup_fails: set[int] = set()
        self.posts: list[tuple[str, str]] = []
        self.gate: asyncio.Event | None = None   # when set to an Event, requests wait for it
        self.metrics_text: dict[int, str] = {}
        self.scrapes: list[str] = []

    async def metrics(self, endpoint: str, timeout_s: float = 2.0) -> str:
        self.scrapes.append(endpoint)
        port = int(endpoint.rsplit(":", 1)[1])
        if port not in self.metrics_text:
            raise EngineRequestError("GET /metrics: ConnectError")
        return self.metrics_text[port]

    async def health(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        return int(endpoint.rsplit(":", 1)[1]) in self.healthy

    async def post(self, endpoint: str, path: str, body: dict, timeout_s: float) -> int:
        self.posts.append((endpoint, path))
        if self.gate is not None:
            await self.gate.wait()
        if int(endpoint.rsplit(":", 1)[1]) in self.warmup_fails:
            raise EngineRequestError("HTTP 500: boom")
        return 1


class FakePoolSink:
    """The router's admin API as records: pools put, in-flight counts and windowed stats that a
    test sets (`in_flight_by_id`, `stats_by_model`)."""

    def __init__(self) -> None:
        self.pools: dict[str, list[PoolEndpoint]] = {}
        self.settings: dict[str, PoolSettings] = {}
        self.updates = 0
        self.in_flight_by_id: dict[str, int] = {}
        self.stats_by_model: dict[str, dict] = {}
        self.stats_windows: list[float] = []
        self.fail = False

    async def put_pool(self, model: str, settings: PoolSettings, endpoints: list[PoolEndpoint]) -> None:
        if self.fail:
            raise RuntimeError("router unreachable")
        self.pools[model] = list(endpoints)
        self.settings[model] = settings
        self.updates += 1

    async def stats(self, window_s: float) -> dict[str, dict]:
        if self.fail:
            raise RuntimeError("router unreachable")
        self.stats_windows.append(window_s)
        return dict(self.stats_by_model)

    async def in_flight(self) -> dict[str, int]:
        return dict(self.in_flight_by_id)
