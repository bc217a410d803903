"""The controller's start: read the previous controller's state back and adopt what still runs.

Owns `RestartSteps`, the part of `fleet.controller.reconcile.Controller` that takes over from the
controller that wrote the last snapshot (`fleet.controller.reconcile.Controller.snapshot`, format
`STATE_FORMAT`): targets restored, replicas still running with today's serving hash adopted
without a restart, the rest marked exited, drained or stopped (the `start` docstring says which).
Called once by `fleet.local.up` and the Kubernetes operator (`fleet.k8s.operator`) before the first
reconcile tick. Crash points are tested in tests/unit/test_controller_restart.py.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fleet.controller.lifecycle import Replica, ReplicaStatus

if TYPE_CHECKING:
    from fleet.controller.reconcile import Controller

log = logging.getLogger("fleet.controller")

STATE_FORMAT = 2
"""Version of the snapshot layout (`Controller.snapshot`); a snapshot of another version is not read back."""


class RestartSteps:
    """Mixed into `fleet.controller.reconcile.Controller` (uses its backend, replicas, deployments, clock, save)."""

    async def start(self: Controller, previous: dict | None) -> None:
        """Take over from the controller that wrote ``previous`` (a `snapshot`; None: fresh start).

        Targets of deployments still declared are restored (clamped to today's min..max).
        Replicas recorded as running that the backend still runs, with today's serving hash,
        are adopted as they are: no restart, READY ones stay in the pool; a replica that was
        warming warms again. Recorded replicas that are gone are marked exited (FAILED_CRASHED
        unless a stop had been asked); running replicas of a changed spec are drained and
        replaced; those of deployments no longer declared are stopped and their pools deleted;
        replicas the backend owns but no record names cannot be verified and are stopped.
        """
        now = self.clock()
        self.inventory = await self.backend.inventory()
        self._facts = await self.backend.observe()
        if previous and previous.get("format") == STATE_FORMAT:
            self._restore_targets(previous.get("deployments", {}))
        for ds in self.deployments.values():   # today's files against what was served: a rollout may start
            self._declare(ds, ds.loaded, now)
        if previous and previous.get("format") == STATE_FORMAT:
            for rd in previous.get("replicas", []):
                try:
                    r = Replica.from_dict(rd)
                except (KeyError, TypeError, ValueError) as err:
                    log.warning("ignoring an unreadable replica record %r: %s", rd.get("id"), err)
                    continue
                self._adopt(r, now)
        elif previous:
            log.warning("previous state has format %r, not %r: starting fresh", previous.get("format"), STATE_FORMAT)
        for rid, f in self._facts.items():
            if rid not in self.replicas and f.running:  # owned, but nothing says what it is
                r = Replica(id=rid, deployment=f.deployment, revision="?", created_at_s=now, spec_hash=f.spec_hash,
                            launched_at_s=now, drain_requested_at_s=now, stop_requested_at_s=now, node=f.node,
                            detail=dict(f.detail))  # fmt: skip
                self.replicas[rid] = r
                log.warning("replica %s runs but no record names it: stopping it", rid)
                await self.backend.stop(rid)
        self._save()

    def _restore_targets(self: Controller, deployments: dict) -> None:
        for name, d in deployments.items():
            ds = self.deployments.get(name)
            if ds is None:
                if d.get("model"):
                    self._retired[name] = d["model"]
                continue
            bounds = ds.loaded.deployment.spec.replicas
            ds.desired = max(bounds.min, min(bounds.max, int(d.get("desired", ds.desired))))
            ds.desired_reason = d.get("desired_reason") or ds.desired_reason
            ds.desired_at_s = d.get("desired_at_s")
            ds.next_index = max(ds.next_index, int(d.get("next_index", 0)))
            ds.failures_in_row = int(d.get("failures_in_row", 0))
            ds.failures_total = {str(k): int(v) for k, v in (d.get("failures_total") or {}).items()}
            ds.last_scaling = d.get("last_scaling")
            try:
                ds.revs.restore(d.get("revisions") or {})
            except (KeyError, TypeError, ValueError) as err:
                log.warning("deployment %s: unreadable revisions record, serving today's spec: %s", name, err)
        declared = {ds.model for ds in self.deployments.values()}
        self._retired = {name: model for name, model in self._retired.items() if model not in declared}

    def _adopt(self: Controller, r: Replica, now: float) -> None:
        self.replicas[r.id] = r
        ds = self.deployments.get(r.deployment)
        if r.status.terminal():
            return
        f = self._facts.get(r.id)
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
        r.node, r.endpoint, r.detail = f.node, f.endpoint, dict(f.detail)
        r.adopted_at_s = now
        if ds is None:
            r.drain_requested_at_s = r.drain_requested_at_s or now   # not declared any more
            return
        r.consecutive_health_failures = 0
        if r.spec_hash not in (ds.revs.stable, ds.revs.canary):
            r.drain_requested_at_s = r.drain_requested_at_s or now
        elif r.status is ReplicaStatus.WARMING:
            r.healthy_at_s = None   # its warm-up died with the old controller: probe, then warm again
