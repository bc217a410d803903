"""Observed facts into replica records: what the backend reports each tick, written down once.

Owns `FactRecorder`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`, called by the controller's `_observe` step with the
backend's `fleet.controller.backend.ReplicaFacts` of the tick:

- a live replica takes its node, endpoint, detail, KV event endpoints and the scheduler's
  refusal (``unschedulable``) from its facts, and records when its image and its weights were
  first present;
- one that exited records when and its exit code, its warm-up is cancelled, and unless it was
  asked to stop it fails: FAILED_START before ``/health`` passed, FAILED_CRASHED after, with the
  last ``log_tail_lines`` lines of its log; a replica the backend has no record of has exited;
- an exited replica's facts are forgotten by the backend once recorded, and a replica the
  backend runs that no record names (a record lost or trimmed) is stopped, then forgotten.

Failing a replica and backing off its replacement is the controller's (``fail``), cancelling a
warm-up `fleet.controller.health.HealthKeeper`'s (``cancel_warmup``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from fleet.controller.backend import Backend, ReplicaFacts
from fleet.controller.launch import Fail
from fleet.controller.lifecycle import ReplicaStatus
from fleet.controller.targets import FleetRecords


class FactRecorder:
    """Writes the backend's facts into the controller's records (see the module docstring)."""

    def __init__(self, records: FleetRecords, *, backend: Backend, log_tail_lines: int, fail: Fail,
                 cancel_warmup: Callable[[str], None]) -> None:  # fmt: skip
        self.records = records
        self.backend = backend
        self.log_tail_lines = log_tail_lines
        self._fail = fail
        self._cancel_warmup = cancel_warmup

    async def record(self, facts: Mapping[str, ReplicaFacts], now: float) -> None:
        """Record ``facts`` (replica id -> facts, from `Backend.observe`) observed at ``now``
        (controller clock seconds). Backend errors propagate (the controller's step logs them)."""
        replicas = self.records.replicas
        for r in replicas.values():
            f = facts.get(r.id)
            if not r.engine_alive:
                if f is not None and f.exited and r.exited_at_s is not None:
                    await self.backend.forget(r.id)
                continue
            if f is None:
                f = ReplicaFacts(r.id, r.deployment, r.spec_hash, r.node or "", exited=True,
                                 exit_reason="the backend has no record of it")  # fmt: skip
            r.node, r.endpoint, r.detail, r.kv_events = f.node, f.endpoint, dict(f.detail), f.kv_events
            r.unschedulable = f.unschedulable
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
            tail = await self.backend.log_tail(r.id, self.log_tail_lines)
            why = f.exit_reason or "engine exited"
            if r.healthy_at_s is None:
                self._fail(r, ReplicaStatus.FAILED_START, f"{why} before /health passed", tail)
            else:
                self._fail(r, ReplicaStatus.FAILED_CRASHED, why, tail)
        for rid, f in facts.items():  # owned, unknown (a record lost or trimmed): stop it, or forget it once gone
            if rid not in replicas:
                if f.running:
                    await self.backend.stop(rid)
                elif f.exited:
                    await self.backend.forget(rid)
