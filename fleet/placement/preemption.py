"""Priorities and preemption: which replicas of lower-priority deployments give up their devices
so that a deployment below its minimum can be placed, and which devices stay held off from the
deployments that gave them up.

Owns `PreemptionPolicy` (the decision), its inputs `Standing` (one deployment's priority,
preemptibility, minimum and replicas holding devices) and `Holder` (one replica holding devices),
its answer `PreemptionDecision` (victims with their reasons, or none and why), and `HoldOffs`
(devices a preemption freed, kept from every deployment of lower priority than the one they were
freed for until the hold-off ends: a victim is never re-placed onto the capacity it just gave up,
so two deployments cannot take the same GPUs from each other in turns).

The rules (docs/placement.md, "Priorities and preemption"):

- only a deployment below its ``spec.replicas.min`` preempts, and only for the replicas it lacks
  to reach it (replicas above the minimum, an autoscaler's wish, wait for free capacity);
- only replicas of deployments with a strictly lower ``spec.priority`` are victims; a victim's
  deployment is never taken below its own minimum unless it is ``spec.preemptible``;
- victims go in this order: lowest priority first, then the least advanced (a STARTING replica
  before a READY one: `Holder.progress`), then the newest; of those, the fewest that make room
  (the shortest prefix of that order that lets placement place the replicas, then every victim
  the placement does not need is dropped again; or, when cheaper, the victims under where
  placement puts the replicas with every allowed victim gone: cheaper is kube-scheduler's order,
  the lower highest victim priority, then the lower sum of priorities, then fewer victims);
- replicas already draining for the same deployment count as freed: nothing more is preempted
  while they drain.

Whether the freed devices make room is asked of the placement strategy itself
(`fleet.placement.strategies.PlacementStrategy.place_replicas`), so every filter placement
applies (product, memory fit, driver) applies here too. Called by the controller
(`fleet.controller.preemption`) and the trace simulator (`fleet.tracesim.preemption`) with the
same objects. Pure: no I/O; time is passed in (controller clock seconds).
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from fleet.inventory.model import Inventory, NodeInventory
from fleet.placement.shapes import PlacementPlan, PlacementRequest, ReplicaPlacement
from fleet.placement.strategies import PlacementStrategy

DEFAULT_HOLD_OFF_S = 600.0
"""Seconds the devices a preemption freed stay held off from lower-priority deployments: longer
than a victim's drain (the controller's ``drain_timeout_s``, 120 s) and stop grace (30 s), so the
freed devices reach the deployment they were freed for, and long enough that a crash-looping
replica of that deployment (backoff up to 300 s, `fleet.controller.reconcile.ControllerSettings`)
does not hand them back and take them again in turns."""

MAX_PRUNE_TRIALS = 32
"""Most placement trials spent dropping victims the placement did not need (each trial is one
`place_replicas` call)."""


@dataclass(frozen=True)
class Standing:
    """One deployment as preemption sees it: ``priority`` (``spec.priority``), ``preemptible``
    (``spec.preemptible``), ``minimum`` (``spec.replicas.min``) and ``active``: its replicas that
    count toward its target and hold devices (placed, starting, warming, ready)."""

    name: str
    priority: int
    preemptible: bool
    minimum: int
    active: int

    @property
    def spare(self) -> int:
        """Replicas a higher-priority deployment may take: all when preemptible, else those above
        the minimum."""
        return self.active if self.preemptible else max(0, self.active - self.minimum)

    @property
    def lacking(self) -> int:
        """Replicas short of the minimum (0 at or above it)."""
        return max(0, self.minimum - self.active)


@dataclass(frozen=True)
class Holder:
    """One replica that holds devices and counts toward its deployment's target. ``progress``:
    how far along it is (a larger value is further: the index of its status in
    `fleet.controller.lifecycle.ReplicaStatus`), ``created``: its place in creation order (a
    larger value is newer; the controller's creation order, since replicas created in one tick
    share a creation time)."""

    replica_id: str
    deployment: str
    placement: ReplicaPlacement
    progress: int
    created: float


@dataclass(frozen=True)
class Victim:
    """A replica to drain and stop, and why (the event and the replica's drain reason)."""

    replica_id: str
    deployment: str
    reason: str


@dataclass(frozen=True)
class PreemptionDecision:
    """The answer: ``victims`` to drain (empty: preempt nothing) and ``reason``, one line for
    the claimant's waiting reason and the logs (why these victims, or why none). ``plan``: where
    the claimant's replicas would go once the victims' devices are free (None when no victim)."""

    victims: tuple[Victim, ...] = ()
    reason: str = ""
    plan: PlacementPlan | None = None

    @property
    def preempts(self) -> bool:
        return bool(self.victims)


@dataclass(frozen=True)
class Hold:
    """Devices freed for deployment ``claimant`` (priority ``priority``) at ``at_s``, held off
    from lower-priority deployments until ``until_s``."""

    devices: frozenset[str]
    claimant: str
    priority: int
    at_s: float
    until_s: float

    def to_dict(self) -> dict:
        return {"devices": sorted(self.devices), "claimant": self.claimant, "priority": self.priority,
                "at_s": self.at_s, "until_s": self.until_s}  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> Hold:
        """Raises KeyError, TypeError or ValueError on a record that is not one."""
        return cls(frozenset(str(x) for x in d["devices"]), str(d["claimant"]), int(d["priority"]),
                   float(d["at_s"]), float(d["until_s"]))  # fmt: skip


@dataclass
class HoldOffs:
    """The holds in force. `add` one per preemption; `blocked` says which devices a deployment
    of a given priority may not take now; expired holds are dropped by `expire`. Pure: times are
    passed in."""

    hold_off_s: float = DEFAULT_HOLD_OFF_S
    holds: list[Hold] = field(default_factory=list)

    def add(self, devices: Iterable[str], claimant: str, priority: int, now_s: float) -> Hold:
        hold = Hold(frozenset(devices), claimant, priority, now_s, now_s + self.hold_off_s)
        self.holds.append(hold)
        return hold

    def expire(self, now_s: float) -> None:
        self.holds = [h for h in self.holds if h.until_s > now_s]

    def blocked(self, deployment: str, priority: int, now_s: float) -> Counter[str]:
        """Devices held off from ``deployment`` (of ``priority``) now, as an ``in_use`` counter
        to add to placement's: those freed for a deployment of higher priority (never those
        freed for ``deployment`` itself)."""
        out: Counter[str] = Counter()
        for h in self.holds:
            if h.until_s > now_s and h.priority > priority and h.claimant != deployment:
                out.update(h.devices)
        return out

    def to_list(self) -> list[dict]:
        return [h.to_dict() for h in self.holds]

    def restore(self, records: Iterable[dict], now_s: float) -> None:
        """Read back what `to_list` wrote (a restarted controller on the same clock); malformed
        records are skipped."""
        for d in records:
            try:
                hold = Hold.from_dict(d)
            except (KeyError, TypeError, ValueError):
                continue
            if hold.until_s > now_s:
                self.holds.append(hold)


class PreemptionPolicy:
    """Chooses victims for a deployment below its minimum (the module docstring gives the rules).

    ``placer``: the placement strategy the controller places with (asked whether the freed
    devices make room). Pure; the same object serves the controller and the trace simulator.
    """

    def __init__(self, placer: PlacementStrategy) -> None:
        self.placer = placer

    def decide(
        self,
        request: PlacementRequest,
        claimant: Standing,
        inventory: Inventory,
        in_use: Counter[str],
        holders: Sequence[Holder],
        standings: Mapping[str, Standing],
        freeing: Collection[str] = (),
    ) -> PreemptionDecision:
        """Victims that make room for ``request`` (replicas of ``claimant`` that placement could
        not place now), or none and why.

        Args:
            request: the claimant's unplaced replicas (its ``count`` is capped here at
                ``claimant.lacking``: only the replicas below the minimum preempt).
            claimant: the deployment asking.
            inventory: the nodes.
            in_use: device id -> replicas holding it, including devices held off from the
                claimant (`HoldOffs.blocked`). Not modified.
            holders: the replicas that hold devices and count toward their target (victim
                candidates; those of the claimant or of equal or higher priority are skipped).
            standings: every deployment's `Standing`, by name (a holder's deployment missing here
                is never a victim: it is not declared any more, and drains anyway).
            freeing: devices of replicas already draining for the claimant (counted as free).

        Returns:
            A `PreemptionDecision`; ``victims`` is empty when nothing should be preempted (the
            claimant is at its minimum, the freeing replicas make room already, no victim is
            allowed, or even every allowed victim would not make room), with the reason.
        """
        need = min(request.count, claimant.lacking)
        if need <= 0:
            return PreemptionDecision(reason=f"{claimant.name} is at its minimum ({claimant.minimum}): "
                                             "replicas above it wait for free capacity")  # fmt: skip
        request = replace(request, count=need, all_or_nothing=True)
        base = _without(in_use, (), freeing) if freeing else in_use   # never modified: trials copy what they use
        freeing_nodes = {n.name for n in inventory.nodes if set(freeing) & _devices_of(n)} if freeing else set()
        if freeing and (self._fits(request, _scope(inventory, (), freeing_nodes), base)
                        or self._fits(request, inventory, base)):  # fmt: skip
            return PreemptionDecision(reason=f"waiting for {len(set(freeing))} device(s) being freed for "
                                             f"{claimant.name} to drain")  # fmt: skip
        candidates = _Candidates(claimant, holders, standings)
        if not candidates.total:
            return PreemptionDecision(reason=self._nobody(claimant, holders, standings))
        # Trials run on the nodes that victims (or replicas already freeing for the claimant) would
        # free: placement just found no room elsewhere for a replica on one node. A gang may also
        # take nodes without a victim: then every trial runs on the whole inventory.
        whole = False

        def scope(victims: Sequence[Holder]) -> Inventory:
            return inventory if whole else _scope(inventory, victims, freeing_nodes)

        def fits(count: int, victims: Sequence[Holder], where: Inventory | None = None) -> bool:
            where = where or scope(victims)
            held = _without(base if where is inventory else _local(base, where), victims)
            return self._fits(replace(request, count=count), where, held)

        # The shortest prefix of the candidates whose devices make room: doubling, then bisecting
        # (freeing more devices never leaves less room); short prefixes are trials on few nodes.
        total = candidates.total
        hi = 1
        while hi < total and not fits(need, candidates.first(hi)):
            hi *= 2
        hi = min(hi, total)
        if hi == total and not fits(need, candidates.first(total)):
            # Not all the replicas needed: as many as every allowed victim makes room for.
            everyone = candidates.first(total)
            if not fits(1, everyone):
                whole = True
                if not fits(1, everyone):
                    return PreemptionDecision(reason=(
                        f"preempting every replica allowed ({total} of lower priority) would not make "
                        f"room for a replica of {claimant.name}"))
            lo, top = 1, need - 1
            while lo < top:
                mid = (lo + top + 1) // 2
                lo, top = (mid, top) if fits(mid, everyone) else (lo, mid - 1)
            need = lo
            request = replace(request, count=need)
        lo = hi // 2 + 1 if hi > 1 else 1
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(need, candidates.first(mid)):
                hi = mid
            else:
                lo = mid + 1
        chosen = candidates.first(lo)
        where = scope(chosen)
        # Drop the victims placement does not need (the last one is needed: the prefix is the shortest).
        for h in reversed(chosen[:-1][-MAX_PRUNE_TRIALS:]):
            rest = [c for c in chosen if c is not h]
            if fits(need, rest, where):
                chosen = rest
        # Another set: the candidates (of those looked at) under where placement puts the replicas
        # when every one of them on those nodes is gone (it may find a domain the preference order
        # reaches late). The cheaper wins.
        names = {n.name for n in where.nodes}
        seen = candidates.looked_at()
        nearby = [h for h in seen if h.placement.members[0].node in names
                  and all(m.node in names for m in h.placement.members)]  # fmt: skip
        held = _without(base if where is inventory else _local(base, where), nearby)
        at = {d for p in self.placer.place_replicas(request, where, held).placements for d in p.devices}
        under = [h for h in nearby if at.intersection(h.placement.devices)]
        if under and fits(need, under):
            rank = {h.replica_id: i for i, h in enumerate(seen)}
            chosen = min((chosen, under), key=lambda vs: self._cost(vs, standings, rank))
        where = scope(chosen)
        plan = self.placer.place_replicas(request, where, _without(base if where is inventory else _local(base, where),
                                                                   chosen))  # fmt: skip
        victims = tuple(Victim(h.replica_id, h.deployment, self._reason(h, claimant, standings, need))
                        for h in chosen)  # fmt: skip
        names = ", ".join(v.replica_id for v in victims)
        return PreemptionDecision(victims, f"preempting {names} for {need} replica(s) of {claimant.name} "
                                           f"(priority {claimant.priority}, below its minimum "
                                           f"{claimant.active}/{claimant.minimum})", plan)  # fmt: skip

    # ----- helpers --------------------------------------------------------------------------------

    def _fits(self, request: PlacementRequest, inventory: Inventory, in_use: Counter[str]) -> bool:
        return self.placer.place_replicas(request, inventory, in_use).complete

    @staticmethod
    def _cost(victims: list[Holder], standings: Mapping[str, Standing], rank: Mapping[str, int]) -> tuple:
        """Of two victim sets, the cheaper has the lower highest priority, then the lower sum of
        priorities, then fewer victims (kube-scheduler's order among nodes: `pickOneNodeForPreemption`,
        pkg/scheduler/framework/preemption/preemption.go), then earlier places in the preference order."""
        priorities = [standings[h.deployment].priority for h in victims]
        return max(priorities), sum(priorities), len(victims), sum(rank[h.replica_id] for h in victims)

    @staticmethod
    def _nobody(claimant: Standing, holders: Sequence[Holder], standings: Mapping[str, Standing]) -> str:
        lower = {h.deployment for h in holders if h.deployment in standings
                 and standings[h.deployment].priority < claimant.priority}  # fmt: skip
        if not lower:
            return f"no replica of a deployment with priority below {claimant.priority} holds devices"
        at_min = ", ".join(f"{n} ({standings[n].active}/{standings[n].minimum})" for n in sorted(lower))
        return f"lower-priority deployments are at their minimum and not preemptible: {at_min}"

    @staticmethod
    def _reason(h: Holder, claimant: Standing, standings: Mapping[str, Standing], need: int) -> str:
        victim = standings[h.deployment]
        below = " (preemptible: may go below its minimum)" if victim.preemptible and victim.active <= victim.minimum \
            else ""
        return (f"preempted for {claimant.name} (priority {claimant.priority} > {victim.priority}), "
                f"{claimant.active}/{claimant.minimum} of its minimum replicas placed, {need} more needed{below}")


def _devices_of(node: NodeInventory) -> set[str]:
    return {g.uuid for g in node.gpus} | {m.uuid for g in node.gpus for m in g.mig_instances}


def _scope(inventory: Inventory, victims: Iterable[Holder], also: Collection[str] = ()) -> Inventory:
    """The inventory's nodes that hold a victim or are named in ``also``, in inventory order."""
    names = {n for h in victims for n in h.placement.nodes} | set(also)
    return Inventory(tuple(n for n in inventory.nodes if n.name in names))


def _local(in_use: Counter[str], scope: Inventory) -> Counter[str]:
    """``in_use`` for the devices of ``scope``'s nodes only (what a trial on them reads: no copy of a
    whole cluster's map per trial)."""
    return Counter({d: n for node in scope.nodes for d in _devices_of(node) if (n := in_use.get(d, 0))})


def _without(in_use: Counter[str], victims: Iterable[Holder], devices: Iterable[str] = ()) -> Counter[str]:
    """A copy of ``in_use`` with the victims' devices (and ``devices``) given up once each."""
    out = Counter(in_use)
    for d in itertools.chain((d for h in victims for d in h.placement.devices), devices):
        if out[d] > 1:
            out[d] -= 1
        else:
            del out[d]
    return out


class _Candidates:
    """Allowed victims in preemption order (lowest priority, least advanced, newest first), at
    most `Standing.spare` of each deployment, sorted lazily: `first` sorts only as far as asked
    (a decision usually needs a few of tens of thousands)."""

    def __init__(self, claimant: Standing, holders: Sequence[Holder], standings: Mapping[str, Standing]) -> None:
        spare = {name: s.spare for name, s in standings.items()
                 if name != claimant.name and s.priority < claimant.priority and s.spare > 0}  # fmt: skip
        self._heap = [((standings[h.deployment].priority, h.progress, -h.created, h.replica_id), h)
                      for h in holders if h.deployment in spare]  # fmt: skip
        heapq.heapify(self._heap)
        counts = Counter(h.deployment for _, h in self._heap)
        self.total = sum(min(n, spare[name]) for name, n in counts.items())
        self._left = spare
        self._sorted: list[Holder] = []

    def first(self, n: int) -> list[Holder]:
        while len(self._sorted) < min(n, self.total):
            _, h = heapq.heappop(self._heap)
            if self._left[h.deployment] > 0:
                self._left[h.deployment] -= 1
                self._sorted.append(h)
        return self._sorted[:n]

    def looked_at(self) -> list[Holder]:
        """The candidates sorted so far (every one `first` returned)."""
        return list(self._sorted)
