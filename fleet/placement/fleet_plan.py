"""The plan of several deployments at once, with priorities: what `fleet plan` shows.

Owns `PlanItem` (one deployment: its placement request, ``spec.priority``, ``spec.preemptible``,
``spec.replicas.min``), `ItemPlan` (where its replicas end up, the replicas it would preempt,
its own replicas preempted, why; the listed GPU products it passed over) and `plan_fleet`.
Pure. Called by `fleet.cli.placement` (``fleet plan``).

It runs the controller's own objects in the controller's order, so that the plan is what
happens when the deployments run (docs/placement.md, "Priorities and preemption"):

1. every deployment's replicas are placed in file order, as the controller's first tick places
   replicas created together (oldest first, `fleet.controller.launch.Launcher`), with the
   placement strategy the controller uses;
2. each deployment left below its ``spec.replicas.min``, higher ``spec.priority`` first, asks
   `fleet.placement.preemption.PreemptionPolicy.decide` (the controller's
   `fleet.controller.preemption.Preemptor` and the trace simulator call the same policy) for
   victims among the replicas placed; the victims' devices go to it and are held off from
   deployments of lower priority (`fleet.placement.preemption.HoldOffs`);
3. the deployments that lost replicas place their replacements on what is left, held-off
   devices excluded, higher priority first; what does not fit waits, with placement's reasons.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from fleet.inventory.model import Inventory, product_key
from fleet.placement.explain import memory_reason
from fleet.placement.preemption import Holder, HoldOffs, PreemptionPolicy, Standing, Victim
from fleet.placement.shapes import PlacementPlan, PlacementRequest, ReplicaPlacement
from fleet.placement.strategies import PlacementStrategy

_NOW_S = 0.0
"""The plan's one instant (hold-offs are in force throughout it)."""


@dataclass(frozen=True)
class PlanItem:
    """One deployment to plan: ``request`` (its replicas, ``count`` of them), its ``priority``,
    ``preemptible`` and ``minimum`` (``spec.priority``, ``spec.preemptible``, ``spec.replicas.min``)."""

    name: str
    request: PlacementRequest
    priority: int = 0
    preemptible: bool = False
    minimum: int = 0


@dataclass
class ItemPlan:
    """Where one deployment's replicas end up. ``plan``: the placement (its ``placements`` are
    the replicas holding devices at the end; its reasons explain the rest); ``preempts``: the
    replicas of lower-priority deployments it takes, each with its reason; ``preempted``: its own
    replicas taken by a higher priority; ``decision``: the preemption policy's line when it was
    asked (why these victims, or why none); ``products_skipped``: one line per listed GPU product
    before the one used, saying why it was passed over."""

    item: PlanItem
    plan: PlacementPlan
    preempts: tuple[Victim, ...] = ()
    preempted: tuple[Victim, ...] = ()
    decision: str = ""
    products_skipped: tuple[str, ...] = field(default_factory=tuple)


def _rid(name: str, i: int) -> str:
    return f"{name}-{i}"


class _Fleet:
    """The devices held while planning: replica id -> `Holder`, and each deployment's next index."""

    def __init__(self, in_use: Counter[str]) -> None:
        self.held: Counter[str] = Counter(in_use)
        self.holders: dict[str, Holder] = {}
        self.next_index: Counter[str] = Counter()
        self.order = itertools.count()

    def add(self, name: str, placements: Sequence[ReplicaPlacement]) -> None:
        for p in placements:
            rid = _rid(name, self.next_index[name])
            self.next_index[name] += 1
            self.holders[rid] = Holder(rid, name, p, 0, float(next(self.order)))
            self.held.update(p.devices)

    def remove(self, rid: str) -> Holder:
        h = self.holders.pop(rid)
        self.held.subtract(h.placement.devices)
        self.held = +self.held
        return h

    def of(self, name: str) -> list[ReplicaPlacement]:
        return [h.placement for h in self.holders.values() if h.deployment == name]


def plan_fleet(items: Sequence[PlanItem], inventory: Inventory, in_use: Counter[str],
               placer: PlacementStrategy) -> list[ItemPlan]:
    """Plan ``items`` (in file order) on ``inventory`` with ``in_use`` already taken (module
    docstring). Returns one `ItemPlan` per item, highest priority first (ties: file order)."""
    fleet = _Fleet(in_use)
    first: dict[str, PlacementPlan] = {}
    for item in items:
        plan = placer.place_replicas(item.request, inventory, fleet.held)
        first[item.name] = plan
        fleet.add(item.name, plan.placements)
    by_priority = sorted(items, key=lambda it: -it.priority)
    out = {it.name: ItemPlan(it, first[it.name]) for it in items}
    hold_offs = HoldOffs()
    policy = PreemptionPolicy(placer)
    for item in by_priority:
        mine = fleet.of(item.name)
        if len(mine) >= min(item.minimum, item.request.count):
            continue
        standings = {it.name: Standing(it.name, it.priority, it.preemptible, it.minimum, len(fleet.of(it.name)))
                     for it in items}
        request = replace(item.request, count=item.request.count - len(mine), existing=tuple(mine))
        blocked = hold_offs.blocked(item.name, item.priority, _NOW_S)
        decision = policy.decide(request, standings[item.name], inventory, fleet.held + blocked,
                                 list(fleet.holders.values()), standings)
        out[item.name].decision = decision.reason
        if not decision.preempts or decision.plan is None:
            continue
        for v in decision.victims:
            h = fleet.remove(v.replica_id)
            hold_offs.add(h.placement.devices, item.name, item.priority, _NOW_S)
            out[v.deployment].preempted += (v,)
        out[item.name].preempts = decision.victims
        fleet.add(item.name, decision.plan.placements)
    for item in by_priority:   # the victims' replacements, on what is left
        if out[item.name].preempted:
            mine = fleet.of(item.name)
            lost = item.request.count - len(mine)
            blocked = hold_offs.blocked(item.name, item.priority, _NOW_S)
            again = placer.place_replicas(replace(item.request, count=lost, existing=tuple(mine)), inventory,
                                          fleet.held + blocked)
            fleet.add(item.name, again.placements)
    for item in items:
        out[item.name].plan = _final(item, first[item.name], fleet, hold_offs, inventory, placer)
        out[item.name].products_skipped = products_skipped(out[item.name].plan, inventory, fleet.held)
    return [out[it.name] for it in by_priority]


def _final(item: PlanItem, first: PlacementPlan, fleet: _Fleet, hold_offs: HoldOffs, inventory: Inventory,
           placer: PlacementStrategy) -> PlacementPlan:
    """``item``'s plan as it ends: the replicas holding devices, and for the rest placement's
    reasons on the devices left (held-off ones included as taken)."""
    mine = tuple(fleet.of(item.name))
    if mine == first.placements:
        return first
    left = item.request.count - len(mine)
    product = first.product or (mine[0].product if mine else None)
    if left <= 0:
        return replace(first, placements=mine, product=product, reasons=(), advice=(), note="")
    blocked = hold_offs.blocked(item.name, item.priority, _NOW_S)
    rest = placer.place_replicas(replace(item.request, count=left, existing=mine), inventory, fleet.held + blocked)
    return replace(rest, request=item.request, placements=mine + rest.placements, product=product or rest.product)


def products_skipped(plan: PlacementPlan, inventory: Inventory, in_use: Counter[str]) -> tuple[str, ...]:
    """Why each GPU product ``spec.resources.gpuProduct`` lists before the one ``plan`` used was
    passed over, one line each: its memory cannot hold the model (`memory_reason`, with the
    numbers), the inventory has none of it, the nodes that have it cannot run the engine (the
    plan's ``skipped`` classes), or it has room for fewer of the replicas than the one used.
    () when the plan used the first listed product, or none."""
    listed = plan.request.shape.gpu_products
    if not plan.product or len(listed) < 2:
        return ()
    used = product_key(plan.product)
    first_gpu = inventory.products
    lines = []
    for name in listed:
        key = product_key(name)
        if key == used:
            break
        gpu = first_gpu.get(key)
        if gpu is None:
            lines.append(f"{name}: no node of the inventory has it")
            continue
        if plan.request.memory is not None and (why := memory_reason(plan.request.memory, plan.request.shape, gpu)):
            lines.append(f"{name}: {why}")
            continue
        nodes = [n for n in inventory.nodes if any(g.product_key == key for g in n.gpus)]
        if all(plan.request.node_excluded(n) for n in nodes):
            lines.append(f"{name}: {plan.request.node_excluded(nodes[0])}")
            continue
        free = sum(1 for n in nodes for g in n.gpus if g.product_key == key and not in_use[g.uuid]
                   and g.health.healthy and not g.mig_enabled)
        lines.append(f"{name}: room for fewer of the {plan.request.count} replica(s) ({free} GPU(s) free)")
    return tuple(f"{line}; used {plan.product}" for line in lines)
