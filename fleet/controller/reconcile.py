"""The controller: one reconcile loop converging the desired replicas of each deployment to
the observed ones, and picking up where a previous controller left off.

Owns `Controller`: the reconcile step that is the only place replicas are created, placed,
asked to run, warmed, admitted to the router, drained, stopped and replaced, over the records it
keeps (`fleet.controller.targets.FleetRecords`: per deployment the persisted target and the
bookkeeping around it, the replica records of `fleet.controller.lifecycle`), and `start`, which
hands the previous controller's state to `fleet.controller.restart.Adoption`.

Every side effect goes through an injected wrapper: `Backend` (runs replicas: local processes,
later pods; `fleet.controller.backend`), `EngineAPI` (engine HTTP), `PoolSink` (router admin API),
`StateSink` (the state file). Time comes from an injected clock (tests run it on fake time). The
clock must be the same across controller restarts on one machine (`time.monotonic` is: Linux's
CLOCK_MONOTONIC counts from boot), since recorded facts are in its seconds.

Revisions: each deployment serves a stable revision and, during a canary rollout, a canary
(`fleet.rollout.revisions.Revisions`, persisted with the targets); replicas are wanted per
revision (`fleet.controller.scale.scale_step` decides each revision's step), and the rollout
driver (`fleet.controller.rollouts.RolloutDriver`, a collaborator) takes new specs (`apply`) and
drives rollouts.

Persistence: the whole state (target and replica records) is written atomically before each
batch of side effects (after new targets and replicas are decided, before the backend is asked
to run or stop replicas) and at the end of every tick. Called by `fleet up` and `fleet down`
(fleet.local.up).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.controller.backend import Backend, LaunchError, ReplicaFacts, ReplicaWant
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.model_memory import ModelMemory, Reader
from fleet.controller.preemption import Preemptor
from fleet.controller.restart import Adoption
from fleet.controller.rollouts import RolloutDriver
from fleet.controller.scale import scale_step
from fleet.controller.targets import STATE_FORMAT, DeploymentRecord, FleetRecords
from fleet.inventory import Inventory
from fleet.placement import (
    DeviceUse, PlacementRequest, PlacementStrategy, ReplicaPlacement, ReplicaShape, get_strategy,
)
from fleet.placement.preemption import DEFAULT_HOLD_OFF_S
from fleet.rollout.revisions import AnalysisSource, endpoint_weights, revision_label
from fleet.spec import LoadedDeployment
from router.spec import EndpointSpec, PoolSpec
from warmup.client import EngineAPI
from warmup.run import WarmupResult, readiness_gate, run_warmup

log = logging.getLogger("fleet.controller")

PUBLISH_CONCURRENCY = 16
"""Pool updates sent to the router at once (each its own admin API request)."""

YIELD_EVERY = 50
"""Deployments placed (or replicas launched) between two yields to the event loop in one tick:
a tick that places thousands of replicas never holds the loop for long stretches."""



class PoolSink(Protocol):
    """Where the controller publishes each model's pool: the router's admin API. The pool document
    is `router.spec.PoolSpec`, the one definition the router parses."""

    async def put_pool(self, model: str, pool: PoolSpec) -> None:
        """Replace the pool of ``model``. Raises on failure (retried next tick)."""
        ...

    async def delete_pool(self, model: str) -> None:
        """Remove the pool of ``model`` (absent is fine). Raises on failure."""
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
    health_timeout_s: float = 2.0
    ready_health_interval_s: float = 5.0        # how often READY replicas are probed
    unhealthy_threshold: int = 3                # consecutive failed probes before FAILED_UNHEALTHY
    stop_grace_s: float = 30.0                  # stop -> kill
    drain_timeout_s: float = 120.0              # longest wait for in-flight requests to finish
    backoff_base_s: float = 10.0                # replacement after the n-th failure in a row:
    backoff_max_s: float = 300.0                #   min(base * 2**(n-1), max) seconds
    history_per_deployment: int = 10            # terminal replicas kept for `fleet status`
    log_tail_lines: int = 20
    tick_budget_s: float = 1.0                  # wall time a tick spends placing and publishing pools;
                                                #   what is left waits for the next tick
    preemption_hold_off_s: float = DEFAULT_HOLD_OFF_S  # devices a preemption freed stay held off from
                                                #   lower priorities (fleet.placement.preemption)


class Controller:
    """Converges desired to observed replicas, one idempotent `reconcile_once` per tick.

    A deployment serves revisions (`fleet.rollout.revisions.Revisions`): the stable one and, during a
    canary rollout, the canary; replicas are wanted per revision (`Revisions.targets`). Two
    collaborators work on the same records: the rollout driver (``self.rollouts``,
    `fleet.controller.rollouts.RolloutDriver`) and, once at `start`, the take-over from a previous
    controller (`fleet.controller.restart.Adoption`). ``memory_reader`` says what one replica of a
    spec needs per GPU (`fleet.controller.model_memory`; default: read from the model's files or
    the hub), which every placement request carries once known."""

    def __init__(
        self,
        deployments: list[LoadedDeployment],
        *,
        backend: Backend,
        engine_api: EngineAPI,
        pool_sink: PoolSink,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]] | None = None,
        state_sink: StateSink | None = None,
        placer: PlacementStrategy | None = None,
        settings: ControllerSettings | None = None,
        on_event: Callable[[ReplicaEvent], None] | None = None,
        analysis_source: AnalysisSource | None = None,
        on_rollout_event: Callable[[str, str], None] | None = None,
        memory_reader: Reader | None = None,
    ) -> None:
        self.backend = backend
        self.engine_api = engine_api
        self.pool_sink = pool_sink
        self.inventory = Inventory(())
        self.clock = clock
        self._sleep = sleep or asyncio.sleep   # waits between shutdown ticks; fake time in tests
        self.state_sink = state_sink
        self.placer = placer or get_strategy()
        self.settings = settings or ControllerSettings()
        self.on_event = on_event or (lambda e: None)
        self.records = FleetRecords.of(deployments)
        self.rollouts = RolloutDriver(self.records, clock, analysis_source,
                                      on_rollout_event or (lambda deployment, line: None))  # fmt: skip
        self.preemption = Preemptor(self.records, self.placer, self.settings.preemption_hold_off_s)
        self._retired_pools: dict[str, PoolSpec] = {}   # pools of retired deployments as last published
        self._warmups: dict[str, asyncio.Task[WarmupResult]] = {}
        self._wake = asyncio.Event()
        self._last_status: dict[str, ReplicaStatus] = {}
        self._waiting: dict[str, str] = {}          # replica id -> why it is still PENDING
        self._last_probe_s: dict[str, float] = {}
        self._facts: dict[str, ReplicaFacts] = {}
        self.tick_count = 0
        self._tick_deadline = float("inf")
        # The memory a replica of each spec needs, for placement (read once; hf:// in a thread).
        self.model_memory = ModelMemory(clock, memory_reader, on_known=self.wake)

    # ----- what the controller keeps ---------------------------------------------------------

    @property
    def deployments(self) -> dict[str, DeploymentRecord]:
        """Declared deployments by name: target and bookkeeping (`fleet.controller.targets`)."""
        return self.records.deployments

    @property
    def replicas(self) -> dict[str, Replica]:
        """Replica records by id, in creation order."""
        return self.records.replicas

    @property
    def stopping(self) -> bool:
        """Shutdown asked: every replica drains and stops."""
        return self.records.stopping

    # ----- target state -------------------------------------------------------------------

    def set_desired(self, deployment: str, replicas: int, reason: str = "set") -> None:
        """New target replica count (clamped to the spec's min..max) and why; persisted at once.
        The reconcile step then adds replicas or drains the surplus."""
        ds = self.deployments[deployment]
        ds.target.set(ds.clamp(replicas), reason, self.clock())
        self._save()

    def note_scaling_decision(self, deployment: str, decision: dict) -> None:
        """Keep the autoscaler's latest decision (JSON-ready) for the state file and `fleet status`."""
        self.deployments[deployment].last_scaling = decision

    def stop_all(self) -> None:
        """Shutdown: every replica drains and stops. The targets are kept (a controller started
        after a crash during shutdown serves them again); persisted at once."""
        self.records.stopping = True
        self._save()

    def abandon(self) -> None:
        """This controller is being dropped (the operator lost its Lease): cancel its warm-up
        tasks; replicas and records are left as they are for the next controller to adopt."""
        for rid in list(self._warmups):
            self._cancel_warmup(rid)
        self.model_memory.close()

    def waiting_reason(self, replica_id: str) -> str | None:
        """Why a PENDING replica is not placed yet (`fleet.placement` explanation), or None."""
        return self._waiting.get(replica_id)

    def retiring(self, deployment: str) -> bool:
        """Whether ``deployment`` is no longer declared and its pool is still being drained."""
        return deployment in self.records.retired

    async def kill_all(self) -> None:
        """Force every running replica's engine to exit now (a second Ctrl-C)."""
        for r in self.replicas.values():
            if r.engine_alive:
                await self.backend.kill(r.id)

    def forget_published_pools(self) -> None:
        """The router lost its pools (it was restarted): publish every pool again next tick."""
        for ds in self.deployments.values():
            ds.last_pool = None

    def pools_published(self) -> bool:
        """Whether every deployment's pool has been written to the routers since the last
        `forget_published_pools`."""
        return all(ds.last_pool is not None for ds in self.deployments.values())

    # ----- start, specs and rollouts ----------------------------------------------------------

    async def start(self, previous: dict | None) -> None:
        """Take over from the controller that wrote ``previous`` (a `snapshot`; None: fresh
        start): `fleet.controller.restart.Adoption.take_over` says what is restored, adopted,
        drained or stopped. Persisted before the first tick."""
        now = self.clock()
        self.inventory = await self.backend.inventory()
        self._facts = await self.backend.observe()
        await Adoption(self.records, self.backend, self._facts).take_over(previous, now, self.rollouts.declare)
        self.preemption.restore(previous, now)
        self._save()

    def apply(self, loaded: list[LoadedDeployment]) -> list[str]:
        """New specs of deployments this controller runs (`RolloutDriver.apply`: a new revision
        starts a rollout or a replacement; other changes apply in place); persisted at once.
        Raises `fleet.controller.rollouts.UnknownDeployment` (nothing applied)."""
        lines = self.rollouts.apply(loaded)
        self._save()
        self.wake()
        return lines

    def add_deployment(self, ld: LoadedDeployment) -> None:
        """Run one more deployment, declared while this controller runs (the operator, when a
        resource is created): ``spec.replicas.initial`` wanted, its one revision stable; replicas
        are created by the next tick. Replica numbering continues after any records of the name.
        Persisted at once. Raises ValueError when the name is run here already, or its previous
        declaration is still being retired (`retiring`: take the hand-over of `start` instead)."""
        name = ld.deployment.name
        if name in self.deployments or name in self.records.retired:
            raise ValueError(f"deployment {name!r} is {'run' if name in self.deployments else 'retiring'} here")
        ds = DeploymentRecord.of(ld)
        for r in self.records.of_deployment(name):
            index = r.id.rsplit("-", 1)[-1]
            if index.isdigit():
                ds.next_index = max(ds.next_index, int(index) + 1)
        self.records.deployments[name] = ds
        # A retired deployment of the same model must not delete the pool this one now publishes.
        for old, model in list(self.records.retired.items()):
            if model == ds.model:
                del self.records.retired[old]
        self.rollouts.declare(ds, ld, self.clock())
        self._save()
        self.wake()

    def remove_deployment(self, name: str) -> None:
        """Stop running deployment ``name`` (no longer declared): its replicas drain through the
        router and stop, then its pool is deleted (`retiring` says when that is done), as
        `start` does for a deployment missing from today's specs. Persisted at once. Raises
        KeyError for a deployment not run here."""
        ds = self.records.deployments.pop(name)
        self.records.retired[name] = ds.model
        now = self.clock()
        for r in self.records.of_deployment(name):
            if r.status.counts_toward_desired():
                r.drain_requested_at_s = now
        self._save()
        self.wake()

    def rollout_command(self, deployment: str, command: str) -> dict:
        """`fleet rollout COMMAND DEPLOYMENT` (`RolloutDriver.command`); a change is persisted at
        once. Raises UnknownDeployment, or ValueError for an unknown command."""
        result, changed = self.rollouts.command(deployment, command)
        if changed:
            self._save()
            self.wake()
        return result

    def rollout_status(self, deployment: str) -> dict:
        """JSON-ready revisions, weights, rollout and recent events of ``deployment``."""
        return self.rollouts.status(deployment)

    # ----- the loop -----------------------------------------------------------------------

    async def reconcile_once(self) -> None:
        """One tick. Each step has its own error handling so one failing part never stops the rest."""
        self.tick_count += 1
        # Placement and pool publishing stop once this tick has spent its budget (1,000 new
        # deployments at once are 10,000 placements and 1,000 pools: spread over a few ticks, none
        # long). Real time, not the injected clock: it paces work, it decides nothing.
        self._tick_deadline = time.monotonic() + self.settings.tick_budget_s
        for step in (
            self._observe,
            self._probe_health,
            self._collect_warmups,
            self._step_rollouts,
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
        for end in (self._emit_transitions, self._trim_history, self._save):
            try:
                end()
            except Exception:  # noqa: BLE001 - output and bookkeeping never stop the loop
                log.exception("reconcile %s failed", end.__name__)

    async def run(
        self, stop: asyncio.Event, interval_s: float = 1.0, after_tick: Callable[[], None] | None = None
    ) -> None:
        """Reconcile every ``interval_s`` seconds until ``stop`` is set, and at once when
        something the loop waits for has happened (a warm-up finished, `wake()`).

        ``after_tick`` runs after each tick (progress output).

        Never returns before ``stop`` is set, whatever a tick or ``after_tick`` raises (logged;
        the next tick comes as usual): only the caller's ``stop`` ends the loop, so a failure of
        the control plane's own output or state never reaches the replicas that serve.
        """
        while not stop.is_set():
            try:
                await self.reconcile_once()
            except Exception:  # noqa: BLE001 - the loop survives its parts (STYLE.md 9)
                log.exception("reconcile tick failed")
            if after_tick is not None:
                try:
                    after_tick()
                except Exception:  # noqa: BLE001 - progress output never stops the loop
                    log.exception("after-tick callback failed")
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    def wake(self) -> None:
        """Run the next tick now instead of at the end of the interval."""
        self._wake.set()

    async def shutdown(self, timeout_s: float | None = None, interval_s: float = 0.5) -> None:
        """Drain and stop every replica, then return when no replica's engine is left.

        Replicas leave the pool first, in-flight requests finish (up to the drain timeout),
        engines are asked to stop, then killed after the stop grace period.
        """
        self.stop_all()
        limit_s = timeout_s or (self.settings.drain_timeout_s + self.settings.stop_grace_s + 10.0)
        deadline_s = self.clock() + limit_s
        while any(r.engine_alive for r in self.replicas.values()) and self.clock() < deadline_s:
            await self.reconcile_once()
            await self._sleep(interval_s)
        await self.kill_all()
        for task in self._warmups.values():
            task.cancel()
        await self.reconcile_once()

    # ----- steps --------------------------------------------------------------------------

    async def _observe(self) -> None:
        now = self.clock()
        self.inventory = await self.backend.inventory()
        self._facts = facts = await self.backend.observe()
        for r in self.replicas.values():
            f = facts.get(r.id)
            if not r.engine_alive:
                if f is not None and f.exited and r.exited_at_s is not None:
                    await self.backend.forget(r.id)
                continue
            if f is None:
                f = ReplicaFacts(r.id, r.deployment, r.spec_hash, r.node or "", exited=True,
                                 exit_reason="the backend has no record of it")  # fmt: skip
            r.node, r.endpoint, r.detail = f.node, f.endpoint, dict(f.detail)
            if f.image_present and r.image_ready_at_s is None:
                r.image_ready_at_s = now
            if f.weights_present and r.weights_ready_at_s is None:
                r.weights_ready_at_s = now
            if not f.exited:
                continue
            r.exited_at_s, r.exit_code = now, f.exit_code
            self._cancel_warmup(r.id)
            if r.stop_requested_at_s is not None:
                continue
            tail = await self.backend.log_tail(r.id, self.settings.log_tail_lines)
            why = f.exit_reason or "engine exited"
            if r.healthy_at_s is None:
                self._fail(r, ReplicaStatus.FAILED_START, f"{why} before /health passed", tail)
            else:
                self._fail(r, ReplicaStatus.FAILED_CRASHED, why, tail)
        for rid, f in facts.items():  # owned, unknown (a record lost or trimmed): stop it, or forget it once gone
            if rid not in self.replicas:
                if f.running:
                    await self.backend.stop(rid)
                elif f.exited:
                    await self.backend.forget(rid)

    async def _probe_health(self) -> None:
        now = self.clock()
        probes: list[Replica] = []
        for r in self.replicas.values():
            if not r.engine_alive or r.failure or r.stop_requested_at_s is not None or r.endpoint is None:
                continue
            status = r.status
            if status is ReplicaStatus.STARTING:
                timeout_s = self._dep(r).spec.engine.startup_timeout_seconds
                since_s = max(r.launched_at_s, r.weights_ready_at_s or r.launched_at_s)
                if now - since_s > timeout_s:
                    self._fail(r, ReplicaStatus.FAILED_START, f"/health did not pass within {timeout_s:g} s of start")
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

    async def _step_rollouts(self) -> None:
        if await self.rollouts.step():
            self._save()   # decided: persisted before the scale step acts on the new weights

    async def _scale(self) -> None:
        now = self.clock()
        changed = self._drain_unhealthy(now)
        for r in self.replicas.values():  # stopping, or deployments no longer declared: everything goes
            if (self.stopping or r.deployment not in self.deployments) and r.status.counts_toward_desired():
                r.drain_requested_at_s, changed = now, True
        order = list(ReplicaStatus)
        created = {rid: i for i, rid in enumerate(self.replicas)}  # insertion = creation order
        for name, ds in self.deployments.items():
            if self.stopping:
                break
            active = [r for r in self.records.of_deployment(name) if r.status.counts_toward_desired()]
            targets = ds.revs.targets(ds.desired)
            for h, want in targets.items():
                step = scale_step([r for r in active if r.spec_hash == h], want, lambda r: created[r.id],
                                  self._drain_preference)
                if step.create and now >= ds.next_create_at_s:
                    for _ in range(step.create):
                        self._create_replica(ds, h, now)
                    changed = True
                for r in step.drain:   # the least advanced first, the newest first among equals
                    r.drain_requested_at_s = now
                    changed = True
            # Older revisions serve until the current ones have the READY replicas to replace them
            # (a rolled-back one goes at once); the least advanced go first.
            older = [r for r in active if r.spec_hash not in targets]
            current = [r for r in active if r.spec_hash in targets]
            if ds.loaded.deployment.spec.rollout.surge:
                current = [r for r in current if r.status is ReplicaStatus.READY]
            keep = max(0, ds.desired - len(current))   # without surge, older replicas make room at once
            by_value = sorted(older, key=lambda r: (r.spec_hash in ds.revs.rolled_back, -order.index(r.status),
                                                    created[r.id]))  # fmt: skip
            for i, r in enumerate(by_value):
                if i >= keep or r.spec_hash in ds.revs.rolled_back:
                    r.drain_requested_at_s = now
                    changed = True
        if changed:
            self._save()  # decided: persisted before anything acts on it

    def _drain_preference(self, equals: list[Replica], n: int) -> list[Replica]:
        """Which ``n`` of ``equals`` (replicas of one revision and status, newest first) to drain:
        the placer's choice (`PlacementStrategy.drain_order`: ``fleet`` frees NVLink domains
        whole) when each holds a placement, else the newest."""
        if any(r.placement is None for r in equals):
            return equals[:n]
        oldest_first = equals[::-1]
        placements = [ReplicaPlacement.from_dict(r.placement) for r in oldest_first]
        in_use = Counter(d for a in self._holding().values() for d in a.devices)
        in_use.update(d for p in placements for d in p.devices if not in_use[d])
        return [oldest_first[i] for i in self.placer.drain_order(placements, n, self.inventory, in_use)]

    def _drain_unhealthy(self, now: float) -> bool:
        """Replicas holding a GPU (or a MIG instance of a GPU) that the inventory reports unhealthy
        (quarantined by the node agent, ECC errors, ...), or that the backend reports ``sick``
        (`ReplicaFacts.sick`: on Kubernetes the device plugin, not placement, picks the GPU), drain;
        `_scale` replaces them, and placement keeps the replacement off that GPU. True when one
        was drained."""
        drained = False
        for r in self.replicas.values():
            f = self._facts.get(r.id)
            if f is not None and f.sick and r.status.counts_toward_desired():
                r.drain_requested_at_s, r.drain_reason, drained = now, f.sick, True
                log.warning("replica %s drains: %s", r.id, f.sick)
        sick: dict[str, str] = {}
        for node in self.inventory.nodes:
            sick.update({uuid: f"{uuid} on {node.name} quarantined: {why}" for uuid, why in node.quarantined.items()})
            for gpu in node.gpus:
                problems = gpu.health.problems()
                if problems:
                    why = f"GPU {gpu.uuid} on {node.name} unhealthy: {', '.join(problems)}"
                    sick[gpu.uuid] = why
                    sick.update({m.uuid: why for m in gpu.mig_instances})
        if not sick:
            return drained
        for r in self.replicas.values():
            if r.placement is None or not r.status.counts_toward_desired():
                continue
            hit = next((sick[d] for d in ReplicaPlacement.from_dict(r.placement).devices if d in sick), None)
            if hit is not None:
                r.drain_requested_at_s, r.drain_reason, drained = now, hit, True
                log.warning("replica %s drains: %s", r.id, hit)
        return drained

    def _create_replica(self, ds: DeploymentRecord, spec_hash: str, now: float) -> None:
        ld = ds.revs.specs[spec_hash]
        dep = ld.deployment
        rid = f"{dep.name}-{ds.next_index}"
        ds.next_index += 1
        self.replicas[rid] = Replica(id=rid, deployment=dep.name, revision=dep.spec.model.revision, created_at_s=now,
                                     spec_hash=spec_hash)  # fmt: skip

    def _holding(self) -> dict[str, ReplicaPlacement]:
        """Replica id -> placement of every replica that holds its devices now."""
        return {rid: ReplicaPlacement.from_dict(r.placement) for rid, r in self.replicas.items()
                if r.placement is not None and (r.engine_alive or r.status is ReplicaStatus.PLACED)}

    def _placement_request(self, ld: LoadedDeployment, count: int,
                           holding: dict[str, ReplicaPlacement]) -> PlacementRequest:
        """``count`` more replicas of ``ld``: its live replicas fix product and gang width; warm
        nodes are where a replica of this very spec has its weights (so image and weights are
        there), beside what the nodes report as ``cached``; ``memory`` is what one replica needs per
        GPU when known (`fleet.controller.model_memory.ModelMemory.need`: never waits for the hub)."""
        mine = [rid for rid in holding if self.replicas[rid].spec_hash == ld.serving_hash]
        warm = {self.replicas[rid].node for rid in mine if self.replicas[rid].weights_ready_at_s}
        request = PlacementRequest.for_deployment(ld.deployment, count, [holding[rid] for rid in mine],
                                                  warm_nodes=warm - {None}, memory=self.model_memory.need(ld))
        return dataclasses.replace(request, fill_shapes=self._fill_shapes(ld.deployment.name, request.shape))

    def _fill_shapes(self, name: str, shape: ReplicaShape) -> tuple[int, ...]:
        """The TP widths the other deployments' specs ask for on a GPU product ``shape`` may use
        (`PlacementRequest.fill_shapes`: leftover-aware best fit); () for MIG and CPU shapes."""
        if shape.kind != "gpus":
            return ()
        mine = set(shape.gpu_products)
        widths: set[int] = set()
        for other, ds in self.deployments.items():
            if other == name:
                continue
            for ld in ds.revs.specs.values():
                s = ReplicaShape.of(ld.deployment)
                if s.kind == "gpus" and (not mine or not s.gpu_products or mine & set(s.gpu_products)):
                    widths.add(s.tensor_parallel_size)
        return tuple(sorted(widths))

    def next_replica_warm(self, deployment: str) -> bool:
        """Whether one more replica of ``deployment``'s serving spec, placed now, would start warm:
        every node of its placement holds the image and the weights
        (`fleet.placement.shapes.PlacementRequest.is_warm`). False when it does not fit now (it
        waits for capacity: no warm start to count on). Read by the autoscaler for its start-up
        estimate (`autoscaler.startup.StartupEstimate.next_warm`). Pure over the last observed
        inventory."""
        ds = self.deployments[deployment]
        ld = ds.revs.specs[ds.revs.stable]
        holding = self._holding()
        request = self._placement_request(ld, 1, holding)
        plan = self.placer.place_replicas(request, self.inventory,
                                          DeviceUse(d for a in holding.values() for d in a.devices))
        if not plan.placements:
            return False
        return all(request.is_warm(self.inventory.node(m.node)) for m in plan.placements[0].members)

    async def _place_and_launch(self) -> None:
        pending: dict[tuple[str, str], list[Replica]] = {}
        placed: list[Replica] = []
        for r in self.replicas.values():
            if r.drain_requested_at_s is None and r.status is ReplicaStatus.PENDING:
                pending.setdefault((r.deployment, r.spec_hash), []).append(r)
            elif r.status is ReplicaStatus.PLACED:
                placed.append(r)
        if not pending and not placed:
            return   # the usual tick at scale: nothing waits, so no scan of what every replica holds
        for waiting in pending.values():
            waiting.sort(key=lambda r: r.created_at_s)
        pending = dict(sorted(pending.items(), key=lambda kv: kv[1][0].created_at_s))   # oldest first, as before
        holding = self._holding()
        # A DeviceUse journals what this tick adds, so each later placement call of the tick
        # updates the placer's kept index from those changes alone (fleet.placement.freeindex).
        in_use: DeviceUse = DeviceUse(d for a in holding.values() for d in a.devices)
        now = self.clock()
        to_launch: list[tuple[Replica, ReplicaPlacement]] = []
        for i, ((name, spec_hash), waiting) in enumerate(pending.items()):
            if i and time.monotonic() > self._tick_deadline:
                for _key, later in list(pending.items())[i:]:
                    for r in later:
                        self._waiting[r.id] = "placed at the next tick (this tick's placement time is spent)"
                break
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)   # let the loop breathe (informers, /metrics) in a long placement
            ld = self.deployments[name].revs.specs[spec_hash]
            request = self._placement_request(ld, len(waiting), holding)   # the whole scale-up: one decision
            blocked = self.preemption.blocked(name, now)   # freed for a higher priority: held off
            plan = self.placer.place_replicas(request, self.inventory, in_use + blocked if blocked else in_use)
            # Devices a draining replica of this deployment still holds free up soon: a new replica
            # waits for them rather than share a device now (two CPU engines on one core starve
            # each other; a canary in place of a stable replica must not start on a shared one).
            freeing = [d for d in self.records.of_deployment(name) if d.engine_alive
                       and d.status is ReplicaStatus.DRAINING and d.placement is not None]  # fmt: skip
            for r, placement in zip(waiting, plan.placements):
                if freeing and not placement.exclusive:
                    self._waiting[r.id] = (f"waiting for the devices of draining replica(s) "
                                           f"{', '.join(d.id for d in freeing)} rather than share {placement.label}")
                    continue
                self._waiting.pop(r.id, None)
                in_use.update(placement.devices)
                r.placed_at_s, r.assignment, r.placement = now, placement.label, placement.to_dict()
                to_launch.append((r, placement))
            if unplaced := waiting[len(plan.placements):]:
                self._wait_or_preempt(name, ld, unplaced, plan.explain(), holding, in_use + blocked, now)
        placed_now = {r.id for r, _ in to_launch}
        for r in placed:  # placed before a crash, never started: start now
            if r.status is ReplicaStatus.PLACED and r.placement is not None and r.drain_requested_at_s is None \
                    and r.id not in placed_now:
                to_launch.append((r, ReplicaPlacement.from_dict(r.placement)))
        if not to_launch:
            return
        for r, _ in to_launch:
            r.launched_at_s = now
        self._save()  # persisted before the backend acts: a crash now leaves records to adopt
        for i, (r, placement) in enumerate(to_launch):
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            ld = self.deployments[r.deployment].revs.specs[r.spec_hash]
            want = ReplicaWant(r.id, ld.deployment, placement, ld.serving_hash, ld.base_dir)
            try:
                await self.backend.ensure(want)
            except LaunchError as err:
                r.exited_at_s = now
                self._fail(r, ReplicaStatus.FAILED_START, str(err), [])
            except Exception as err:  # noqa: BLE001 - a backend bug fails this replica, not the step
                log.exception("backend could not start replica %s", r.id)
                r.exited_at_s = now
                self._fail(r, ReplicaStatus.FAILED_START, f"backend error: {err!r}", [])
        await self._observe()  # endpoints, image and weights of what just started, in this same tick

    def _wait_or_preempt(self, name: str, ld: LoadedDeployment, unplaced: list[Replica], why: str,
                         holding: dict[str, ReplicaPlacement], in_use: Counter[str], now: float) -> None:  # fmt: skip
        """Replicas placement left unplaced wait, with the reason; below the deployment's
        minimum, lower-priority replicas are preempted for them (`fleet.controller.preemption`)."""
        decision = self.preemption.consider(name, self._placement_request(ld, len(unplaced), holding),
                                            self.inventory, in_use, holding, now)  # fmt: skip
        notes = [why] + [n for n in (decision and decision.reason, self.preemption.held_off_note(name, now)) if n]
        for r in unplaced:
            self._waiting[r.id] = "; ".join(notes)
        if decision is not None and decision.preempts:
            self._save()   # decided: persisted before the drain acts on it

    async def _drain_and_stop(self) -> None:
        now = self.clock()
        draining = [r for r in self.replicas.values() if r.status is ReplicaStatus.DRAINING and r.engine_alive]
        in_flight: dict[str, int] = {}
        if any(r.warmup_passed_at_s is not None and r.stop_requested_at_s is None for r in draining):
            try:
                in_flight = await self.pool_sink.in_flight()
            except Exception as err:  # noqa: BLE001 - router unreachable: wait for the drain timeout
                log.warning("cannot read in-flight requests from the router: %s", err)
                in_flight = {r.id: 1 for r in draining}
        stops: list[Replica] = []
        kills: list[Replica] = []
        for r in self.replicas.values():
            if not r.engine_alive:
                continue
            if r.stop_requested_at_s is None:
                if r.failure is not None:
                    stops.append(r)
                elif r.status is ReplicaStatus.DRAINING:
                    was_serving = r.warmup_passed_at_s is not None
                    drained = not was_serving or in_flight.get(r.id, 0) == 0
                    if drained or now - r.drain_requested_at_s >= self.settings.drain_timeout_s:
                        stops.append(r)
            elif r.kill_sent_at_s is None and now - r.stop_requested_at_s >= self.settings.stop_grace_s:
                kills.append(r)
        for r in stops:
            r.stop_requested_at_s = now
            self._cancel_warmup(r.id)
        for r in kills:
            r.kill_sent_at_s = now
        if stops or kills:
            self._save()
        for r in stops:
            await self.backend.stop(r.id)
        for r in kills:
            await self.backend.kill(r.id)
        # Replicas that never started and are asked to go are done at once.
        for r in self.replicas.values():
            if r.status is ReplicaStatus.DRAINING and r.launched_at_s is None:
                r.exited_at_s = now

    async def _publish_pools(self) -> None:
        for name, model in list(self.records.retired.items()):  # drained through the router, then deleted
            endpoints = self._pool_endpoints(name)
            if not endpoints:
                await self.pool_sink.delete_pool(model)
                del self.records.retired[name]
                self._retired_pools.pop(model, None)
            elif self._retired_pools.get(model) != (pool := PoolSpec(endpoints=endpoints)):
                await self.pool_sink.put_pool(model, pool)
                self._retired_pools[model] = pool
        changed: list[tuple[DeploymentRecord, PoolSpec]] = []
        for name, ds in self.deployments.items():
            routing = ds.loaded.deployment.spec.routing
            endpoints = self._pool_endpoints(name)
            stickiness = ds.loaded.deployment.spec.rollout.stickiness
            sticky_key = None if stickiness is None else (
                f"header:{stickiness.header}" if stickiness.header else "body:user")
            pool = PoolSpec(
                policy=routing.policy, endpoints=endpoints,
                max_concurrency_per_endpoint=routing.max_concurrency_per_endpoint,
                max_queue_length=routing.max_queue_length, queue_timeout_s=routing.queue_timeout_seconds,
                sticky_key=sticky_key,
            )  # fmt: skip
            if pool != ds.last_pool:
                changed.append((ds, pool))
        if not changed:
            return
        slots = asyncio.Semaphore(PUBLISH_CONCURRENCY)

        async def put(ds: DeploymentRecord, pool: PoolSpec) -> None:
            async with slots:
                await self.pool_sink.put_pool(ds.model, pool)
            ds.last_pool = pool

        # 1,000 new deployments are 1,000 pools: sent side by side, each one retried next tick if it
        # failed; in chunks, until the tick's budget is spent (the rest next tick).
        failed = []
        for at in range(0, len(changed), PUBLISH_CONCURRENCY * 4):
            chunk = changed[at: at + PUBLISH_CONCURRENCY * 4]
            results = await asyncio.gather(*(put(ds, pool) for ds, pool in chunk), return_exceptions=True)
            failed += [(ds.model, r) for (ds, _), r in zip(chunk, results) if isinstance(r, BaseException)]
            if time.monotonic() > self._tick_deadline:
                break
        if failed:
            log.warning("cannot publish %d pool(s) (retried next tick); first: %s: %r", len(failed), *failed[0])

    def _pool_endpoints(self, deployment: str) -> list[EndpointSpec]:
        """The router's view of a deployment: replicas that passed warm-up and still run; DRAINING
        ones marked draining (no new requests, in-flight ones finish). Each endpoint's version is
        its revision's label and its weight its revision's share (`fleet.rollout.revisions.endpoint_weights`)."""
        members = sorted((
            r for r in self.records.of_deployment(deployment)
            if r.warmup_passed_at_s is not None and r.endpoint is not None
            and r.status in (ReplicaStatus.READY, ReplicaStatus.DRAINING) and r.engine_alive
            and r.stop_requested_at_s is None
        ), key=lambda r: r.id)
        revs = self.deployments[deployment].revs if deployment in self.deployments else None
        ready = Counter(r.spec_hash for r in members if r.status is ReplicaStatus.READY)
        weights = endpoint_weights(revs, ready) if revs is not None else {}
        return [
            EndpointSpec(id=r.id, url=r.endpoint, version=self._version(r), weight=weights.get(r.spec_hash, 1.0),
                         draining=r.status is ReplicaStatus.DRAINING)  # fmt: skip
            for r in members
        ]

    def _version(self, r: Replica) -> str:
        ds = self.deployments.get(r.deployment)
        ld = ds.revs.specs.get(r.spec_hash) if ds is not None else None
        return revision_label(ld) if ld is not None else f"{r.revision}@{r.spec_hash[:8]}"

    # ----- helpers ------------------------------------------------------------------------

    def _dep(self, r: Replica):
        ds = self.deployments[r.deployment]
        return ds.revs.specs.get(r.spec_hash, ds.loaded).deployment

    def _fail(self, r: Replica, status: ReplicaStatus, reason: str, log_tail: list[str] | None = None) -> None:
        if r.failure is not None:
            return
        now = self.clock()
        r.fail(status, reason, now, log_tail or [])
        self._cancel_warmup(r.id)
        ds = self.deployments.get(r.deployment)
        if ds is None:
            return
        ds.failures_in_row += 1
        ds.failures_total[r.revision] = ds.failures_total.get(r.revision, 0) + 1
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
            try:
                self.on_event(ReplicaEvent(r.id, r.deployment, old, new, self._detail(r, new), now))
            except Exception:  # noqa: BLE001 - a transition that cannot be shown (EPIPE, ENOSPC) is logged only
                log.exception("cannot report %s %s", r.id, new.value)

    def _detail(self, r: Replica, status: ReplicaStatus) -> str:
        if status.failed() and r.failure:
            return r.failure.reason
        if status is ReplicaStatus.PENDING:
            return self._waiting.get(r.id, "")
        adopted = " (adopted: kept running)" if r.adopted_at_s is not None else ""
        if status in (ReplicaStatus.PULLING, ReplicaStatus.CACHING):
            return r.detail.get("cache", "")
        if status is ReplicaStatus.STARTING:
            where = ", ".join(f"{k} {v}" for k, v in r.detail.items() if k in ("port", "pid", "pod"))
            return f"{r.assignment}{', ' + where if where else ''}{adopted}"
        if status is ReplicaStatus.READY:
            ttr = r.time_to_ready_s()
            if r.adopted_at_s is not None:
                return f"{r.endpoint}{adopted}"
            return f"{r.endpoint} ({ttr:.1f} s to ready)" if ttr is not None else r.endpoint or ""
        if status is ReplicaStatus.DRAINING and r.drain_reason:
            return r.drain_reason
        if status is ReplicaStatus.TERMINATED and r.exit_code is not None:
            return f"exit code {r.exit_code}"
        return adopted.strip()

    def _trim_history(self) -> None:
        for name in self.replicas.deployment_names():
            done = [r for r in self.records.of_deployment(name) if r.status.terminal()]
            for r in sorted(done, key=lambda r: r.created_at_s)[: max(0, len(done) - self.settings.history_per_deployment)]:
                if r.engine_alive:
                    continue
                for table in (self.replicas, self._last_status, self._waiting):
                    table.pop(r.id, None)

    def snapshot(self) -> dict:
        """JSON-ready state: targets and replica records (the state file; `fleet status`; read
        back by `start`)."""
        return {
            "format": STATE_FORMAT,
            "clock_s": self.clock(),
            "stopping": self.stopping,
            "inventory": [n.describe() for n in self.inventory.nodes],
            "preemption": self.preemption.snapshot(),
            "deployments": {name: ds.to_dict() for name, ds in self.deployments.items()},
            "replicas": [
                {**r.to_dict(), "waiting_reason": self._waiting.get(r.id)}
                for r in sorted(self.replicas.values(), key=lambda r: (r.deployment, r.created_at_s))
            ],
        }

    def _save(self) -> None:
        """Hand the snapshot to the state sink. Never raises: the next save writes the whole
        state again (the sink may count and back off: `fleet.local.state.StateStore.save`)."""
        if self.state_sink is not None:
            try:
                self.state_sink.save(self.snapshot())
            except Exception as err:  # noqa: BLE001 - a state write that fails never stops the loop
                log.warning("cannot write state: %s", err)
