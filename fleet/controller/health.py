"""Health probes and warm-ups: when a started replica is healthy, warm, or failed.

Owns `HealthKeeper`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`:

- `probe` (the controller's `_probe_health` step): a replica the scheduler cannot place
  (``Replica.unschedulable``, its pod's ``PodScheduled`` False) fails (FAILED_START, with the
  scheduler's words) once ``engine.startupTimeoutSeconds`` has passed since launch; the
  controller replaces it as any replica that failed to start, and the deployment's placements
  avoid that node for as long again (`fleet.controller.targets.DeploymentRecord.refused_nodes`).
  STARTING replicas are probed
  every tick and fail (FAILED_START) once ``engine.startupTimeoutSeconds`` has passed since
  launch (or since the weights were on the node, whichever is later) without a passed
  ``/health``; the first
  passed probe records ``healthy_at_s`` and starts the warm-up. READY replicas are probed every
  ``ready_health_interval_s`` and fail (FAILED_UNHEALTHY) after ``unhealthy_threshold`` failed
  probes in a row.
- `start_warmup` (after the first passed probe; `fleet.controller.standby.StandbyKeeper` after a
  wake): `warmup.run.run_warmup` as a task, which wakes the controller when it ends.
- `collect_warmups` (the controller's `_collect_warmups` step): a WARMING replica whose warm-up
  passed the readiness gate (`warmup.run.readiness_gate`) records ``warmup_passed_at_s`` and
  resets its deployment's failures in a row; one that failed or crashed fails (FAILED_WARMUP).
- `cancel_warmup` (a replica failed, exited or drains) and `cancel_all` (the controller is dropped).

Failing a replica and backing off its replacement is the controller's (``fail``); ``wake`` runs
the next tick at once. Probes go through the injected `warmup.client.EngineAPI`; time comes from
the injected clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fleet.controller.launch import Fail
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.targets import FleetRecords
from fleet.spec import InferenceDeployment
from warmup.client import EngineAPI
from warmup.run import WarmupResult, readiness_gate, run_warmup


class HealthKeeper:
    """Probes the controller's replicas and runs their warm-ups (see the module docstring).

    ``health_timeout_s``: one probe's timeout; ``ready_health_interval_s``: how often a READY
    replica is probed; ``unhealthy_threshold``: failed probes in a row before FAILED_UNHEALTHY
    (`fleet.controller.reconcile.ControllerSettings`). ``warmups`` holds the running warm-up task
    of each replica id."""

    def __init__(self, records: FleetRecords, *, engine_api: EngineAPI, clock: Callable[[], float],
                 health_timeout_s: float, ready_health_interval_s: float, unhealthy_threshold: int,
                 fail: Fail, wake: Callable[[], None]) -> None:  # fmt: skip
        self.records = records
        self.engine_api = engine_api
        self.clock = clock
        self.health_timeout_s = health_timeout_s
        self.ready_health_interval_s = ready_health_interval_s
        self.unhealthy_threshold = unhealthy_threshold
        self._fail = fail
        self._wake = wake
        self.warmups: dict[str, asyncio.Task[WarmupResult]] = {}
        self._last_probe_s: dict[str, float] = {}

    def _deployment(self, r: Replica) -> InferenceDeployment:
        """The spec ``r`` was launched with (its revision's; the declared one once that is gone)."""
        ds = self.records.deployments[r.deployment]
        return ds.revs.specs.get(r.spec_hash, ds.loaded).deployment

    async def probe(self) -> None:
        """Probe STARTING replicas, and READY ones due a probe, in parallel (see the module docstring)."""
        now = self.clock()
        probes: list[Replica] = []
        for r in self.records.replicas.values():
            if not r.engine_alive or r.failure or r.stop_requested_at_s is not None:
                continue
            if r.unschedulable:
                self._unschedulable_deadline(r, now)
                continue
            if r.endpoint is None:
                continue
            status = r.status
            if status is ReplicaStatus.STARTING:
                timeout_s = self._deployment(r).spec.engine.startup_timeout_seconds
                since_s = max(r.launched_at_s, r.weights_ready_at_s or r.launched_at_s)
                if now - since_s > timeout_s:
                    self._fail(r, ReplicaStatus.FAILED_START, f"/health did not pass within {timeout_s:g} s of start",
                               [])  # fmt: skip
                    continue
                probes.append(r)
            elif status is ReplicaStatus.READY:
                if now - self._last_probe_s.get(r.id, float("-inf")) >= self.ready_health_interval_s:
                    probes.append(r)
        if not probes:
            return
        results = await asyncio.gather(
            *(self.engine_api.health(r.endpoint, self.health_timeout_s) for r in probes)
        )
        now = self.clock()
        for r, ok in zip(probes, results):
            self._last_probe_s[r.id] = now
            if r.status is ReplicaStatus.STARTING:
                if ok:
                    r.healthy_at_s = now
                    self.start_warmup(r)
            elif ok:
                r.consecutive_health_failures = 0
            else:
                r.consecutive_health_failures += 1
                if r.consecutive_health_failures >= self.unhealthy_threshold:
                    self._fail(r, ReplicaStatus.FAILED_UNHEALTHY,
                               f"/health failed {r.consecutive_health_failures} times in a row", [])  # fmt: skip

    def _unschedulable_deadline(self, r: Replica, now: float) -> None:
        """Fail ``r`` (FAILED_START) once the scheduler has refused it past its start deadline
        (``engine.startupTimeoutSeconds`` since launch): the controller places a replacement,
        which avoids ``r``'s node for as long again (`DeploymentRecord.refused_nodes`)."""
        timeout_s = self._deployment(r).spec.engine.startup_timeout_seconds
        if now - (r.launched_at_s or now) <= timeout_s:
            return
        self._fail(r, ReplicaStatus.FAILED_START, f"the scheduler could not place it on node {r.node or '?'} "
                   f"within {timeout_s:g} s of launch: {r.unschedulable}", [])  # fmt: skip
        if r.node and r.deployment in self.records.deployments:
            self.records.deployments[r.deployment].refused_nodes[r.node] = now + timeout_s

    def start_warmup(self, r: Replica) -> None:
        """Run ``r``'s warm-up (its spec's ``warmup``) as a task; its end wakes the controller."""
        dep = self._deployment(r)
        r.warmup_started_at_s = self.clock()
        task = asyncio.get_running_loop().create_task(
            run_warmup(self.engine_api, r.endpoint, dep.spec.model.name, dep.spec.warmup, self.clock),
            name=f"warmup-{r.id}",
        )
        task.add_done_callback(lambda _: self._wake())  # a passed replica joins the pool without waiting a tick
        self.warmups[r.id] = task

    async def collect_warmups(self) -> None:
        """Record the outcome of every warm-up that has ended (see the module docstring)."""
        now = self.clock()
        for rid, task in list(self.warmups.items()):
            if not task.done():
                continue
            del self.warmups[rid]
            r = self.records.replicas[rid]
            if task.cancelled() or r.status is not ReplicaStatus.WARMING:
                continue
            exc = task.exception()
            result = task.result() if exc is None else WarmupResult(False, 0, reason=f"warm-up crashed: {exc!r}")
            if readiness_gate(r.healthy_at_s is not None, result):
                r.warmup_passed_at_s = now
                self.records.deployments[r.deployment].failures_in_row = 0
            else:
                self._fail(r, ReplicaStatus.FAILED_WARMUP, result.reason or "warm-up failed", [])

    def cancel_warmup(self, rid: str) -> None:
        """Cancel replica ``rid``'s warm-up, if one runs."""
        task = self.warmups.pop(rid, None)
        if task is not None:
            task.cancel()

    def cancel_all(self) -> None:
        """Cancel every warm-up (the controller is being dropped)."""
        for rid in list(self.warmups):
            self.cancel_warmup(rid)
