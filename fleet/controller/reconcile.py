"""The controller: one reconcile loop converging the desired replicas of each deployment to
the observed ones, and picking up where a previous controller left off.

Owns `Controller`: the reconcile step that is the only place replicas are created, placed,
asked to run, warmed, admitted to the router, drained, stopped and replaced, over the records it
keeps (`fleet.controller.targets.FleetRecords`: per deployment the persisted target and the
bookkeeping around it, the replica records of `fleet.controller.lifecycle`), and `start`, which
hands the previous controller's state to `fleet.controller.restart.Adoption`. Also owned here:
its settings (`ControllerSettings`), the tick itself (`reconcile_once`, `run`, `shutdown`),
observing the backend, health probes, warm-ups, the scale step, failures with backoff, and the
snapshot it persists.

Collaborators (plain objects over the same records, each in its own module; none imports this
one): `fleet.controller.launch.Launcher` (placement and launch), `fleet.controller.drain.Drainer`
(replicas on sick devices drained, draining replicas stopped), `fleet.controller.pools.PoolPublisher`
(the router's pools), `fleet.controller.report.TransitionReport` (status transitions for
``on_event``, the history kept), `fleet.controller.preemption.Preemptor`,
`fleet.controller.model_memory.ModelMemory` and the rollout driver below.

Every side effect goes through an injected wrapper: `Backend` (runs replicas: local processes,
later pods; `fleet.controller.backend`), `EngineAPI` (engine HTTP), `PoolSink` (router admin API,
`fleet.controller.pools`), `StateSink` (the state file). Time comes from an injected clock (tests
run it on fake time). The clock must be the same across controller restarts on one machine
(`time.monotonic` is: Linux's CLOCK_MONOTONIC counts from boot), since recorded facts are in its
seconds.

Revisions: each deployment serves a stable revision and, during a canary rollout, a canary
(`fleet.rollout.revisions.Revisions`, persisted with the targets); replicas are wanted per
revision (`fleet.controller.scale.scale_step` decides each revision's step), and the rollout
driver (`fleet.controller.rollouts.RolloutDriver`, a collaborator) takes new specs (`apply`) and
drives rollouts.

Persistence: the whole state (target and replica records) is written atomically before each
batch of side effects (after new targets and replicas are decided, before the backend is asked
to run or stop replicas) and at the end of every tick. Called by `fleet up` and `fleet down`
(fleet.local.up) and by the Kubernetes operator (fleet.k8s.operator).
"""

from __future__ import annotations

import asyncio
import time
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.controller.backend import Backend, ReplicaFacts
from fleet.controller.drain import Drainer
from fleet.controller.launch import Launcher
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.model_memory import ModelMemory, Reader
from fleet.controller.pools import PoolPublisher, PoolSink
from fleet.controller.preemption import Preemptor
from fleet.controller.report import ReplicaEvent, TransitionReport
from fleet.controller.restart import Adoption
from fleet.controller.rollouts import RolloutDriver
from fleet.controller.scale import scale_step
from fleet.controller.standby import StandbyKeeper
from fleet.controller.targets import STATE_FORMAT, DeploymentRecord, FleetRecords
from fleet.inventory import Inventory
from fleet.placement import PlacementStrategy, ReplicaPlacement, get_strategy
from fleet.placement.preemption import DEFAULT_HOLD_OFF_S
from fleet.rollout.revisions import AnalysisSource
from fleet.spec import LoadedDeployment
from warmup.client import EngineAPI
from warmup.run import WarmupResult, readiness_gate, run_warmup

log = logging.getLogger("fleet.controller")

__all__ = ["Controller", "ControllerSettings", "PoolSink", "ReplicaEvent", "StateSink"]


class StateSink(Protocol):
    def save(self, snapshot: dict) -> None: ...


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
    canary rollout, the canary; replicas are wanted per revision (`Revisions.targets`). These
    collaborators work on the same records: the rollout driver (``self.rollouts``,
    `fleet.controller.rollouts.RolloutDriver`) and, once at `start`, the take-over from a previous
    controller (`fleet.controller.restart.Adoption`). ``memory_reader`` says what one replica of a
    spec needs per GPU (`fleet.controller.model_memory`; default: read from the model's files or
    the hub), which every placement request carries once known. Three steps of the tick are a
    collaborator's: placement and launch (``self.launcher``), drain and stop (``self.drainer``),
    pool publishing (``self.pools``); transitions and history are ``self.report``'s."""

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
        self._warmups: dict[str, asyncio.Task[WarmupResult]] = {}
        self._wake = asyncio.Event()
        self._waiting: dict[str, str] = {}          # replica id -> why it is still PENDING
        self._last_probe_s: dict[str, float] = {}
        self._facts: dict[str, ReplicaFacts] = {}
        self.tick_count = 0
        self._tick_deadline = float("inf")
        # The memory a replica of each spec needs, for placement (read once; hf:// in a thread).
        self.model_memory = ModelMemory(clock, memory_reader, on_known=self.wake)
        self.launcher = Launcher(self.records, backend=backend, placer=self.placer, preemption=self.preemption,
                                 model_memory=self.model_memory, waiting=self._waiting, clock=clock,
                                 save=self._save, fail=self._fail)  # fmt: skip
        self.drainer = Drainer(self.records, backend=backend, pool_sink=pool_sink,
                               drain_timeout_s=self.settings.drain_timeout_s, stop_grace_s=self.settings.stop_grace_s,
                               clock=clock, save=self._save, cancel_warmup=self._cancel_warmup)  # fmt: skip
        self.pools = PoolPublisher(self.records, pool_sink)
        self.standby = StandbyKeeper(self.records, engine_api=engine_api, pool_sink=pool_sink, clock=clock,
                                     drain_timeout_s=self.settings.drain_timeout_s, save=self._save,
                                     start_warmup=self._start_warmup, fail=self._fail, wake=self.wake)  # fmt: skip
        self.report = TransitionReport(self.records, self._waiting, self.settings.history_per_deployment)

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
        self.standby.cancel()
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
        self.pools.forget()

    def pools_published(self) -> bool:
        """Whether every deployment's pool has been written to the routers since the last
        `forget_published_pools`."""
        return self.pools.all_published()

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
            self._keep_standby,
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
            r.node, r.endpoint, r.detail, r.kv_events = f.node, f.endpoint, dict(f.detail), f.kv_events
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
        changed = self.drainer.drain_unhealthy(now, self.inventory, self._facts)
        for r in self.replicas.values():  # stopping, or deployments no longer declared: everything goes
            if ((self.stopping or r.deployment not in self.deployments)
                    and (r.status.counts_toward_desired() or r.status.standby())):
                r.drain_requested_at_s, changed = now, True
        order = list(ReplicaStatus)
        created = {rid: i for i, rid in enumerate(self.replicas)}  # insertion = creation order
        for name, ds in self.deployments.items():
            if self.stopping:
                break
            active = [r for r in self.records.of_deployment(name)
                      if r.status.counts_toward_desired() and not r.standby_refill]
            targets = ds.revs.targets(ds.desired)
            for h, want in targets.items():
                step = scale_step([r for r in active if r.spec_hash == h], want, lambda r: created[r.id],
                                  self._drain_preference)
                if step.create or step.drain:
                    step = self.standby.shape(ds, h, step, now)
                    changed = True
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
            refill = self.standby.refill_and_trim(ds, set(targets), ds.revs.stable, now)
            if refill and now >= ds.next_create_at_s:
                for _ in range(refill):
                    self._create_replica(ds, ds.revs.stable, now).standby_refill = True
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
        in_use = Counter(d for a in self.launcher.holding().values() for d in a.devices)
        in_use.update(d for p in placements for d in p.devices if not in_use[d])
        return [oldest_first[i] for i in self.placer.drain_order(placements, n, self.inventory, in_use)]

    def _create_replica(self, ds: DeploymentRecord, spec_hash: str, now: float) -> Replica:
        ld = ds.revs.specs[spec_hash]
        dep = ld.deployment
        rid = f"{dep.name}-{ds.next_index}"
        ds.next_index += 1
        r = self.replicas[rid] = Replica(id=rid, deployment=dep.name, revision=dep.spec.model.revision,
                                         created_at_s=now, spec_hash=spec_hash)  # fmt: skip
        return r

    def next_replica_warm(self, deployment: str) -> bool:
        """Whether one more replica of ``deployment``'s serving spec, placed now, would start warm:
        every node of its placement holds the image and the weights
        (`fleet.placement.shapes.PlacementRequest.is_warm`). False when it does not fit now (it
        waits for capacity: no warm start to count on). Read by the autoscaler for its start-up
        estimate (`autoscaler.startup.StartupEstimate.next_warm`). Pure over the last observed
        inventory."""
        return self.launcher.next_replica_warm(deployment, self.inventory)

    async def _place_and_launch(self) -> None:
        if await self.launcher.place_and_launch(self.inventory, self._tick_deadline):
            await self._observe()  # endpoints, image and weights of what just started, in this same tick

    async def _drain_and_stop(self) -> None:
        await self.drainer.drain_and_stop()

    async def _keep_standby(self) -> None:
        await self.standby.act()

    async def _publish_pools(self) -> None:
        await self.pools.publish(self._tick_deadline)

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
        for event in self.report.transitions(self.clock()):
            try:
                self.on_event(event)
            except Exception:  # noqa: BLE001 - a transition that cannot be shown (EPIPE, ENOSPC) is logged only
                log.exception("cannot report %s %s", event.replica_id, event.new.value)

    def _trim_history(self) -> None:
        self.report.trim_history()

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
            "standby": {name: self.standby.describe(ds) for name, ds in self.deployments.items()},
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
