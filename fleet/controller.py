"""The controller: one reconcile loop converging the desired replicas of each deployment to
the observed ones.

Owns target state (desired replicas per deployment, persisted before it is acted on), the
replica records (`fleet.lifecycle.Replica`), and the reconcile step that is the only place
replicas are created, placed, launched, warmed, admitted to the router, drained, stopped and
replaced. Every side effect goes through an injected wrapper: `Backend` (processes),
`EngineAPI` (engine HTTP), `PoolSink` (router admin API), `StateStore` (state file); time comes
from an injected clock, so tests drive it on fake time. Called by `fleet up` (fleet.up).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.backends.base import Backend, LaunchError, LaunchSpec, ProcessHandle
from fleet.engines import ModelUnavailable, get_engine
from fleet.inventory import Inventory, NodeInventory
from fleet.lifecycle import Replica, ReplicaStatus
from fleet.placement import PlacementRequest, PlacementStrategy, ReplicaPlacement, get_strategy
from fleet.spec import LoadedDeployment
from warmup.client import EngineAPI
from warmup.run import WarmupResult, readiness_gate, run_warmup

log = logging.getLogger("fleet.controller")


@dataclass(frozen=True)
class PoolEndpoint:
    id: str
    url: str
    version: str
    draining: bool = False


@dataclass(frozen=True)
class PoolSettings:
    """How the router serves one model's pool (from `spec.routing`): routing policy and the
    admission queue (`max_concurrency_per_endpoint` None: no queue)."""

    policy: str
    max_concurrency_per_endpoint: int | None = None
    max_queue_length: int = 1000
    queue_timeout_s: float = 30.0

    @classmethod
    def of(cls, routing) -> PoolSettings:
        """From a `fleet.spec.RoutingSpec`."""
        return cls(routing.policy, routing.max_concurrency_per_endpoint, routing.max_queue_length,
                   routing.queue_timeout_seconds)  # fmt: skip


class PoolSink(Protocol):
    """Where the controller publishes each model's pool: the router's admin API."""

    async def put_pool(self, model: str, settings: PoolSettings, endpoints: list[PoolEndpoint]) -> None:
        """Replace the pool of ``model``. Raises on failure (retried next tick)."""
        ...

    async def in_flight(self) -> dict[str, int]:
        """Endpoint id -> requests in flight at the router, over all pools."""
        ...


class StateSink(Protocol):
    def save(self, snapshot: dict) -> None: ...


@dataclass(frozen=True)
class ReplicaEvent:
    replica_id: str
    deployment: str
    old: ReplicaStatus | None
    new: ReplicaStatus
    detail: str
    at_s: float


@dataclass(frozen=True)
class ControllerSettings:
    host: str = "127.0.0.1"
    health_timeout_s: float = 2.0
    ready_health_interval_s: float = 5.0        # how often READY replicas are probed
    unhealthy_threshold: int = 3                # consecutive failed probes before FAILED_UNHEALTHY
    stop_grace_s: float = 30.0                  # SIGTERM -> SIGKILL
    drain_timeout_s: float = 120.0              # longest wait for in-flight requests to finish
    backoff_base_s: float = 10.0                # replacement after the n-th failure in a row:
    backoff_max_s: float = 300.0                #   min(base * 2**(n-1), max) seconds
    history_per_deployment: int = 10            # terminal replicas kept for `fleet status`
    log_tail_lines: int = 20


@dataclass
class _DeploymentState:
    loaded: LoadedDeployment
    desired: int
    next_index: int = 0
    failures_in_row: int = 0
    next_create_at_s: float = 0.0
    last_pool: tuple | None = None
    desired_reason: str = "spec.replicas"        # why `desired` has its value (who set it last)
    desired_at_s: float | None = None
    last_scaling: dict | None = None             # the autoscaler's last decision (`fleet status`)


class Controller:
    """Converges desired to observed replicas, one idempotent `reconcile_once` per tick."""

    def __init__(
        self,
        deployments: list[LoadedDeployment],
        *,
        backend: Backend,
        engine_api: EngineAPI,
        pool_sink: PoolSink,
        node: NodeInventory,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] | None = None,
        state_sink: StateSink | None = None,
        placer: PlacementStrategy | None = None,
        settings: ControllerSettings | None = None,
        on_event: Callable[[ReplicaEvent], None] | None = None,
        log_dir=None,
    ) -> None:
        self.backend = backend
        self.engine_api = engine_api
        self.pool_sink = pool_sink
        self.node = node
        self.inventory = Inventory((node,))
        self.clock = clock
        self._sleep = sleep or asyncio.sleep   # waits between shutdown ticks; fake time in tests
        self.state_sink = state_sink
        self.placer = placer or get_strategy()
        self.settings = settings or ControllerSettings()
        self.on_event = on_event or (lambda e: None)
        self.log_dir = log_dir
        self.deployments: dict[str, _DeploymentState] = {
            ld.deployment.name: _DeploymentState(ld, ld.deployment.spec.replicas.desired_at_start)
            for ld in deployments
        }
        self.replicas: dict[str, Replica] = {}
        self._handles: dict[str, ProcessHandle] = {}
        self._assignments: dict[str, ReplicaPlacement] = {}
        self._warmups: dict[str, asyncio.Task[WarmupResult]] = {}
        self._wake = asyncio.Event()
        self._last_status: dict[str, ReplicaStatus] = {}
        self._waiting: dict[str, str] = {}          # replica id -> why it is still PENDING
        self._last_probe_s: dict[str, float] = {}
        self.tick_count = 0

    # ----- target state -------------------------------------------------------------------

    def set_desired(self, deployment: str, replicas: int, reason: str = "set") -> None:
        """New target replica count (clamped to the spec's min..max) and why; persisted at once.
        The reconcile step then adds replicas or drains the surplus."""
        ds = self.deployments[deployment]
        bounds = ds.loaded.deployment.spec.replicas
        desired = max(bounds.min, min(bounds.max, replicas))
        if desired != ds.desired:
            ds.desired_reason, ds.desired_at_s = reason, self.clock()
        ds.desired = desired
        self._save()

    def note_scaling_decision(self, deployment: str, decision: dict) -> None:
        """Keep the autoscaler's latest decision (JSON-ready) for the state file and `fleet status`."""
        self.deployments[deployment].last_scaling = decision

    def stop_all(self) -> None:
        """Target zero replicas everywhere (shutdown); persisted at once."""
        for ds in self.deployments.values():
            ds.desired = 0
        self._save()

    def kill_all(self) -> None:
        """SIGKILL every replica process now (a second Ctrl-C)."""
        for rid, handle in self._handles.items():
            if self.replicas[rid].process_alive:
                self.backend.kill(handle)

    # ----- the loop -----------------------------------------------------------------------

    async def reconcile_once(self) -> None:
        """One tick. Each step has its own error handling so one failing part never stops the rest."""
        self.tick_count += 1
        for step in (
            self._observe_processes,
            self._probe_health,
            self._collect_warmups,
            self._scale,
            self._place_and_launch,
            self._drain_and_stop,
            self._publish_pools,
        ):
            started_s = self.clock()
            try:
                await step()
            except Exception:  # noqa: BLE001 - a step's failure is logged; the loop goes on
                log.exception("reconcile step %s failed", step.__name__)
            took_s = self.clock() - started_s
            if took_s > 1.0:
                log.warning("reconcile step %s took %.1f s", step.__name__, took_s)
        self._emit_transitions()
        self._trim_history()
        self._save()

    async def run(
        self, stop: asyncio.Event, interval_s: float = 1.0, after_tick: Callable[[], None] | None = None
    ) -> None:
        """Reconcile every ``interval_s`` seconds until ``stop`` is set, and at once when
        something the loop waits for has happened (a warm-up finished, `wake()`).

        ``after_tick`` runs after each tick (progress output).
        """
        while not stop.is_set():
            await self.reconcile_once()
            if after_tick is not None:
                after_tick()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def wake(self) -> None:
        """Run the next tick now instead of at the end of the interval."""
        self._wake.set()

    async def shutdown(self, timeout_s: float | None = None, interval_s: float = 0.5) -> None:
        """Drain and stop every replica, then return when no replica process is left.

        Replicas leave the pool first, in-flight requests finish (up to the drain timeout),
        engines get SIGTERM, then SIGKILL after the stop grace period.
        """
        self.stop_all()
        limit_s = timeout_s or (self.settings.drain_timeout_s + self.settings.stop_grace_s + 10.0)
        deadline_s = self.clock() + limit_s
        while any(r.process_alive for r in self.replicas.values()) and self.clock() < deadline_s:
            await self.reconcile_once()
            await self._sleep(interval_s)
        self.kill_all()
        for task in self._warmups.values():
            task.cancel()
        await self.reconcile_once()

    # ----- steps --------------------------------------------------------------------------

    async def _observe_processes(self) -> None:
        now = self.clock()
        for rid, handle in self._handles.items():
            r = self.replicas[rid]
            if not r.process_alive:
                continue
            code = self.backend.poll(handle)
            if code is None:
                continue
            r.exited_at_s, r.exit_code = now, code
            self._cancel_warmup(rid)
            if r.stop_requested_at_s is not None:
                continue
            tail = self.backend.log_tail(handle, self.settings.log_tail_lines)
            if r.healthy_at_s is None:
                self._fail(r, ReplicaStatus.FAILED_START, f"engine exited with code {code} before /health passed", tail)
            else:
                self._fail(r, ReplicaStatus.FAILED_CRASHED, f"engine exited with code {code}", tail)

    async def _probe_health(self) -> None:
        now = self.clock()
        probes: list[Replica] = []
        for r in self.replicas.values():
            if not r.process_alive or r.failure or r.stop_requested_at_s is not None:
                continue
            status = r.status
            if status is ReplicaStatus.STARTING:
                timeout_s = self._dep(r).spec.engine.startup_timeout_seconds
                if now - r.launched_at_s > timeout_s:
                    self._fail(r, ReplicaStatus.FAILED_START, f"/health did not pass within {timeout_s:g} s of launch")
                    continue
                probes.append(r)
            elif status is ReplicaStatus.READY:
                if now - self._last_probe_s.get(r.id, float("-inf")) >= self.settings.ready_health_interval_s:
                    probes.append(r)
        if not probes:
            return
        results = await asyncio.gather(
            *(self.engine_api.health(r.endpoint, self.settings.health_timeout_s) for r in probes)
        )
        now = self.clock()
        for r, ok in zip(probes, results):
            self._last_probe_s[r.id] = now
            if r.status is ReplicaStatus.STARTING:
                if ok:
                    r.healthy_at_s = now
                    self._start_warmup(r)
            elif ok:
                r.consecutive_health_failures = 0
            else:
                r.consecutive_health_failures += 1
                if r.consecutive_health_failures >= self.settings.unhealthy_threshold:
                    self._fail(r, ReplicaStatus.FAILED_UNHEALTHY,
                               f"/health failed {r.consecutive_health_failures} times in a row")

    def _start_warmup(self, r: Replica) -> None:
        dep = self._dep(r)
        r.warmup_started_at_s = self.clock()
        task = asyncio.get_running_loop().create_task(
            run_warmup(self.engine_api, r.endpoint, dep.spec.model.name, dep.spec.warmup, self.clock),
            name=f"warmup-{r.id}",
        )
        task.add_done_callback(lambda _: self.wake())  # a passed replica joins the pool without waiting a tick
        self._warmups[r.id] = task

    async def _collect_warmups(self) -> None:
        now = self.clock()
        for rid, task in list(self._warmups.items()):
            if not task.done():
                continue
            del self._warmups[rid]
            r = self.replicas[rid]
            if task.cancelled() or r.status is not ReplicaStatus.WARMING:
                continue
            exc = task.exception()
            result = task.result() if exc is None else WarmupResult(False, 0, reason=f"warm-up crashed: {exc!r}")
            if readiness_gate(r.healthy_at_s is not None, result):
                r.warmup_passed_at_s = now
                self.deployments[r.deployment].failures_in_row = 0
            else:
                self._fail(r, ReplicaStatus.FAILED_WARMUP, result.reason or "warm-up failed")

    async def _scale(self) -> None:
        now = self.clock()
        for name, ds in self.deployments.items():
            active = [r for r in self.replicas.values() if r.deployment == name and r.status.counts_toward_desired()]
            if len(active) < ds.desired and now >= ds.next_create_at_s:
                for _ in range(ds.desired - len(active)):
                    self._create_replica(ds, now)
            elif len(active) > ds.desired:
                # Remove the least advanced first (PENDING before STARTING before READY), newest first.
                order = list(ReplicaStatus)
                created = {rid: i for i, rid in enumerate(self.replicas)}  # insertion = creation order
                victims = sorted(active, key=lambda r: (order.index(r.status), -created[r.id]))
                for r in victims[: len(active) - ds.desired]:
                    r.drain_requested_at_s = now

    def _create_replica(self, ds: _DeploymentState, now: float) -> None:
        dep = ds.loaded.deployment
        rid = f"{dep.name}-{ds.next_index}"
        ds.next_index += 1
        self.replicas[rid] = Replica(id=rid, deployment=dep.name, revision=dep.spec.model.revision, created_at_s=now)

    async def _place_and_launch(self) -> None:
        holding = {rid: a for rid, a in self._assignments.items()
                   if self.replicas[rid].process_alive or self.replicas[rid].status is ReplicaStatus.PLACED}
        in_use: Counter[str] = Counter(d for a in holding.values() for d in a.devices)
        pending: dict[str, list[Replica]] = {}
        for r in sorted(self.replicas.values(), key=lambda r: r.created_at_s):
            if r.status is ReplicaStatus.PENDING and r.drain_requested_at_s is None:
                pending.setdefault(r.deployment, []).append(r)
        now = self.clock()
        for name, waiting in pending.items():
            ld = self.deployments[name].loaded
            dep = ld.deployment
            existing = [a for rid, a in holding.items() if self.replicas[rid].deployment == name
                        and self.replicas[rid].revision == dep.spec.model.revision]
            # The deployment's whole scale-up is one decision. This machine is warm: the local
            # backend runs the installed engine on local weights.
            request = PlacementRequest.for_deployment(dep, len(waiting), existing, warm_nodes=[self.node.name])
            plan = self.placer.place_replicas(request, self.inventory, in_use)
            for r, placement in zip(waiting, plan.placements):
                self._waiting.pop(r.id, None)
                in_use.update(placement.devices)
                self._assignments[r.id] = placement
                r.placed_at_s, r.assignment = now, placement.label
                self._launch(r, ld, placement)
            for r in waiting[len(plan.placements):]:
                self._waiting[r.id] = plan.explain()

    def _launch(self, r: Replica, ld: LoadedDeployment, assignment: ReplicaPlacement) -> None:
        now = self.clock()
        dep = ld.deployment
        engine = get_engine(dep.spec.engine.kind)
        problem = engine.preflight()
        if problem:
            self._fail(r, ReplicaStatus.FAILED_START, problem)
            return
        r.image_ready_at_s = now  # local backend: the installed engine is the image
        try:
            model = engine.model_argument(dep, ld.base_dir)
        except ModelUnavailable:
            self._fail(r, ReplicaStatus.FAILED_START, f"weights not found: spec.model.source {dep.spec.model.source!r}")
            return
        r.weights_ready_at_s = now
        port = self.backend.allocate_port()
        log_path = (self.log_dir / f"{r.id}.log") if self.log_dir is not None else None
        spec = LaunchSpec(
            replica_id=r.id,
            argv=engine.command(dep, model, self.settings.host, port),
            env={**dep.spec.engine.env, **assignment.env},
            port=port,
            log_path=log_path,
        )
        try:
            handle = self.backend.launch(spec)
        except LaunchError as err:
            self._fail(r, ReplicaStatus.FAILED_START, str(err))
            return
        self._handles[r.id] = handle
        r.launched_at_s, r.port, r.pid = now, port, handle.pid
        r.log_path = str(log_path) if log_path else None

    async def _drain_and_stop(self) -> None:
        now = self.clock()
        draining = [r for r in self.replicas.values() if r.status is ReplicaStatus.DRAINING and r.process_alive]
        in_flight: dict[str, int] = {}
        if any(r.warmup_passed_at_s is not None and r.stop_requested_at_s is None for r in draining):
            try:
                in_flight = await self.pool_sink.in_flight()
            except Exception as err:  # noqa: BLE001 - router unreachable: wait for the drain timeout
                log.warning("cannot read in-flight requests from the router: %s", err)
                in_flight = {r.id: 1 for r in draining}
        for r in self.replicas.values():
            handle = self._handles.get(r.id)
            if handle is None or not r.process_alive:
                continue
            if r.stop_requested_at_s is None:
                if r.failure is not None:
                    self._request_stop(r, handle, now)
                elif r.status is ReplicaStatus.DRAINING:
                    was_serving = r.warmup_passed_at_s is not None
                    drained = not was_serving or in_flight.get(r.id, 0) == 0
                    if drained or now - r.drain_requested_at_s >= self.settings.drain_timeout_s:
                        self._request_stop(r, handle, now)
            elif r.kill_sent_at_s is None and now - r.stop_requested_at_s >= self.settings.stop_grace_s:
                self.backend.kill(handle)
                r.kill_sent_at_s = now
        # Replicas that never launched and are asked to go are done at once.
        for r in self.replicas.values():
            if r.status is ReplicaStatus.DRAINING and r.launched_at_s is None:
                r.exited_at_s = now

    def _request_stop(self, r: Replica, handle: ProcessHandle, now: float) -> None:
        r.stop_requested_at_s = now
        self._cancel_warmup(r.id)
        self.backend.stop(handle)

    async def _publish_pools(self) -> None:
        for name, ds in self.deployments.items():
            dep = ds.loaded.deployment
            endpoints = [
                PoolEndpoint(r.id, r.endpoint, r.revision, draining=r.status is ReplicaStatus.DRAINING)
                for r in sorted(self.replicas.values(), key=lambda r: r.id)
                if r.deployment == name and r.warmup_passed_at_s is not None
                and r.status in (ReplicaStatus.READY, ReplicaStatus.DRAINING) and r.process_alive
                and r.stop_requested_at_s is None
            ]
            key = tuple(endpoints)
            if key == ds.last_pool:
                continue
            await self.pool_sink.put_pool(dep.spec.model.name, PoolSettings.of(dep.spec.routing), endpoints)
            ds.last_pool = key

    # ----- helpers ------------------------------------------------------------------------

    def _dep(self, r: Replica):
        return self.deployments[r.deployment].loaded.deployment

    def _fail(self, r: Replica, status: ReplicaStatus, reason: str, log_tail: list[str] | None = None) -> None:
        if r.failure is not None:
            return
        now = self.clock()
        if log_tail is None and r.id in self._handles:
            log_tail = self.backend.log_tail(self._handles[r.id], self.settings.log_tail_lines)
        r.fail(status, reason, now, log_tail)
        self._cancel_warmup(r.id)
        ds = self.deployments[r.deployment]
        ds.failures_in_row += 1
        delay_s = min(self.settings.backoff_base_s * 2 ** (ds.failures_in_row - 1), self.settings.backoff_max_s)
        ds.next_create_at_s = now + delay_s
        log.warning("replica %s %s: %s (replacement in %.0f s)", r.id, status.value, reason, delay_s)

    def _cancel_warmup(self, rid: str) -> None:
        task = self._warmups.pop(rid, None)
        if task is not None:
            task.cancel()

    def _emit_transitions(self) -> None:
        now = self.clock()
        for r in self.replicas.values():
            new = r.status
            old = self._last_status.get(r.id)
            if new is old:
                continue
            self._last_status[r.id] = new
            self.on_event(ReplicaEvent(r.id, r.deployment, old, new, self._detail(r, new), now))

    def _detail(self, r: Replica, status: ReplicaStatus) -> str:
        if status.failed() and r.failure:
            return r.failure.reason
        if status is ReplicaStatus.PENDING:
            return self._waiting.get(r.id, "")
        if status is ReplicaStatus.STARTING:
            return f"{r.assignment}, port {r.port}, pid {r.pid}"
        if status is ReplicaStatus.READY:
            ttr = r.time_to_ready_s()
            return f"{r.endpoint} ({ttr:.1f} s to ready)" if ttr is not None else r.endpoint or ""
        if status is ReplicaStatus.TERMINATED and r.exit_code is not None:
            return f"exit code {r.exit_code}"
        return ""

    def _trim_history(self) -> None:
        for name in self.deployments:
            done = [r for r in self.replicas.values() if r.deployment == name and r.status.terminal()]
            for r in sorted(done, key=lambda r: r.created_at_s)[: max(0, len(done) - self.settings.history_per_deployment)]:
                if r.process_alive:
                    continue
                for table in (self.replicas, self._handles, self._assignments, self._last_status, self._waiting):
                    table.pop(r.id, None)

    def snapshot(self) -> dict:
        """JSON-ready view of targets and replicas (the state file; `fleet status`)."""
        return {
            "clock_s": self.clock(),
            "node": self.node.describe(),
            "deployments": {
                name: {
                    "desired": ds.desired,
                    "desired_reason": ds.desired_reason,
                    "desired_at_s": ds.desired_at_s,
                    "autoscaling": (ds.loaded.deployment.spec.autoscaling.policy
                                    if ds.loaded.deployment.spec.autoscaling else None),
                    "last_scaling": ds.last_scaling,
                    "min": ds.loaded.deployment.spec.replicas.min,
                    "max": ds.loaded.deployment.spec.replicas.max,
                    "model": ds.loaded.deployment.spec.model.name,
                    "policy": ds.loaded.deployment.spec.routing.policy,
                    "source": str(ds.loaded.path),
                    "failures_in_row": ds.failures_in_row,
                }
                for name, ds in self.deployments.items()
            },
            "replicas": [
                {**r.to_dict(), "waiting_reason": self._waiting.get(r.id)}
                for r in sorted(self.replicas.values(), key=lambda r: (r.deployment, r.created_at_s))
            ],
        }

    def _save(self) -> None:
        if self.state_sink is not None:
            try:
                self.state_sink.save(self.snapshot())
            except OSError as err:
                log.warning("cannot write state: %s", err)
