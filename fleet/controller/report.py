"""What the controller reports of its replicas: status transitions, and the history kept of them.

Owns `ReplicaEvent` (one replica's move from one status to another, with a line saying why or
where) and `TransitionReport`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`: at the end of each tick the controller asks it for the
transitions since the last tick (`transitions`) and hands each to its ``on_event`` callback
(`fleet up` prints it; the operator, `fleet.k8s.status`, sends a core/v1 Event), then trims each
deployment's terminal replicas to the history `fleet status` shows (`trim_history`). No I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.targets import FleetRecords


@dataclass(frozen=True)
class ReplicaEvent:
    replica_id: str
    deployment: str
    old: ReplicaStatus | None
    new: ReplicaStatus
    detail: str
    at_s: float


def ready_note(r: Replica) -> str:
    """`` (N s to ready)`` counted from creation, `` (N s from wake to ready)`` for a replica
    woken from STANDBY (`Replica.ready_after`); empty when it has not been READY since."""
    after = r.ready_after()
    if after is None:
        return ""
    event, seconds = after
    return f" ({seconds:.1f} s from wake to ready)" if event == "wake" else f" ({seconds:.1f} s to ready)"


class TransitionReport:
    """Transitions and history of the replicas in ``records``. ``waiting``: replica id -> why it is
    still PENDING (written by placement, `fleet.controller.launch.Launcher`; shared with the
    controller); ``history_per_deployment``: terminal replicas kept per deployment."""

    def __init__(self, records: FleetRecords, waiting: dict[str, str], history_per_deployment: int) -> None:
        self.records = records
        self.waiting = waiting
        self.history_per_deployment = history_per_deployment
        self._last_status: dict[str, ReplicaStatus] = {}

    def transitions(self, now: float) -> Iterator[ReplicaEvent]:
        """The replicas whose status changed since the last call, one event each; a replica's
        status counts as reported once its event is yielded."""
        for r in self.records.replicas.values():
            new = r.status
            old = self._last_status.get(r.id)
            if new is old:
                continue
            self._last_status[r.id] = new
            yield ReplicaEvent(r.id, r.deployment, old, new, self.detail(r, new), now)

    def detail(self, r: Replica, status: ReplicaStatus) -> str:
        if status.failed() and r.failure:
            return r.failure.reason
        if status is ReplicaStatus.PENDING:
            return self.waiting.get(r.id, "")
        adopted = " (adopted: kept running)" if r.adopted_at_s is not None else ""
        if status in (ReplicaStatus.PULLING, ReplicaStatus.CACHING):
            return r.detail.get("cache", "")
        if status is ReplicaStatus.STARTING:
            where = ", ".join(f"{k} {v}" for k, v in r.detail.items() if k in ("port", "pid", "pod"))
            return f"{r.assignment}{', ' + where if where else ''}{adopted}"
        if status is ReplicaStatus.READY:
            if r.adopted_at_s is not None:
                return f"{r.endpoint}{adopted}"
            return f"{r.endpoint}{ready_note(r)}" if r.endpoint else ready_note(r).strip()
        if status is ReplicaStatus.DRAINING and r.drain_reason:
            return r.drain_reason
        if status is ReplicaStatus.TERMINATED and r.exit_code is not None:
            return f"exit code {r.exit_code}"
        return adopted.strip()

    def trim_history(self) -> None:
        """Keep the newest ``history_per_deployment`` terminal replicas of each deployment (whose
        engine has exited); older records are dropped."""
        replicas = self.records.replicas
        for name in replicas.deployment_names():
            done = [r for r in self.records.of_deployment(name) if r.status.terminal()]
            for r in sorted(done, key=lambda r: r.created_at_s)[: max(0, len(done) - self.history_per_deployment)]:
                if r.engine_alive:
                    continue
                for table in (replicas, self._last_status, self.waiting):
                    table.pop(r.id, None)
