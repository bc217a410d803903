"""The controller's start: read the previous controller's state back and adopt what still runs.

Owns `Adoption`, a collaborator of `fleet.controller.reconcile.Controller` that takes over from
the controller that wrote the last snapshot (`fleet.controller.reconcile.Controller.snapshot`,
format `STATE_FORMAT`): targets restored, replicas still running with today's serving hash
adopted without a restart, the rest marked exited, drained or stopped (`take_over` says which).
It works on the controller's `FleetRecords` and its `Backend`; the controller calls it once from
`Controller.start` (run by `fleet.local.up` and the Kubernetes operator, `fleet.k8s.operator`)
before the first reconcile tick, and persists the result. Crash points are tested in
tests/unit/test_controller_restart.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fleet.controller.backend import Backend, ReplicaFacts
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.targets import STATE_FORMAT, DeploymentRecord, FleetRecords
from fleet.spec import LoadedDeployment

log = logging.getLogger("fleet.controller")

Declare = Callable[[DeploymentRecord, LoadedDeployment, float], list[str]]
"""Today's spec declared against a deployment's restored revisions (may start a rollout):
`fleet.controller.rollouts.RolloutDriver.declare`."""


class Adoption:
    """Takes over ``records`` from the controller that wrote a snapshot, asking ``backend`` what
    still runs (``facts``: `Backend.observe`, read by the caller just before)."""

    def __init__(self, records: FleetRecords, backend: Backend, facts: Mapping[str, ReplicaFacts]) -> None:
        self.records = records
        self.backend = backend
        self.facts = facts

    async def take_over(self, previous: dict | None, now_s: float, declare: Declare) -> None:
        """Take over from the controller that wrote ``previous`` (a snapshot; None: fresh start).

        Targets of deployments still declared are restored (clamped to today's min..max).
        Replicas recorded as running that the backend still runs, with today's serving hash,
        are adopted as they are: no restart, READY ones stay in the pool; a replica that was
        warming warms again. Recorded replicas that are gone are marked exited (FAILED_CRASHED
        unless a stop had been asked); running replicas of a changed spec are drained and
        replaced; those of deployments no longer declared are stopped and their pools deleted;
        replicas the backend owns but no record names cannot be verified and are stopped.
        """
        readable = bool(previous) and previous.get("format") == STATE_FORMAT
        if readable:
            self._restore_targets(previous.get("deployments", {}))
        for ds in self.records.deployments.values():   # today's files against what was served: a rollout may start
            declare(ds, ds.loaded, now_s)
        if readable:
            for rd in previous.get("replicas", []):
                try:
                    r = Replica.from_dict(rd)
                except (KeyError, TypeError, ValueError) as err:
                    log.warning("ignoring an unreadable replica record %r: %s", rd.get("id"), err)
                    continue
                self._adopt(r, now_s)
        elif previous:
            log.warning("previous state has format %r, not %r: starting fresh", previous.get("format"), STATE_FORMAT)
        replicas = self.records.replicas
        for rid, f in self.facts.items():
            if rid not in replicas and f.running:  # owned, but nothing says what it is
                replicas[rid] = Replica(id=rid, deployment=f.deployment, revision="?", created_at_s=now_s,
                                        spec_hash=f.spec_hash, launched_at_s=now_s, drain_requested_at_s=now_s,
                                        stop_requested_at_s=now_s, node=f.node, detail=dict(f.detail))  # fmt: skip
                log.warning("replica %s runs but no record names it: stopping it", rid)
                await self.backend.stop(rid)

    def _restore_targets(self, deployments: dict) -> None:
        records = self.records
        for name, d in deployments.items():
            ds = records.deployments.get(name)
            if ds is None:
                if d.get("model"):
                    records.retired[name] = d["model"]
                continue
            try:
                ds.restore(d)
            except (KeyError, TypeError, ValueError) as err:
                log.warning("deployment %s: unreadable revisions record, serving today's spec: %s", name, err)
        declared = {ds.model for ds in records.deployments.values()}
        records.retired = {name: model for name, model in records.retired.items() if model not in declared}

    def _adopt(self, r: Replica, now: float) -> None:
        self.records.replicas[r.id] = r
        ds = self.records.deployments.get(r.deployment)
        if r.status.terminal():
            return
        f = self.facts.get(r.id)
        if ds is None and (r.launched_at_s is None or f is None):
            r.exited_at_s = now    # not declared any more, and nothing runs: done
            return
        if r.launched_at_s is not None and f is None and r.stop_requested_at_s is None:
            r.launched_at_s = None  # asked to run, but the crash came first: ask again (PLACED)
        if r.launched_at_s is None:
            return
        if f is None or f.exited:
            r.exited_at_s, r.exit_code = now, f.exit_code if f else None
            if r.stop_requested_at_s is None and r.drain_requested_at_s is None:
                r.fail(ReplicaStatus.FAILED_CRASHED, "engine exited while no controller was running", now)
            return
        r.node, r.endpoint, r.detail, r.kv_events = f.node, f.endpoint, dict(f.detail), f.kv_events
        r.adopted_at_s = now
        if ds is None:
            r.drain_requested_at_s = r.drain_requested_at_s or now   # not declared any more
            return
        r.consecutive_health_failures = 0
        if r.spec_hash not in (ds.revs.stable, ds.revs.canary):
            r.drain_requested_at_s = r.drain_requested_at_s or now
        elif r.status is ReplicaStatus.WARMING:
            r.healthy_at_s = None   # its warm-up died with the old controller: probe, then warm again
