"""`fleet operator`: run InferenceDeployments on Kubernetes through the same controller
`fleet up` runs, with the Kubernetes backend as its replica backend.

Owns `Operator` (informers on InferenceDeployments, this fleet's pods, nodes and router pods;
leader election; the loop; status, events, finalizers) and `OperatorSettings`; the process around
it (client, router fan-out, /healthz and /metrics, signals) is `fleet.k8s.operator_process`. The controller, the autoscaler loop and the
control-plane metrics are built by `fleet.control_plane.ControlPlane`, the assembly `fleet up`
uses too.

The Lease (`fleet.k8s.lease`) is renewed every ``retry_period_s`` on a thread of its own
(`LeaseKeeper`), so no tick delays a renewal; the operator acts only while `LeaderElector.holds`
(its last renewal is younger than the renew deadline, which is shorter than the lease), every
write it or its backend sends goes through `FencedKube` / `FencedPoolSink` (refused once the
deadline has passed, even in the middle of a tick), and the controller is dropped as soon as the
loop sees the deadline pass: two operators never act at once.

The loop, while this pod holds the Lease, every ``tick_s`` or at once when an informer reports a
change: (1) the declared deployments are read from the resources, each validated by
`fleet.spec.parse_document` once per generation (a refused one gets status InvalidSpec with the
very messages `fleet validate` prints; nothing of it starts); the first time, a
`fleet.controller.reconcile.Controller` starts from the snapshot rebuilt from the pods and
statuses (`fleet.k8s.status.snapshot_from_cluster`; `Controller.start` is the crash-safe
take-over: running replicas adopted, replicas of a changed spec drained and replaced); after
that, only what changed is handed to the running controller: a new resource is added
(`Controller.add_deployment`), an edited one updated (`Controller.apply`: a new revision rolls
out, other changes apply in place), a deleted one removed (`Controller.remove_deployment`: its
replicas drain through the router, then its pool goes). Two rare changes take the whole
hand-over instead (`Controller.start` from the running controller's snapshot): an edit of
``spec.model.name``, and a name declared again while its previous replicas still drain;
(2) `Controller.reconcile_once`, then the autoscaler (`fleet.controller.autoscaling.AutoscalerLoop`,
as in `fleet up`, on router statistics merged over the router pods); (3) what happened is written
back: pods that passed warm-up are annotated (so a later operator adopts them READY), Events per
replica transition, the status of each resource something happened to (a replica transition, a
scaling decision, a spec change; every resource's status is recomputed every
``STATUS_FULL_PASS_S``; a status is sent only when it changed), and a deleted resource's
finalizer is removed once its pods are gone (its replicas drain through the router first).
Level-triggered: each tick derives everything from the informers' caches, which are relisted
every ``resync_s``. The reconcile logic is the controller's; this module adds no policy.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autoscaler.policy import Direction
from fleet.control_plane import ControlPlane, ControlPlaneMetrics
from fleet.controller.autoscaling import AutoscalerLoop
from fleet.k8s.arrival_history import ConfigMapHistoryStore
from fleet.controller.reconcile import Controller, ControllerSettings, ReplicaEvent
from fleet.k8s.backend import KubernetesBackend
from fleet.k8s.client import EVENTS, INFERENCE_DEPLOYMENTS, NODES, PODS, ApiError, Kube
from fleet.k8s.informer import Informer
from fleet.k8s.lease import FencedKube, FencedPoolSink, LeaderElector, LeaseKeeper
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import ANNOTATION_READY_AT, LABEL_DEPLOYMENT
from fleet.k8s.status import decision_event, deployment_status, event_object, invalid_status, snapshot_from_cluster
from fleet.controller.lifecycle import ReplicaStatus
from fleet.spec import API_VERSION, KIND, LoadedDeployment, SpecError, parse_document

log = logging.getLogger("fleet.k8s.operator")

FINALIZER = "fleet.inference.dev/drain"
"""On every InferenceDeployment the operator runs: a deleted one stays until its replicas have
drained through the router and their pods are gone."""


@dataclass(frozen=True)
class ClusterDeployment(LoadedDeployment):
    """A deployment read from a resource (its serving hash, like every `LoadedDeployment`'s, is
    computed once: the controller reads it for every replica on every tick)."""


WRITE_CONCURRENCY = 16
STATUS_BUDGET_S = 1.0
"""Seconds a tick spends writing statuses; those left are written at the next tick."""
"""API writes in flight at once: statuses at the end of a tick; Events and ready annotations
beside the ticks (10,000 replicas created in one tick are 10,000 Events: no tick waits for them)."""

STATUS_FULL_PASS_S = 30.0
"""Seconds between two ticks that recompute every resource's status (the others recompute only
those of resources something happened to): a waiting replica's explanation may change without a
replica transition."""


async def _bounded(coros: list, limit: int) -> None:
    sem = asyncio.Semaphore(limit)

    async def one(coro) -> None:
        async with sem:
            await coro

    await asyncio.gather(*(one(c) for c in coros))


@dataclass(frozen=True)
class OperatorSettings:
    namespace: str | None = None
    router_admin_url: str = ""
    router_selector: str = "app.kubernetes.io/component=router"
    router_admin_port: int = 9090
    identity: str | None = None
    lease_name: str = "fleet-operator"
    lease_duration_s: float = 15.0
    renew_deadline_s: float | None = None   # None: two thirds of the lease (client-go: 10 s of 15)
    retry_period_s: float = 2.0             # between two acquire-or-renew rounds
    lease_thread: bool = True               # False: rounds run on the event loop (tests on the in-memory fake)
    resync_s: float = 300.0
    tick_s: float = 1.0
    engine_image: str = ""
    engine_pod_json: str = ""
    metrics_port: int = 8081
    fleet_id: str = ""
    prices: tuple[tuple[str, float], ...] = ()   # (GPU product, USD per GPU-hour): fleet_gpu_price_usd_per_hour
    service_account: str = ""   # the operator's own: owner of the arrival-history ConfigMap ("" for none)


class Operator:
    """One operator process; acts only while it holds the Lease (`LeaderElector.holds`)."""

    def __init__(self, kube: Kube, settings: OperatorSettings, *, namespace: str, identity: str, engine_api,
                 pool_sink, router_pods: Informer | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic,
                 controller_settings: ControllerSettings | None = None) -> None:  # fmt: skip
        self.settings = settings
        self.namespace = namespace
        self.identity = identity
        self.engine_api = engine_api
        self.elector = LeaderElector(kube, namespace, settings.lease_name, identity, clock=monotonic, wall=clock,
                                     lease_duration_s=settings.lease_duration_s,
                                     renew_deadline_s=settings.renew_deadline_s)  # fmt: skip
        self.kube = FencedKube(kube, self.elector.holds)            # every write: refused past the renew deadline
        self.pool_sink = FencedPoolSink(pool_sink, self.elector.holds)
        self.clock = clock
        self.monotonic = monotonic
        self.wake = asyncio.Event()
        self.spec_changed = asyncio.Event()   # an InferenceDeployment changed: skip the gap between ticks
        on_change = self._on_change
        fleet_id = settings.fleet_id or namespace
        pod_settings = EnginePodSettings.from_json(settings.engine_pod_json, default_image=settings.engine_image)
        self.crs = Informer(kube, INFERENCE_DEPLOYMENTS, namespace, resync_s=settings.resync_s,
                            on_change=self._on_spec_change)  # fmt: skip
        self.backend = KubernetesBackend(self.kube, namespace, fleet_id, settings=pod_settings, clock=clock,
                                         owner_of=lambda name: self.crs.get(name, namespace))  # fmt: skip
        self.pods = Informer(kube, PODS, namespace, self.backend.selector, resync_s=settings.resync_s,
                             on_change=on_change)  # fmt: skip
        self.nodes = Informer(kube, NODES, None, resync_s=settings.resync_s, on_change=on_change)
        self.router_pods = router_pods
        self.backend.pods, self.backend.nodes = self.pods, self.nodes
        self.controller: Controller | None = None
        self._declared: dict[str, str] = {}            # name -> spec JSON the controller runs
        self._statuses: dict[str, dict] = {}           # name -> status last written
        self._observed: dict[str, int] = {}            # name -> generation an event was sent for
        self._events: list[ReplicaEvent] = []
        self._decisions: list[tuple[str, object]] = []
        self.autoscaler: AutoscalerLoop | None = None
        # The controller and autoscaler, built as `fleet up` builds them (fleet/control_plane.py); the
        # metrics (fleet_autoscaler_*, fleet_replicas etc.) outlive each controller.
        self.plane = ControlPlane(
            backend=self.backend, engine_api=engine_api, pool_sink=self.pool_sink, clock=clock, wall_clock=clock,
            analysis_source=self.pool_sink if hasattr(self.pool_sink, "revision_samples") else None,
            stats_source=self.pool_sink if hasattr(self.pool_sink, "stats") else None,
            settings=controller_settings, metrics=ControlPlaneMetrics(dict(settings.prices)),
            history=ConfigMapHistoryStore(kube, namespace, f"{settings.lease_name}-arrival-history",
                                          settings.service_account),
            on_event=self._events.append, on_decision=self._on_decision)  # fmt: skip
        self._parsed: dict[str, tuple] = {}            # name -> (generation key, ClusterDeployment, spec JSON)
        self._finalizing: dict[str, str] = {}          # name -> uid our finalizer was added to
        self._dirty: set[str] = set()                  # deployments whose status to recompute this tick
        self._full_status_at_s: float | None = None    # clock() of the last full status pass (None: due)
        self._write_slots = asyncio.Semaphore(WRITE_CONCURRENCY)
        self._sending: set[asyncio.Task] = set()       # Events and annotations sent beside the ticks
        self.ticks = 0
        self.last_tick_s = 0.0
        self.longest_tick_s = 0.0
        self.longest_loop_stall_s = 0.0               # the event loop's longest delay of a 0.1 s timer

    def _on_decision(self, deployment: str, decision) -> None:
        """A scaling decision (`fleet.controller.autoscaling.AutoscalerLoop`): an Event when it changes the size."""
        if decision.direction is not Direction.HOLD:
            self._decisions.append((deployment, decision))

    def _on_change(self, type_: str, obj: dict) -> None:
        self.wake.set()

    def _on_spec_change(self, type_: str, obj: dict) -> None:
        self.spec_changed.set()
        self.wake.set()

    def informers(self) -> list[Informer]:
        return [i for i in (self.crs, self.pods, self.nodes, self.router_pods) if i is not None]

    # ----- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: hold or wait for the Lease; while held, reconcile every tick. Pods
        outlive the operator: stopping it stops nothing but its own loop (and gives the Lease up)."""
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(i.run(stop), name=f"informer-{i.name}") for i in self.informers()]
        tasks.append(loop.create_task(self._watch_loop_stalls(stop), name="loop-stalls"))
        keeper = None
        if self.settings.lease_thread:
            keeper = LeaseKeeper(self.elector, self.settings.retry_period_s,
                                 on_change=lambda: loop.call_soon_threadsafe(self.wake.set))  # fmt: skip
            keeper.start()
        else:
            tasks.append(loop.create_task(self._keep_lease(stop), name="lease"))
        try:
            while not stop.is_set():
                self.wake.clear()           # a change seen during the step wakes the next one
                self.spec_changed.clear()
                await self.step()
                # The loop's own time: a tick holds the loop between its awaits, and watch events
                # arrive between ticks; without a gap, a burst wakes tick after tick and the
                # informers fall behind (one event handled per tick). A changed InferenceDeployment
                # cuts the gap short: it is what a user waits for.
                try:
                    await asyncio.wait_for(self.spec_changed.wait(), timeout=min(1.0, max(0.05, self.last_tick_s / 2)))
                except asyncio.TimeoutError:
                    pass
                try:
                    await asyncio.wait_for(self.wake.wait(), timeout=self.settings.tick_s)
                except asyncio.TimeoutError:
                    pass
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.autoscaler is not None and self.elector.holds():
                await self.autoscaler.save_history()   # the next leader's forecast starts where this one was
            self._drop_controller()
            if keeper is not None:
                await asyncio.to_thread(keeper.stop)   # and gives the Lease up
            else:
                await self.elector.release()

    async def step(self) -> None:
        """One pass of the loop: act (one tick) while the Lease is held, and drop the controller
        as soon as it may not be (the renew deadline passed, also during the tick)."""
        if not self.elector.holds():
            if self.controller is not None:
                log.warning("%s: the lease's renew deadline passed: no longer acting", self.identity)
                self._drop_controller()
                self._statuses.clear()   # another operator may write them meanwhile: compare afresh
            return
        if not all(i.synced.is_set() for i in self.informers()):
            return
        await self.tick()
        if self.last_tick_s > self.elector.renew_deadline_s:
            log.warning("a reconcile tick took %.1f s, longer than the renew deadline (%.0f s)", self.last_tick_s,
                        self.elector.renew_deadline_s)  # fmt: skip
        if not self.elector.holds() and self.controller is not None:
            log.warning("%s: the lease's renew deadline passed during a tick: no longer acting", self.identity)
            self._drop_controller()
            self._statuses.clear()

    async def _watch_loop_stalls(self, stop: asyncio.Event, every_s: float = 0.1) -> None:
        """Measure how long the event loop is held: the longest delay of a ``every_s`` timer
        (``longest_loop_stall_s``, exported on /metrics)."""
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            started = loop.time()
            await asyncio.sleep(every_s)
            self.longest_loop_stall_s = max(self.longest_loop_stall_s, loop.time() - started - every_s)

    async def _keep_lease(self, stop: asyncio.Event) -> None:
        """Acquire or renew the Lease every ``retry_period_s`` on the event loop (the operator's
        tests on the in-memory fake; a process uses `LeaseKeeper`'s thread)."""
        every_s = self.settings.retry_period_s
        while not stop.is_set():
            was = self.elector.is_leader
            if await self.elector.try_acquire_or_renew() and not was:
                self.wake.set()
            try:
                await asyncio.wait_for(stop.wait(), timeout=every_s)
            except asyncio.TimeoutError:
                pass

    async def tick(self) -> None:
        """One reconcile of everything (the caller holds the Lease)."""
        started = time.perf_counter()
        await self._sync_deployments()
        fresh = self.pool_sink.new_routers() if hasattr(self.pool_sink, "new_routers") else []
        if fresh and self.controller is not None:
            self.controller.forget_published_pools()   # a new or restarted router knows no pool
        if self.controller is not None:
            await self.controller.reconcile_once()
            if fresh and self.controller.pools_published():
                await self.pool_sink.mark_synced(fresh)
            elif fresh:
                self.pool_sink.forget(fresh)   # not all published: named again next tick
            if self.autoscaler is not None:
                try:
                    await self.autoscaler.step()   # each deployment's policy decides when it is due
                except Exception:  # noqa: BLE001 - a failed decision never stops the reconcile
                    log.exception("autoscaler step failed")
            await self._write_back()
        self.ticks += 1
        self.last_tick_s = time.perf_counter() - started
        self.longest_tick_s = max(self.longest_tick_s, self.last_tick_s)

    def _drop_controller(self) -> None:
        self.autoscaler = None
        if self.controller is not None:
            self.controller.abandon()
        self.controller = None
        self._declared = {}
        self._full_status_at_s = None

    # ----- declared deployments -> controller -------------------------------------------------

    async def _sync_deployments(self) -> None:
        crs = sorted(self.crs.objects.values(), key=lambda o: o["metadata"]["name"])
        loaded: dict[str, ClusterDeployment] = {}
        declared: dict[str, str] = {}
        models: dict[str, str] = {}
        now = self.clock()
        for cr in crs:
            meta = cr["metadata"]
            name = meta["name"]
            if meta.get("deletionTimestamp"):
                continue     # being deleted: not declared any more, drained by the controller
            generation = int(meta.get("generation") or 1)
            try:
                ld = self._parse(cr)
                model = ld.deployment.spec.model.name
                if model in models:
                    raise SpecError([f"spec.model.name: {model!r} is already served by InferenceDeployment "
                                     f"{models[model]!r}; one deployment per model name"])  # fmt: skip
            except SpecError as err:
                await self._refuse(cr, generation, err.problems, now)
                continue
            models[model] = name
            if FINALIZER not in (meta.get("finalizers") or []) and self._finalizing.get(name) != meta.get("uid"):
                self._finalizing[name] = meta.get("uid")   # sent once: the informer may not show it yet
                await self._patch_cr(name, {"metadata": {"finalizers": [*(meta.get("finalizers") or []), FINALIZER]}})
            loaded[name] = ld
            declared[name] = self._parsed[name][2]
            if self._observed.get(name) != generation:
                self._observed[name] = generation
                self._dirty.add(name)   # observedGeneration
                await self._event(decision_event(cr, "SpecAccepted", f"generation {generation} accepted: model "
                                                 f"{model!r}, {ld.deployment.spec.engine.kind}", self.identity, now))  # fmt: skip
        if self.controller is not None and declared == self._declared:
            return
        self.backend.set_pre_pull(ld.deployment for ld in loaded.values())   # spec.prePull: selector-wide pre-pulls
        if self.controller is not None and self._apply_changes(loaded, declared):
            return
        previous = self.controller.snapshot() if self.controller is not None else \
            snapshot_from_cluster(crs, list(self.pods.objects.values()))  # fmt: skip
        self._drop_controller()
        controller = self.plane.controller(list(loaded.values()))
        await controller.start(previous)
        for ld in loaded.values():
            self._declared_replicas(controller, ld)
        self.controller, self._declared = controller, declared
        self.autoscaler = self.plane.autoscaler(controller)
        adopted = sum(1 for r in controller.replicas.values() if r.adopted_at_s is not None and r.engine_alive)
        log.info("running %d deployment(s); %d running replica(s) adopted", len(loaded), adopted)

    def _apply_changes(self, loaded: dict[str, ClusterDeployment], declared: dict[str, str]) -> bool:
        """Hand the running controller what changed since the last tick: resources added, edited
        and removed, one deployment each. False (nothing done) when a change needs the whole
        hand-over: an edited ``spec.model.name``, or a name declared again while replicas of its
        previous declaration still drain."""
        c = self.controller
        assert c is not None
        added = [n for n in declared if n not in self._declared]
        removed = [n for n in self._declared if n not in declared]
        changed = [n for n in declared if n in self._declared and declared[n] != self._declared[n]]
        if any(c.retiring(n) for n in added) or \
                any(loaded[n].deployment.spec.model.name != c.deployments[n].model for n in changed):
            return False
        for name in removed:
            c.remove_deployment(name)
        for name in added:
            c.add_deployment(loaded[name])
        if changed:
            for line in c.apply([loaded[n] for n in changed]):
                log.info("%s", line)
        for name in (*added, *changed):
            self._declared_replicas(c, loaded[name])
        touched = {*added, *changed, *removed}
        self._dirty |= touched
        self._declared = declared
        if self.autoscaler is not None and any(n in self.autoscaler.scaled for n in touched) or \
                any(loaded[n].deployment.spec.autoscaling is not None for n in (*added, *changed)):
            self.autoscaler = self.plane.autoscaler(c, replacing=self.autoscaler, changed=touched)
        log.info("deployments: %d added, %d updated, %d removed (%d running)", len(added), len(changed),
                 len(removed), len(c.deployments))  # fmt: skip
        return True

    def _declared_replicas(self, controller: Controller, ld: ClusterDeployment) -> None:
        """Without autoscaling the resource's spec.replicas is the target, also when it was edited
        while no operator ran (`fleet up` restores the recorded target instead)."""
        spec = ld.deployment.spec
        if spec.autoscaling is None and controller.deployments[ld.deployment.name].desired != \
                spec.replicas.desired_at_start:
            controller.set_desired(ld.deployment.name, spec.replicas.desired_at_start, "spec.replicas")

    def _parse(self, cr: dict) -> ClusterDeployment:
        """`fleet.spec.parse_document` of a resource, cached by generation and labels (a tick
        with 1,000 resources does not validate 1,000 documents again, nor serialise their specs).
        Raises SpecError."""
        meta = cr["metadata"]
        key = (meta.get("generation"), tuple(sorted((meta.get("labels") or {}).items())), meta.get("uid"))
        cached = self._parsed.get(meta["name"])
        if cached is not None and cached[0] == key:
            return cached[1]
        doc = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": meta["name"], "labels": meta.get("labels")
               or {}}, "spec": cr.get("spec")}  # fmt: skip
        dep = parse_document(doc, "")
        ld = ClusterDeployment(dep, Path(f"/kubernetes/{self.namespace}/{meta['name']}.yaml"), 0)
        self._parsed[meta["name"]] = (key, ld, json.dumps(dep.spec.to_document(), sort_keys=True))
        return ld

    async def _refuse(self, cr: dict, generation: int, problems: list[str], now: float) -> None:
        name = cr["metadata"]["name"]
        status = invalid_status(generation, problems, cr.get("status"), now)
        if self._observed.get(name) != generation:
            self._observed[name] = generation
            await self._event(decision_event(cr, "InvalidSpec", "; ".join(problems)[:1000], self.identity, now, True))
        await self._write_status(name, status)

    # ----- write back -------------------------------------------------------------------------

    async def _write_back(self) -> None:
        c = self.controller
        now = self.clock()
        events = list(self._events)   # the controller appends to this very list (on_event)
        self._events.clear()
        dirty, self._dirty = self._dirty, set()
        for e in events:
            dirty.add(e.deployment)
            r = c.replicas.get(e.replica_id)
            if e.new is ReplicaStatus.READY and r is not None and r.warmup_passed_at_s is not None:
                self._send_later(self._annotate_ready(e.replica_id, r.warmup_passed_at_s))
            owner = self.crs.get(e.deployment, self.namespace)
            if owner is not None:
                self._send_later(self._event(event_object(e, owner, self.identity, now)))
        decisions = list(self._decisions)
        self._decisions.clear()
        for name, d in decisions:
            dirty.add(name)
            owner = self.crs.get(name, self.namespace)
            if owner is not None:
                reason = "ScaleUp" if d.direction is Direction.UP else "ScaleDown"
                self._send_later(self._event(decision_event(owner, reason, f"{d.previous} -> {d.desired} replica(s): "
                                                         f"{d.reason}: {d.detail}", self.identity, now)))  # fmt: skip
        if self._full_status_at_s is None or now - self._full_status_at_s >= STATUS_FULL_PASS_S:
            dirty = set(c.deployments)      # every status, now and then (and after a start)
            self._full_status_at_s = now
        names = sorted(dirty)
        deadline = time.monotonic() + STATUS_BUDGET_S
        for at in range(0, len(names), WRITE_CONCURRENCY * 4):
            if at and time.monotonic() > deadline:   # 1,000 statuses at once: the rest at the next tick
                self._dirty.update(names[at:])
                break
            writes = []
            for name in names[at: at + WRITE_CONCURRENCY * 4]:
                if name not in c.deployments:
                    continue
                cr = self.crs.get(name, self.namespace)
                if cr is None:
                    continue
                generation = int(cr["metadata"].get("generation") or 1)
                status = deployment_status(c, name, generation, self._statuses.get(name) or cr.get("status"), now,
                                           c.records.of_deployment(name))  # fmt: skip
                writes.append(self._write_status(name, status))
            await _bounded(writes, WRITE_CONCURRENCY)
        deleting = [cr for cr in self.crs.objects.values() if cr["metadata"].get("deletionTimestamp")
                    and FINALIZER in (cr["metadata"].get("finalizers") or [])]  # fmt: skip
        if not deleting:
            return
        live_by_deployment = {p["metadata"].get("labels", {}).get(LABEL_DEPLOYMENT) for p in self.pods.objects.values()}
        for cr in deleting:
            meta = cr["metadata"]
            name = meta["name"]
            alive = any(r.engine_alive for r in c.records.of_deployment(name))
            if not alive and name not in live_by_deployment and not c.retiring(name):
                rest = [f for f in meta["finalizers"] if f != FINALIZER]
                await self._patch_cr(name, {"metadata": {"finalizers": rest or None,
                                                         "resourceVersion": meta["resourceVersion"]}})
                self._statuses.pop(name, None)
                self._observed.pop(name, None)
                self._finalizing.pop(name, None)

    def _send_later(self, write) -> None:
        """Send ``write`` (a coroutine that logs its own failure) beside the ticks, at most
        ``WRITE_CONCURRENCY`` at once with the others."""
        async def one() -> None:
            async with self._write_slots:
                await write

        task = asyncio.get_running_loop().create_task(one())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def drain_writes(self) -> None:
        """Wait for the Events and annotations in flight (tests, benchmarks)."""
        while self._sending:
            await asyncio.gather(*list(self._sending), return_exceptions=True)

    async def _annotate_ready(self, pod: str, ready_at_s: float) -> None:
        try:
            await self.kube.patch(PODS, self.namespace, pod, {"metadata": {"annotations": {
                ANNOTATION_READY_AT: f"{ready_at_s:.3f}"}}})
        except ApiError as err:
            log.warning("cannot annotate pod %s: %s", pod, err)

    async def _write_status(self, name: str, status: dict) -> None:
        if self._statuses.get(name) == status:
            return
        cr = self.crs.get(name, self.namespace)
        before = self._statuses.get(name) or (cr or {}).get("status") or {}
        patch = dict(status)
        for key in ("replicas", "revisions"):   # a merge patch keeps map keys unless they are nulled
            gone = set(before.get(key) or {}) - set(status.get(key) or {})
            if gone:
                patch[key] = {**(status.get(key) or {}), **{k: None for k in gone}}
        for key in set(before) - set(status):
            patch[key] = None
        try:
            await self.kube.patch_status(INFERENCE_DEPLOYMENTS, self.namespace, name, {"status": patch})
            self._statuses[name] = status
        except ApiError as err:
            log.warning("cannot write the status of %s: %s", name, err)

    async def _patch_cr(self, name: str, patch: dict) -> None:
        try:
            await self.kube.patch(INFERENCE_DEPLOYMENTS, self.namespace, name, patch)
        except ApiError as err:
            log.warning("cannot patch InferenceDeployment %s: %s", name, err)

    async def _event(self, body: dict) -> None:
        try:
            await self.kube.create(EVENTS, self.namespace, body)
        except ApiError as err:
            log.debug("event not recorded: %s", err)
