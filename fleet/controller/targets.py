"""What the controller converges each deployment to, and what it keeps about each besides.

Owns `DeploymentTarget` (the persisted target of one deployment: desired replicas, who set them
and when, and the revisions it serves: `fleet.rollout.revisions.Revisions`, i.e. stable, canary
and the rollout's state), `DeploymentRecord` (the bookkeeping around that target: the spec as
declared today, replica numbering, the replacement backoff, the pool last published, the
autoscaler's last decision) and `FleetRecords` (every deployment, every replica record, the
deployments being retired and whether the fleet is stopping): the one object that the reconcile
step (`fleet.controller.reconcile`), the take-over at start (`fleet.controller.restart`) and the
rollout driver (`fleet.controller.rollouts`) share. Pure data; no I/O.

A new target is persisted before anything acts on it (Ray Serve keeps its
``DeploymentTargetState`` apart from its bookkeeping the same way): the controller writes the
whole snapshot (`fleet.controller.reconcile.Controller.snapshot`, format `STATE_FORMAT`) after
deciding and before asking the backend to start or stop anything, and a restarted controller
reads the targets back first (`DeploymentRecord.restore`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from fleet.controller.lifecycle import Replica
from fleet.rollout.revisions import Revisions
from fleet.spec import LoadedDeployment
from router.pools.spec import PoolSpec

STATE_FORMAT = 2
"""Version of the snapshot layout (`fleet.controller.reconcile.Controller.snapshot`); a snapshot of
another version is not read back."""


@dataclass
class DeploymentTarget:
    """The persisted target of one deployment.

    ``desired``: replicas wanted (within ``spec.replicas.min..max``); ``reason``: who set it last
    (``spec.replicas``, ``autoscaler: ...``); ``set_at_s``: when (controller clock seconds; None
    until changed); ``revisions``: what is served, and at which weight during a rollout.
    """

    desired: int
    revisions: Revisions
    reason: str = "spec.replicas"
    set_at_s: float | None = None

    def set(self, desired: int, reason: str, now_s: float) -> None:
        """A new desired count; ``reason`` and ``now_s`` are kept only when the count changes."""
        if desired != self.desired:
            self.reason, self.set_at_s = reason, now_s
        self.desired = desired

    def to_dict(self) -> dict:
        """The target's part of the state file (the key names of `STATE_FORMAT` 2)."""
        return {"desired": self.desired, "desired_reason": self.reason, "desired_at_s": self.set_at_s,
                "revisions": self.revisions.to_dict()}  # fmt: skip


@dataclass
class DeploymentRecord:
    """One declared deployment: its target and the controller's bookkeeping around it.

    ``loaded``: the spec as declared now; ``next_index``: the number of its next replica id
    (``<name>-<n>``; never reused); ``failures_in_row`` / ``next_create_at_s``: the replacement
    backoff (no replica is created before ``next_create_at_s``, controller clock seconds);
    ``failures_total``: failed replicas by revision (a counter, for metrics); ``last_pool``: the
    pool document last published to the router (None: publish again); ``last_scaling``: the
    autoscaler's last decision, JSON-ready (`fleet status`); ``standby_wanted``: the standby
    replicas the autoscaler's policy last asked to keep (`autoscaler.policy.ScalingDecision.standby`;
    None: it named none, so ``spec.standby.maxReplicas`` is kept; not persisted: the policy's next
    decision names it again); ``refused_nodes``: node -> controller clock seconds until which its
    placements avoid the node, because the scheduler refused a replica there past its start
    deadline (`fleet.controller.health`; not persisted).
    """

    loaded: LoadedDeployment
    target: DeploymentTarget
    next_index: int = 0
    failures_in_row: int = 0
    next_create_at_s: float = 0.0
    failures_total: dict[str, int] = field(default_factory=dict)
    last_pool: PoolSpec | None = None
    last_scaling: dict | None = None
    standby_wanted: int | None = None
    refused_nodes: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, ld: LoadedDeployment) -> DeploymentRecord:
        """A deployment as declared, before anything is restored: ``spec.replicas.initial``
        wanted, its one revision stable."""
        return cls(ld, DeploymentTarget(ld.deployment.spec.replicas.desired_at_start, Revisions.of(ld)))

    @property
    def desired(self) -> int:
        return self.target.desired

    @property
    def desired_reason(self) -> str:
        return self.target.reason

    @property
    def revs(self) -> Revisions:
        return self.target.revisions

    @property
    def model(self) -> str:
        return self.loaded.deployment.spec.model.name

    def clamp(self, desired: int) -> int:
        """``desired`` within today's ``spec.replicas.min..max``."""
        bounds = self.loaded.deployment.spec.replicas
        return max(bounds.min, min(bounds.max, desired))

    def to_dict(self) -> dict:
        """The deployment's entry in the state file: the target, the bookkeeping a restarted
        controller needs (numbering, backoff), and what `fleet status` shows."""
        spec = self.loaded.deployment.spec
        return {
            **self.target.to_dict(),
            "next_index": self.next_index,
            "serving_hash": self.loaded.serving_hash,
            "autoscaling": spec.autoscaling.policy if spec.autoscaling else None,
            "last_scaling": self.last_scaling,
            "min": spec.replicas.min,
            "max": spec.replicas.max,
            "model": self.model,
            "policy": spec.routing.policy,
            "source": str(self.loaded.path),
            "failures_in_row": self.failures_in_row,
            "failures_total": dict(self.failures_total),
        }

    def restore(self, d: dict) -> None:
        """Read back what `to_dict` wrote by a previous controller: the target (clamped to today's
        bounds), numbering, backoff count, failure counters, the last scaling decision and the
        revisions. Raises KeyError, TypeError or ValueError on a malformed revisions record (the
        rest is read first)."""
        t = self.target
        t.desired = self.clamp(int(d.get("desired", t.desired)))
        t.reason = d.get("desired_reason") or t.reason
        t.set_at_s = d.get("desired_at_s")
        self.next_index = max(self.next_index, int(d.get("next_index", 0)))
        self.failures_in_row = int(d.get("failures_in_row", 0))
        self.failures_total = {str(k): int(v) for k, v in (d.get("failures_total") or {}).items()}
        self.last_scaling = d.get("last_scaling")
        t.revisions.restore(d.get("revisions") or {})


class ReplicaTable(dict[str, Replica]):
    """Replica records by id, in creation order, indexed by deployment: `of_deployment` costs
    what that deployment has, not what the fleet has (a tick at 1,000 deployments asks it of
    every deployment). Every way the controller adds or removes a record keeps the index (a
    replica's ``deployment`` never changes); ``copy``, ``|`` and ``fromkeys`` give plain dicts."""

    def __init__(self, records: Iterable[tuple[str, Replica]] | dict[str, Replica] = ()) -> None:
        super().__init__()
        self._by_deployment: dict[str, dict[str, Replica]] = {}
        self.update(records)

    def __setitem__(self, rid: str, r: Replica) -> None:
        old = self.get(rid)
        if old is not None and old.deployment != r.deployment:
            self._unindex(rid, old)
        super().__setitem__(rid, r)
        self._by_deployment.setdefault(r.deployment, {})[rid] = r

    def __delitem__(self, rid: str) -> None:
        r = self[rid]
        super().__delitem__(rid)
        self._unindex(rid, r)

    def _unindex(self, rid: str, r: Replica) -> None:
        mine = self._by_deployment.get(r.deployment)
        if mine is not None:
            mine.pop(rid, None)
            if not mine:
                del self._by_deployment[r.deployment]

    _MISSING = object()

    def pop(self, rid: str, default=_MISSING):  # type: ignore[override]
        if rid in self:
            r = self[rid]
            del self[rid]
            return r
        if default is ReplicaTable._MISSING:
            raise KeyError(rid)
        return default

    def popitem(self) -> tuple[str, Replica]:
        rid, r = super().popitem()
        self._unindex(rid, r)
        return rid, r

    def setdefault(self, rid: str, default: Replica) -> Replica:  # type: ignore[override]
        if rid not in self:
            self[rid] = default
        return self[rid]

    def update(self, *others, **kw) -> None:  # type: ignore[override]
        for other in (*others, kw):
            items = other.items() if hasattr(other, "items") else other
            for rid, r in items:
                self[rid] = r

    def __ior__(self, other):  # type: ignore[override]
        self.update(other)
        return self

    def clear(self) -> None:
        super().clear()
        self._by_deployment.clear()

    def of_deployment(self, name: str) -> list[Replica]:
        """The records of deployment ``name``, in creation order."""
        return list(self._by_deployment.get(name, {}).values())

    def deployment_names(self) -> list[str]:
        """Names of the deployments that have records (declared or not)."""
        return list(self._by_deployment)


@dataclass
class FleetRecords:
    """Everything the controller knows: ``deployments`` declared (by name), ``replicas`` (records
    by id, in creation order), ``retired`` (deployments no longer declared whose pool is still
    drained: name -> model) and ``stopping`` (shutdown asked: every replica drains and stops)."""

    deployments: dict[str, DeploymentRecord]
    replicas: ReplicaTable = field(default_factory=ReplicaTable)
    retired: dict[str, str] = field(default_factory=dict)
    stopping: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, ReplicaTable):
            self.replicas = ReplicaTable(self.replicas)

    @classmethod
    def of(cls, loaded: list[LoadedDeployment]) -> FleetRecords:
        return cls({ld.deployment.name: DeploymentRecord.of(ld) for ld in loaded})

    def of_deployment(self, name: str) -> list[Replica]:
        """The replica records of deployment ``name``, in creation order (`ReplicaTable`: no scan of
        the fleet)."""
        return self.replicas.of_deployment(name)
