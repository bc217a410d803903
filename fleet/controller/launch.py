"""Placement and launch: pending replicas given devices, and the backend asked to run them.

Owns `Launcher`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`: once per tick (`place_and_launch`, the controller's
`_place_and_launch` step) it asks the placement strategy (`fleet.placement`) for the devices of
each deployment's PENDING replicas (one decision per scale-up, oldest first, within the tick's
budget), records where each goes, has the controller persist that, then asks the backend to run
each one (`Backend.ensure`). A replica placement leaves unplaced waits with the reason
(``waiting``, shown by `fleet status`); below its deployment's minimum, lower-priority replicas
are preempted for it (`fleet.controller.preemption.Preemptor`). A deployment's placements leave
out the nodes where the scheduler lately refused one of its replicas (`without_refused`). It
also answers whether the next
replica of a deployment would start warm (`next_replica_warm`, read by the autoscaler). The
controller's inventory and clock time are passed in; persisting and failing a replica are the
controller's (``save``, ``fail``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable

from fleet.controller.backend import Backend, LaunchError, ReplicaWant
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.model_memory import ModelMemory
from fleet.controller.preemption import Preemptor
from fleet.controller.targets import FleetRecords
from fleet.inventory import Inventory
from fleet.placement import DeviceUse, PlacementRequest, PlacementStrategy, ReplicaPlacement, ReplicaShape
from fleet.spec import LoadedDeployment

log = logging.getLogger("fleet.controller")

YIELD_EVERY = 50
"""Deployments placed (or replicas launched) between two yields to the event loop in one tick:
a tick that places thousands of replicas never holds the loop for long stretches."""

Fail = Callable[[Replica, ReplicaStatus, str, list[str]], None]
"""`fleet.controller.reconcile.Controller._fail`: the replica failed, its replacement backed off."""


class Launcher:
    """Places and launches the controller's pending replicas (see the module docstring).
    ``waiting``: replica id -> why it is still PENDING, written here (shared with the controller);
    ``clock``: the controller's clock."""

    def __init__(self, records: FleetRecords, *, backend: Backend, placer: PlacementStrategy,
                 preemption: Preemptor, model_memory: ModelMemory, waiting: dict[str, str],
                 clock: Callable[[], float], save: Callable[[], None], fail: Fail) -> None:  # fmt: skip
        self.records = records
        self.backend = backend
        self.placer = placer
        self.preemption = preemption
        self.model_memory = model_memory
        self.waiting = waiting
        self.clock = clock
        self._save = save
        self._fail = fail
        self._width_groups: dict[frozenset[str], dict[int, set[str]]] | None = None   # per tick: fill_shapes

    def holding(self) -> dict[str, ReplicaPlacement]:
        """Replica id -> placement of every replica that holds its devices now."""
        return {rid: ReplicaPlacement.from_dict(r.placement) for rid, r in self.records.replicas.items()
                if r.placement is not None and (r.engine_alive or r.status is ReplicaStatus.PLACED)}

    def placement_request(self, ld: LoadedDeployment, count: int,
                          holding: dict[str, ReplicaPlacement]) -> PlacementRequest:
        """``count`` more replicas of ``ld``: its live replicas fix product and gang width; warm
        nodes are where a replica of this very spec has its weights (so image and weights are
        there), beside what the nodes report as ``cached``; ``memory`` is what one replica needs per
        GPU when known (`fleet.controller.model_memory.ModelMemory.need`: never waits for the hub)."""
        replicas = self.records.replicas
        mine = [rid for rid in holding if replicas[rid].spec_hash == ld.serving_hash]
        warm = {replicas[rid].node for rid in mine if replicas[rid].weights_ready_at_s}
        request = PlacementRequest.for_deployment(ld.deployment, count, [holding[rid] for rid in mine],
                                                  warm_nodes=warm - {None}, memory=self.model_memory.need(ld))
        return dataclasses.replace(request, fill_shapes=self.fill_shapes(ld.deployment.name, request.shape))

    def fill_shapes(self, name: str, shape: ReplicaShape) -> tuple[int, ...]:
        """The TP widths the other deployments' specs ask for on a GPU product ``shape`` may use
        (`PlacementRequest.fill_shapes`: leftover-aware best fit); () for MIG and CPU shapes.
        Reads `width_groups`, built once per tick: a request costs O(product lists), not
        O(deployments)."""
        if shape.kind != "gpus":
            return ()
        if self._width_groups is None:
            self._width_groups = self.width_groups()
        mine = set(shape.gpu_products)
        widths: set[int] = set()
        for products, by_width in self._width_groups.items():
            if not mine or not products or mine & products:
                widths.update(w for w, names in by_width.items() if len(names) > 1 or name not in names)
        return tuple(sorted(widths))

    def width_groups(self) -> dict[frozenset[str], dict[int, set[str]]]:
        """Whole-GPU specs of every deployment (each revision): GPU product list -> TP width ->
        the deployments asking for it."""
        groups: dict[frozenset[str], dict[int, set[str]]] = {}
        for name, ds in self.records.deployments.items():
            for ld in ds.revs.specs.values():
                s = ReplicaShape.of(ld.deployment)
                if s.kind == "gpus":
                    groups.setdefault(frozenset(s.gpu_products), {}).setdefault(s.tensor_parallel_size, set()).add(name)
        return groups

    def next_replica_warm(self, deployment: str, inventory: Inventory) -> bool:
        """`fleet.controller.reconcile.Controller.next_replica_warm` over ``inventory``."""
        ds = self.records.deployments[deployment]
        ld = ds.revs.specs[ds.revs.stable]
        holding = self.holding()
        self._width_groups = None   # asked between ticks: specs may have changed since the last one
        request = self.placement_request(ld, 1, holding)
        plan = self.placer.place_replicas(request, inventory,
                                          DeviceUse(d for a in holding.values() for d in a.devices))
        if not plan.placements:
            return False
        return all(request.is_warm(inventory.node(m.node)) for m in plan.placements[0].members)

    async def place_and_launch(self, inventory: Inventory, deadline: float) -> bool:
        """Place what is PENDING on ``inventory`` (stops placing once ``time.monotonic()`` passes
        ``deadline``; the rest at the next tick), then launch what was placed, and what was placed
        before a crash and never started. True when the backend was asked to run a replica (the
        controller observes again in the same tick)."""
        self._width_groups = None   # the specs as they are this tick
        pending: dict[tuple[str, str], list[Replica]] = {}
        placed: list[Replica] = []
        for r in self.records.replicas.values():
            if r.drain_requested_at_s is None and r.status is ReplicaStatus.PENDING:
                pending.setdefault((r.deployment, r.spec_hash), []).append(r)
            elif r.status is ReplicaStatus.PLACED:
                placed.append(r)
        if not pending and not placed:
            return False   # the usual tick at scale: nothing waits, so no scan of what every replica holds
        for waiting in pending.values():
            waiting.sort(key=lambda r: r.created_at_s)
        pending = dict(sorted(pending.items(), key=lambda kv: kv[1][0].created_at_s))   # oldest first, as before
        holding = self.holding()
        # A DeviceUse journals what this tick adds, so each later placement call of the tick
        # updates the placer's kept index from those changes alone (fleet.placement.freeindex).
        in_use: DeviceUse = DeviceUse(d for a in holding.values() for d in a.devices)
        now = self.clock()
        to_launch: list[tuple[Replica, ReplicaPlacement]] = []
        for i, ((name, spec_hash), waiting) in enumerate(pending.items()):
            if i and time.monotonic() > deadline:
                for _key, later in list(pending.items())[i:]:
                    for r in later:
                        self.waiting[r.id] = "placed at the next tick (this tick's placement time is spent)"
                break
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)   # let the loop breathe (informers, /metrics) in a long placement
            ld = self.records.deployments[name].revs.specs[spec_hash]
            request = self.placement_request(ld, len(waiting), holding)   # the whole scale-up: one decision
            blocked = self.preemption.blocked(name, now)   # freed for a higher priority: held off
            nodes, avoided = self.without_refused(name, inventory, now)
            plan = self.placer.place_replicas(request, nodes, in_use + blocked if blocked else in_use)
            # Devices a draining replica of this deployment still holds free up soon: a new replica
            # waits for them rather than share a device now (two CPU engines on one core starve
            # each other; a canary in place of a stable replica must not start on a shared one).
            freeing = [d for d in self.records.of_deployment(name) if d.engine_alive
                       and d.status is ReplicaStatus.DRAINING and d.placement is not None]  # fmt: skip
            for r, placement in zip(waiting, plan.placements):
                if freeing and not placement.exclusive:
                    self.waiting[r.id] = (f"waiting for the devices of draining replica(s) "
                                          f"{', '.join(d.id for d in freeing)} rather than share {placement.label}")
                    continue
                self.waiting.pop(r.id, None)
                in_use.update(placement.devices)
                r.placed_at_s, r.assignment, r.placement = now, placement.label, placement.to_dict()
                to_launch.append((r, placement))
            if unplaced := waiting[len(plan.placements):]:
                why = plan.explain() + (f"; avoiding {avoided}" if avoided else "")
                self._wait_or_preempt(name, ld, unplaced, why, holding, nodes, in_use + blocked, now)
        placed_now = {r.id for r, _ in to_launch}
        for r in placed:  # placed before a crash, never started: start now
            if r.status is ReplicaStatus.PLACED and r.placement is not None and r.drain_requested_at_s is None \
                    and r.id not in placed_now:
                to_launch.append((r, ReplicaPlacement.from_dict(r.placement)))
        if not to_launch:
            return False
        for r, _ in to_launch:
            r.launched_at_s = now
        self._save()  # persisted before the backend acts: a crash now leaves records to adopt
        for i, (r, placement) in enumerate(to_launch):
            if i and i % YIELD_EVERY == 0:
                await asyncio.sleep(0)
            ld = self.records.deployments[r.deployment].revs.specs[r.spec_hash]
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
        return True

    def without_refused(self, name: str, inventory: Inventory, now: float) -> tuple[Inventory, str]:
        """``inventory`` less the nodes where the scheduler refused a replica of deployment
        ``name`` lately (`fleet.controller.targets.DeploymentRecord.refused_nodes`; expired
        entries dropped), and a note naming them ("" when none is avoided: ``inventory`` itself)."""
        refused = self.records.deployments[name].refused_nodes
        for node in [n for n, until_s in refused.items() if until_s <= now]:
            del refused[node]
        if not refused:
            return inventory, ""
        kept = Inventory(tuple(n for n in inventory.nodes if n.name not in refused))
        return kept, f"node(s) {', '.join(sorted(refused))}, where the scheduler refused a replica of {name}"

    def _wait_or_preempt(self, name: str, ld: LoadedDeployment, unplaced: list[Replica], why: str,
                         holding: dict[str, ReplicaPlacement], inventory: Inventory, in_use: Counter[str],
                         now: float) -> None:  # fmt: skip
        """Replicas placement left unplaced wait, with the reason; below the deployment's
        minimum, lower-priority replicas are preempted for them (`fleet.controller.preemption`)."""
        decision = self.preemption.consider(name, self.placement_request(ld, len(unplaced), holding),
                                            inventory, in_use, holding, now)  # fmt: skip
        notes = [why] + [n for n in (decision and decision.reason, self.preemption.held_off_note(name, now)) if n]
        for r in unplaced:
            self.waiting[r.id] = "; ".join(notes)
        if decision is not None and decision.preempts:
            self._save()   # decided: persisted before the drain acts on it
