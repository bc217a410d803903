"""The controller: one reconcile loop converging the desired replicas of each deployment to
the observed ones, and picking up where a previous controller left off.

Owns `Controller`: the reconcile step that is the only place replicas are created, placed,
asked to run, warmed, admitted to the router, drained, stopped and replaced, over the records it
keeps (`fleet.controller.targets.FleetRecords`: per deployment the persisted target and the
bookkeeping around it, the replica records of `fleet.controller.lifecycle`), and `start`, which
hands the previous controller's state to `fleet.controller.restart.Adoption`. Also owned here:
its settings (`ControllerSettings`), the tick itself (`reconcile_once` and its steps, `run`,
`shutdown`), failures with backoff (`_fail`), and the snapshot it persists.

Collaborators (plain objects over the same records, each in its own module; none imports this
one): `fleet.controller.observe.FactRecorder` (the backend's facts into the records),
`fleet.controller.health.HealthKeeper` (health probes and warm-ups),
`fleet.controller.resize.Resizer` (the scale step: replicas created and drained toward the
targets), `fleet.controller.launch.Launcher` (placement and launch), `fleet.controller.drain.Drainer`
(replicas on sick devices drained, draining replicas stopped), `fleet.controller.pools.PoolPublisher`
(the router's pools), `fleet.controller.standby.StandbyKeeper` (sleeping standby replicas),
`fleet.controller.report.TransitionReport` (status transitions for ``on_event``, the history
kept), `fleet.controller.preemption.Preemptor`, `fleet.controller.model_memory.ModelMemory` and
the rollout driver below.

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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.controller.backend import Backend, ReplicaFacts
from fleet.controller.drain import Drainer
from fleet.controller.health import HealthKeeper
from fleet.controller.launch import Launcher
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.model_memory import ModelMemory, Reader
from fleet.controller.observe import FactRecorder
from fleet.controller.pools import PoolPublisher, PoolSink
from fleet.controller.preemption import Preemptor
from fleet.controller.report import ReplicaEvent, TransitionReport
from fleet.controller.resize import Resizer
from fleet.controller.restart import Adoption
from fleet.controller.rollouts import RolloutDriver
from fleet.controller.standby import StandbyKeeper
from fleet.controller.targets import STATE_FORMAT, DeploymentRecord, FleetRecords
from fleet.inventory import Inventory
from fleet.placement import PlacementStrategy, get_strategy
from fleet.placement.preemption import DEFAULT_HOLD_OFF_S
from fleet.rollout.revisions import AnalysisSource
from fleet.spec import LoadedDeployment
from warmup.client import EngineAPI

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
    the hub), which every placement request carries once known. The tick's steps are the
    collaborators' work: recording the backend's facts (``self.fact_recorder``), health probes and
    warm-ups (``self.health``), the scale step (``self.resizer``), placement and launch
    (``self.launcher``), drain and stop (``self.drainer``), standby replicas (``self.standby``),
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
        self._wake = asyncio.Event()
        self._waiting: dict[str, str] = {}          # replica id -> why it is still PENDING
        self._facts: dict[str, ReplicaFacts] = {}
        self.tick_count = 0
        self._tick_deadline = float("inf")
        # The memory a replica of each spec needs, for placement (read once; hf:// in a thread).
        self.model_memory = ModelMemory(clock, memory_reader, on_known=self.wake)
        self.health = HealthKeeper(self.records, engine_api=engine_api, clock=clock,
                                   health_timeout_s=self.settings.health_timeout_s,
                                   ready_health_interval_s=self.settings.ready_health_interval_s,
                                   unhealthy_threshold=self.settings.unhealthy_threshold, fail=self._fail,
                                   wake=self.wake)  # fmt: skip
        self.launcher = Launcher(self.records, backend=backend, placer=self.placer, preemption=self.preemption,
                                 model_memory=self.model_memory, waiting=self._waiting, clock=clock,
                                 save=self._save, fail=self._fail)  # fmt: skip
        self.drainer = Drainer(self.records, backend=backend, pool_sink=pool_sink,
                               drain_timeout_s=self.settings.drain_timeout_s, stop_grace_s=self.settings.stop_grace_s,
                               clock=clock, save=self._save, cancel_warmup=self.health.cancel_warmup)  # fmt: skip
        self.fact_recorder = FactRecorder(self.records, backend=backend, log_tail_lines=self.settings.log_tail_lines,
                                          fail=self._fail, cancel_warmup=self.health.cancel_warmup)  # fmt: skip
        self.pools = PoolPublisher(self.records, pool_sink)
        self.standby = StandbyKeeper(self.records, engine_api=engine_api, pool_sink=pool_sink, clock=clock,
                                     drain_timeout_s=self.settings.drain_timeout_s, save=self._save,
                                     start_warmup=self.health.start_warmup, fail=self._fail,
                                     wake=self.wake)  # fmt: skip
        self.resizer = Resizer(self.records, drainer=self.drainer, standby=self.standby, launcher=self.launcher,
                               placer=self.placer)
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
        self.health.cancel_all()
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
            except Exception:  # noqa: BLE001 - the loop survives its parts
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
        for task in self.health.warmups.values():
            task.cancel()
        await self.reconcile_once()

    # ----- steps --------------------------------------------------------------------------

    async def _observe(self) -> None:
        now = self.clock()
        self.inventory = await self.backend.inventory()
        self._facts = await self.backend.observe()
        await self.fact_recorder.record(self._facts, now)

    async def _probe_health(self) -> None:
        await self.health.probe()

    async def _collect_warmups(self) -> None:
        await self.health.collect_warmups()

    async def _step_rollouts(self) -> None:
        if await self.rollouts.step():
            self._save()   # decided: persisted before the scale step acts on the new weights

    async def _scale(self) -> None:
        if self.resizer.step(self.clock(), self.inventory, self._facts):
            self._save()  # decided: persisted before anything acts on it

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

    def _fail(self, r: Replica, status: ReplicaStatus, reason: str, log_tail: list[str] | None = None) -> None:
        if r.failure is not None:
            return
        now = self.clock()
        r.fail(status, reason, now, log_tail or [])
        self.health.cancel_warmup(r.id)
        ds = self.deployments.get(r.deployment)
        if ds is None:
            return
        ds.failures_in_row += 1
        ds.failures_total[r.revision] = ds.failures_total.get(r.revision, 0) + 1
        delay_s = min(self.settings.backoff_base_s * 2 ** (ds.failures_in_row - 1), self.settings.backoff_max_s)
        ds.next_create_at_s = now + delay_s
        log.warning("replica %s %s: %s (replacement in %.0f s)", r.id, status.value, reason, delay_s)

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
