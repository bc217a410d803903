"""Drain and stop: replicas on sick devices asked to drain, and draining replicas stopped.

Owns `Drainer`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`:

- `drain_unhealthy` (the scale step, `fleet.controller.resize.Resizer`): replicas holding a GPU or MIG
  instance that the inventory reports unhealthy or quarantined, or that the backend reports
  ``sick``, are asked to drain; the scale step replaces them.
- `drain_and_stop` (the controller's `_drain_and_stop` step): a DRAINING replica that served is
  stopped once the router reports no request in flight on it (`PoolSink.in_flight`) or the drain
  timeout has passed, one that never served at once, a failed one at once; a replica asked to
  stop is killed after the stop grace period. Each batch is persisted (``save``) before the
  backend is asked to stop or kill.

The controller's inventory, facts and clock time are passed in; cancelling a replica's warm-up
is `fleet.controller.health.HealthKeeper`'s (``cancel_warmup``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from fleet.controller.backend import Backend, ReplicaFacts
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.pools import PoolSink
from fleet.controller.targets import FleetRecords
from fleet.inventory import Inventory
from fleet.placement import ReplicaPlacement

log = logging.getLogger("fleet.controller")


class Drainer:
    """Drains and stops the controller's replicas (see the module docstring). ``drain_timeout_s``:
    the longest wait for in-flight requests to finish; ``stop_grace_s``: stop -> kill
    (`fleet.controller.reconcile.ControllerSettings`)."""

    def __init__(self, records: FleetRecords, *, backend: Backend, pool_sink: PoolSink,
                 drain_timeout_s: float, stop_grace_s: float, clock: Callable[[], float],
                 save: Callable[[], None], cancel_warmup: Callable[[str], None]) -> None:  # fmt: skip
        self.records = records
        self.backend = backend
        self.pool_sink = pool_sink
        self.drain_timeout_s = drain_timeout_s
        self.stop_grace_s = stop_grace_s
        self.clock = clock
        self._save = save
        self._cancel_warmup = cancel_warmup

    def drain_unhealthy(self, now: float, inventory: Inventory, facts: Mapping[str, ReplicaFacts]) -> bool:
        """Replicas holding a GPU (or a MIG instance of a GPU) that the inventory reports unhealthy
        (quarantined by the node agent, ECC errors, ...), or that the backend reports ``sick``
        (`ReplicaFacts.sick`: on Kubernetes the device plugin, not placement, picks the GPU), drain;
        the controller's `_scale` replaces them, and placement keeps the replacement off that GPU.
        True when one was drained."""
        drained = False
        replicas = self.records.replicas
        for r in replicas.values():
            f = facts.get(r.id)
            if f is not None and f.sick and (r.status.counts_toward_desired() or r.status.standby()):
                r.drain_requested_at_s, r.drain_reason, drained = now, f.sick, True
                log.warning("replica %s drains: %s", r.id, f.sick)
        sick: dict[str, str] = {}
        for node in inventory.nodes:
            sick.update({uuid: f"{uuid} on {node.name} quarantined: {why}" for uuid, why in node.quarantined.items()})
            for gpu in node.gpus:
                problems = gpu.health.problems()
                if problems:
                    why = f"GPU {gpu.uuid} on {node.name} unhealthy: {', '.join(problems)}"
                    sick[gpu.uuid] = why
                    sick.update({m.uuid: why for m in gpu.mig_instances})
        if not sick:
            return drained
        for r in replicas.values():
            if r.placement is None or not (r.status.counts_toward_desired() or r.status.standby()):
                continue
            hit = next((sick[d] for d in ReplicaPlacement.from_dict(r.placement).devices if d in sick), None)
            if hit is not None:
                r.drain_requested_at_s, r.drain_reason, drained = now, hit, True
                log.warning("replica %s drains: %s", r.id, hit)
        return drained

    async def drain_and_stop(self) -> None:
        now = self.clock()
        replicas = self.records.replicas
        draining = [r for r in replicas.values() if r.status is ReplicaStatus.DRAINING and r.engine_alive]
        in_flight: dict[str, int] = {}
        if any(r.warmup_passed_at_s is not None and r.stop_requested_at_s is None for r in draining):
            try:
                in_flight = await self.pool_sink.in_flight()
            except Exception as err:  # noqa: BLE001 - router unreachable: wait for the drain timeout
                log.warning("cannot read in-flight requests from the router: %s", err)
                in_flight = {r.id: 1 for r in draining}
        stops: list[Replica] = []
        kills: list[Replica] = []
        for r in replicas.values():
            if not r.engine_alive:
                continue
            if r.stop_requested_at_s is None:
                if r.failure is not None:
                    stops.append(r)
                elif r.status is ReplicaStatus.DRAINING:
                    was_serving = r.warmup_passed_at_s is not None
                    drained = not was_serving or in_flight.get(r.id, 0) == 0
                    if drained or now - r.drain_requested_at_s >= self.drain_timeout_s:
                        stops.append(r)
            elif r.kill_sent_at_s is None and now - r.stop_requested_at_s >= self.stop_grace_s:
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
        for r in replicas.values():
            if r.status is ReplicaStatus.DRAINING and r.launched_at_s is None:
                r.exited_at_s = now
