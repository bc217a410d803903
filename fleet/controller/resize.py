"""The scale step acting: replicas created and drained toward each revision's target.

Owns `Resizer`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`, called by the controller's `_scale` step once a tick:

- replicas on sick devices drain (`fleet.controller.drain.Drainer.drain_unhealthy`); on
  shutdown, and for deployments no longer declared, every replica drains;
- per deployment and revision `fleet.controller.scale.scale_step` decides how many replicas to
  create and which to drain (among equals the placer's `drain_order`, which frees NVLink domains
  whole), shaped by the standby pool (`fleet.controller.standby.StandbyKeeper.shape`); new
  replicas wait for the deployment's failure backoff (``next_create_at_s``);
- replicas of older revisions serve until the current ones have the READY replicas to replace
  them (with ``rollout.surge``; without it they make room at once; a rolled-back revision goes
  at once), the least advanced first;
- the standby pool is refilled and trimmed (`StandbyKeeper.refill_and_trim`).

It only decides and writes records (PENDING replicas created, ``drain_requested_at_s`` set); the
controller persists the decision before any collaborator acts on it. No I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from functools import partial

from fleet.controller.backend import ReplicaFacts
from fleet.controller.drain import Drainer
from fleet.controller.launch import Launcher
from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.scale import scale_step
from fleet.controller.standby import StandbyKeeper
from fleet.controller.targets import DeploymentRecord, FleetRecords
from fleet.inventory import Inventory
from fleet.placement import PlacementStrategy, ReplicaPlacement


class Resizer:
    """Creates and drains the controller's replicas toward their targets (see the module docstring)."""

    def __init__(self, records: FleetRecords, *, drainer: Drainer, standby: StandbyKeeper, launcher: Launcher,
                 placer: PlacementStrategy) -> None:  # fmt: skip
        self.records = records
        self.drainer = drainer
        self.standby = standby
        self.launcher = launcher
        self.placer = placer

    def step(self, now: float, inventory: Inventory, facts: dict[str, ReplicaFacts]) -> bool:
        """One scale step at ``now`` (controller clock seconds) over the tick's ``inventory`` and
        backend ``facts``. True when a replica was created or asked to drain (persist it)."""
        prefer = partial(self._drain_preference, inventory=inventory)
        changed = self.drainer.drain_unhealthy(now, inventory, facts)
        for r in self.records.replicas.values():  # stopping, or deployments no longer declared: everything goes
            if ((self.records.stopping or r.deployment not in self.records.deployments)
                    and (r.status.counts_toward_desired() or r.status.standby())):
                r.drain_requested_at_s, changed = now, True
        order = list(ReplicaStatus)
        created = {rid: i for i, rid in enumerate(self.records.replicas)}  # insertion = creation order
        for name, ds in self.records.deployments.items():
            if self.records.stopping:
                break
            active = [r for r in self.records.of_deployment(name)
                      if r.status.counts_toward_desired() and not r.standby_refill]
            targets = ds.revs.targets(ds.desired)
            for h, want in targets.items():
                step = scale_step([r for r in active if r.spec_hash == h], want, lambda r: created[r.id],
                                  prefer)
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
        return changed

    def _drain_preference(self, equals: list[Replica], n: int, inventory: Inventory) -> list[Replica]:
        """Which ``n`` of ``equals`` (replicas of one revision and status, newest first) to drain:
        the placer's choice (`PlacementStrategy.drain_order`: ``fleet`` frees NVLink domains
        whole) when each holds a placement, else the newest."""
        if any(r.placement is None for r in equals):
            return equals[:n]
        oldest_first = equals[::-1]
        placements = [ReplicaPlacement.from_dict(r.placement) for r in oldest_first]
        in_use = Counter(d for a in self.launcher.holding().values() for d in a.devices)
        in_use.update(d for p in placements for d in p.devices if not in_use[d])
        return [oldest_first[i] for i in self.placer.drain_order(placements, n, inventory, in_use)]

    def _create_replica(self, ds: DeploymentRecord, spec_hash: str, now: float) -> Replica:
        """A new PENDING replica of revision ``spec_hash``, numbered after the deployment's last."""
        ld = ds.revs.specs[spec_hash]
        dep = ld.deployment
        rid = f"{dep.name}-{ds.next_index}"
        ds.next_index += 1
        r = self.records.replicas[rid] = Replica(id=rid, deployment=dep.name, revision=dep.spec.model.revision,
                                                 created_at_s=now, spec_hash=spec_hash)  # fmt: skip
        return r
