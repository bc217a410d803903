"""Preemption in the controller: replicas of lower-priority deployments drained for a deployment
below its minimum, and the devices they free held off from them.

Owns `Preemptor`, a collaborator of the reconcile step (`fleet.controller.reconcile.Controller`,
the same on one machine and on Kubernetes): it builds what the pure policy
(`fleet.placement.preemption.PreemptionPolicy`) reads from the controller's records, acts on its
decision (each victim drains through the router as a scale-down does, with its reason as the
replica's ``drain_reason`` and ``preempted_for`` recorded; the transition to DRAINING is the
event `fleet up` prints and the operator sends as a core/v1 Event), keeps the hold-offs
(`fleet.placement.preemption.HoldOffs`) and the recent preemptions (`fleet status`, the state
file). No I/O; the controller's clock time is passed in.
"""

from __future__ import annotations

import logging
from collections import Counter, deque

from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.targets import FleetRecords
from fleet.placement import PlacementRequest, PlacementStrategy, ReplicaPlacement
from fleet.inventory import Inventory
from fleet.placement.preemption import (DEFAULT_HOLD_OFF_S, Holder, HoldOffs, PreemptionDecision, PreemptionPolicy,
                                        Standing)  # fmt: skip

log = logging.getLogger("fleet.controller")

RECENT_PREEMPTIONS = 20
"""Preemptions kept for `fleet status` and the state file (the newest)."""

_PROGRESS = {s: i for i, s in enumerate(ReplicaStatus)}


class Preemptor:
    """Preemption for the controller's records (see the module docstring). ``placer``: the
    controller's placement strategy; ``hold_off_s``: how long freed devices stay held off."""

    def __init__(self, records: FleetRecords, placer: PlacementStrategy,
                 hold_off_s: float = DEFAULT_HOLD_OFF_S) -> None:  # fmt: skip
        self.records = records
        self.policy = PreemptionPolicy(placer)
        self.hold_offs = HoldOffs(hold_off_s)
        self.recent: deque[dict] = deque(maxlen=RECENT_PREEMPTIONS)

    def priority(self, deployment: str) -> int:
        ds = self.records.deployments.get(deployment)
        return ds.loaded.deployment.spec.priority if ds is not None else 0

    def blocked(self, deployment: str, now_s: float) -> Counter[str]:
        """Devices ``deployment`` may not take now: freed by a preemption for a deployment of
        higher priority, within the hold-off. Expired holds are dropped."""
        self.hold_offs.expire(now_s)
        if not self.hold_offs.holds:
            return Counter()
        return self.hold_offs.blocked(deployment, self.priority(deployment), now_s)

    def held_off_note(self, deployment: str, now_s: float) -> str:
        """Why some devices are not offered to ``deployment`` (for its waiting reason), or ''."""
        priority = self.priority(deployment)
        holds = [h for h in self.hold_offs.holds
                 if h.until_s > now_s and h.priority > priority and h.claimant != deployment]  # fmt: skip
        if not holds:
            return ""
        devices = len({d for h in holds for d in h.devices})
        claimants = ", ".join(sorted({h.claimant for h in holds}))
        return (f"{devices} device(s) freed for higher-priority {claimants} are held off for "
                f"{max(h.until_s for h in holds) - now_s:.0f} s more")

    def consider(self, deployment: str, request: PlacementRequest, inventory: Inventory, in_use: Counter[str],
                 holding: dict[str, ReplicaPlacement], now_s: float) -> PreemptionDecision | None:  # fmt: skip
        """``request``: replicas of ``deployment`` that placement could not place now, with
        ``in_use`` as placement saw it (blocked devices included) and ``holding`` (replica id ->
        placement of every replica holding devices). Drains the victims the policy picks and
        holds their devices off; returns the decision, or None when ``deployment`` is not below
        its minimum (no policy call)."""
        records = self.records
        ds = records.deployments.get(deployment)
        if ds is None or records.stopping:
            return None
        spec = ds.loaded.deployment.spec
        mine = sum(1 for r in records.of_deployment(deployment) if r.id in holding and r.status.counts_toward_desired())
        if mine >= spec.replicas.min:
            return None
        standings = self._standings(holding)
        order = {rid: i for i, rid in enumerate(records.replicas)}   # insertion = creation order
        holders = [Holder(rid, r.deployment, holding[rid], _PROGRESS[r.status], order[rid])
                   for rid in holding if (r := records.replicas[rid]).status.counts_toward_desired()]  # fmt: skip
        freeing = [d for r in records.replicas.values() if r.preempted_for == deployment and r.engine_alive
                   and r.id in holding for d in holding[r.id].devices]  # fmt: skip
        decision = self.policy.decide(request, standings[deployment], inventory, in_use, holders, standings, freeing)
        if decision.preempts:
            self._act(deployment, decision, holding, now_s)
        return decision

    def _standings(self, holding: dict[str, ReplicaPlacement]) -> dict[str, Standing]:
        out = {}
        for name, ds in self.records.deployments.items():
            spec = ds.loaded.deployment.spec
            active = sum(1 for r in self.records.of_deployment(name)
                         if r.id in holding and r.status.counts_toward_desired())  # fmt: skip
            out[name] = Standing(name, spec.priority, spec.preemptible, spec.replicas.min, active)
        return out

    def _act(self, claimant: str, decision: PreemptionDecision, holding: dict[str, ReplicaPlacement],
             now_s: float) -> None:  # fmt: skip
        priority = self.priority(claimant)
        for v in decision.victims:
            r: Replica = self.records.replicas[v.replica_id]
            r.drain_requested_at_s, r.drain_reason, r.preempted_for = now_s, v.reason, claimant
            hold = self.hold_offs.add(holding[r.id].devices, claimant, priority, now_s)
            self.recent.append({"at_s": now_s, "replica": r.id, "deployment": r.deployment, "for": claimant,
                                "devices": sorted(hold.devices), "held_off_until_s": hold.until_s,
                                "reason": v.reason})  # fmt: skip
            log.warning("replica %s of %s drains: %s", r.id, r.deployment, v.reason)

    def snapshot(self) -> dict:
        """JSON-ready: the holds in force and the recent preemptions (the state file)."""
        return {"holds": self.hold_offs.to_list(), "recent": list(self.recent)}

    def restore(self, previous: dict | None, now_s: float) -> None:
        """Read back what `snapshot` wrote in a previous controller's state (``previous``: the
        whole snapshot; the clock is the same across restarts on one machine)."""
        saved = (previous or {}).get("preemption") or {}
        if isinstance(saved, dict):
            self.hold_offs.restore(saved.get("holds") or [], now_s)
            self.recent.extend(e for e in saved.get("recent") or []
                               if isinstance(e, dict) and isinstance(e.get("at_s"), (int, float)))
