"""In-repo fakes of the wrappers around side effects: replica backend, engine HTTP, router
admin API, clock. Unit tests of the controller use these; nothing here starts a process or
opens a socket (the unit tier's guards, tests/support/guards.py, make either fail)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fleet.controller.backend import LaunchError, ReplicaFacts, ReplicaWant, engine_model
from fleet.engines.kinds import KvEventsBind, get_engine
from fleet.inventory import Inventory, NodeInventory
from router.pools.spec import EndpointSpec, PoolSpec
from warmup.client import EngineRequestError


class ControllerCrash(BaseException):
    """Raised by a fake to kill the controller mid-tick, as `kill -9` would: a BaseException, so
    no step's error handling catches it; the state last saved is what a restart reads back."""


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


@dataclass(frozen=True)
class FakeLaunch:
    """What a process-running backend would have started: the engine's real command and env."""

    replica_id: str
    argv: list[str]
    env: dict[str, str]
    port: int
    kv_events: dict | None = None     # the KV event addresses its engine was given (as the local backend does)


@dataclass
class FakeProcess:
    spec: FakeLaunch
    want: ReplicaWant
    exit_code: int | None = None
    exited: bool = False
    signals: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)


class FakeBackend:
    """A `fleet.controller.backend.Backend` whose replicas are records. It builds the engine's real
    command and environment (as the local backend does) but starts nothing. A test decides when
    a replica exits (`exit`), or makes launches fail (`fail_launch`). A stop makes the engine exit
    with 0 unless `ignore_sigterm`. Several controllers may share one (a restarted controller
    finds the replicas the previous one started)."""

    def __init__(self, *nodes: NodeInventory) -> None:
        self.nodes = nodes or (NodeInventory(name="n", cpu_cores=(0, 1)),)
        self.procs: dict[int, FakeProcess] = {}
        self.next_pid = 100
        self.next_port = 9000
        self.ignore_sigterm = False
        self.fail_launch: str | None = None
        self.ensure_calls: list[str] = []
        self.crash_after_ensures: int | None = None   # raise ControllerCrash once this many ensures ran

    async def inventory(self) -> Inventory:
        return Inventory(tuple(self.nodes))

    async def ensure(self, want: ReplicaWant) -> None:
        if self.crash_after_ensures is not None and len(self.ensure_calls) >= self.crash_after_ensures:
            raise ControllerCrash(f"the controller dies before ensure({want.replica_id})")
        self.ensure_calls.append(want.replica_id)
        if self._find(want.replica_id) is not None:
            return
        if self.fail_launch:
            raise LaunchError(self.fail_launch)
        dep = want.deployment
        engine = get_engine(dep.spec.engine.kind)
        problem = engine.preflight()
        if problem:
            raise LaunchError(f"engine image not present: {problem}")
        model = engine_model(want)
        self.next_pid += 1
        self.next_port += 1
        kv = {"publisher": f"ipc:///fleet-fake/kv/{want.replica_id}.pub",
              "replay": f"ipc:///fleet-fake/kv/{want.replica_id}.replay", "topic": ""}  # fmt: skip
        argv = engine.command(dep.engine_launch(want.base_dir), model, "127.0.0.1", self.next_port,
                              KvEventsBind(kv["publisher"], kv["replay"]))  # fmt: skip
        launch = FakeLaunch(want.replica_id, argv, {**dep.spec.engine.env, **want.placement.env}, self.next_port, kv)
        self.procs[self.next_pid] = FakeProcess(launch, want, log=[f"starting {want.replica_id}"])

    async def observe(self) -> dict[str, ReplicaFacts]:
        out = {}
        for pid, p in self.procs.items():
            exited = p.exit_code is not None
            out[p.spec.replica_id] = ReplicaFacts(
                replica_id=p.spec.replica_id, deployment=p.want.deployment.name, spec_hash=p.want.spec_hash,
                node=p.want.placement.nodes[0], endpoint=f"http://127.0.0.1:{p.spec.port}", image_present=True,
                weights_present=True, running=not exited, exited=exited, exit_code=p.exit_code,
                exit_reason=f"engine exited with code {p.exit_code}" if exited else None,
                detail={"pid": str(pid), "port": str(p.spec.port)}, kv_events=p.spec.kv_events,
            )  # fmt: skip
        return out

    async def stop(self, replica_id: str) -> None:
        p = self._find(replica_id)
        if p is None:
            return
        p.signals.append("SIGTERM")
        if not self.ignore_sigterm and p.exit_code is None:
            p.exit_code = 0

    async def kill(self, replica_id: str) -> None:
        p = self._find(replica_id)
        if p is None:
            return
        p.signals.append("SIGKILL")
        if p.exit_code is None:
            p.exit_code = -9

    async def forget(self, replica_id: str) -> None:
        for pid, p in list(self.procs.items()):
            if p.spec.replica_id == replica_id and p.exit_code is not None:
                del self.procs[pid]

    async def log_tail(self, replica_id: str, lines: int = 20) -> list[str]:
        p = self._find(replica_id)
        return p.log[-lines:] if p else []

    # test helpers
    def _find(self, replica_id: str) -> FakeProcess | None:
        return next((p for p in self.procs.values() if p.spec.replica_id == replica_id), None)

    def by_replica(self, replica_id: str) -> FakeProcess:
        p = self._find(replica_id)
        assert p is not None, f"no replica {replica_id} in the backend: {sorted(self.alive())}"
        return p

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
        self.asleep: set[int] = set()            # ports put to sleep (POST /sleep), until /wake_up
        self.sleep_calls: list[tuple[str, str]] = []   # (endpoint, "sleep" | "wake_up")
        self.wake_gate: asyncio.Event | None = None     # when set to an Event, /wake_up waits for it

    async def metrics(self, endpoint: str, timeout_s: float = 2.0) -> str:
        self.scrapes.append(endpoint)
        port = int(endpoint.rsplit(":", 1)[1])
        if port not in self.metrics_text:
            raise EngineRequestError("GET /metrics: ConnectError")
        return self.metrics_text[port]

    async def health(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        return int(endpoint.rsplit(":", 1)[1]) in self.healthy

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        self.sleep_calls.append((endpoint, "sleep"))
        self.asleep.add(int(endpoint.rsplit(":", 1)[1]))

    async def wake_up(self, endpoint: str, timeout_s: float) -> None:
        self.sleep_calls.append((endpoint, "wake_up"))
        if self.wake_gate is not None:
            await self.wake_gate.wait()
        self.asleep.discard(int(endpoint.rsplit(":", 1)[1]))

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
        self.pools: dict[str, list[EndpointSpec]] = {}
        self.settings: dict[str, PoolSpec] = {}
        self.updates = 0
        self.deleted: list[str] = []
        self.in_flight_by_id: dict[str, int] = {}
        self.stats_by_model: dict[str, dict] = {}
        self.stats_windows: list[float] = []
        self.fail = False

    async def put_pool(self, model: str, pool: PoolSpec) -> None:
        if self.fail:
            raise RuntimeError("router unreachable")
        self.pools[model] = list(pool.endpoints)
        self.settings[model] = pool
        self.updates += 1

    async def delete_pool(self, model: str) -> None:
        if self.fail:
            raise RuntimeError("router unreachable")
        self.pools.pop(model, None)
        self.settings.pop(model, None)
        self.deleted.append(model)

    async def stats(self, window_s: float) -> dict[str, dict]:
        if self.fail:
            raise RuntimeError("router unreachable")
        self.stats_windows.append(window_s)
        return dict(self.stats_by_model)

    async def in_flight(self) -> dict[str, int]:
        return dict(self.in_flight_by_id)
