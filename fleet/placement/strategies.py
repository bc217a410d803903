"""Placement strategies: turn a `PlacementRequest` and an `Inventory` into a `PlacementPlan`.

Owns the `PlacementStrategy` base class (the registry by name, and the decision every strategy
shares: one product for all replicas of a version, single node or gang, the batch loop, all or
nothing, explanations and MIG advice), and the built-in strategies:

- ``fleet`` (default): warm nodes first; then spread: no zone beyond an even share of the
  version's replicas, no rack beyond a quarter of them (at least one); then best fit (the NVLink domain or MIG GPU with the fewest free
  units that still fits, so a free 8-GPU domain is not broken for a TP=2 replica while a partly
  used one fits); then nodes with fewer replicas of the deployment; then fuller nodes.
- ``first-fit``: the first node, in inventory order, with a domain that fits; lowest GPU
  indexes. The baseline of the benchmark (loadtests/bench_placement.py).

Strategies differ only in their hooks (`group_of`, `rank_groups`, `slot_key`, `pick`,
`gang_member_key`, `gang_rank`); all share `place_replicas`. Called by the controller, `fleet up`
(preflight) and `fleet plan`. Pure: no I/O, no clock; the same inputs give the same plan.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import ClassVar

from fleet.inventory.model import Inventory, NodeInventory, product_key
from fleet.placement import cpu, explain, gangs, mig_advice
from fleet.placement.shapes import (
    PlacementPlan,
    PlacementRequest,
    ReplicaPlacement,
    ReplicaShape,
    Unplaceable,
)
from fleet.placement.slots import Slot, SlotIndex, assign, gpu_slots, mig_slots

DEFAULT_STRATEGY = "fleet"

_REGISTRY: dict[str, type[PlacementStrategy]] = {}


@dataclass
class Context:
    """What a strategy's hooks may read while one request is placed. Spread counts start from
    the version's existing replicas and grow with every replica the batch places."""

    request: PlacementRequest
    warm: dict[str, bool]
    node_free: Counter[str] = field(default_factory=Counter)     # free units of the kind, per node
    node_count: Counter[str] = field(default_factory=Counter)    # replicas of the deployment, per node
    zone_count: Counter[str | None] = field(default_factory=Counter)
    rack_count: Counter[tuple] = field(default_factory=Counter)
    block_count: Counter[Hashable] = field(default_factory=Counter)
    replicas: int = 0                                             # of the version, existing and placed

    def record(self, node: NodeInventory, block: Hashable = None, first: bool = True) -> None:
        """One more replica of the deployment on ``node``. A gang records each member, with
        ``first`` (and its ``block``) only on the first."""
        self.node_count[node.name] += 1
        self.zone_count[node.zone] += 1
        self.rack_count[(node.zone, node.rack)] += 1
        if block is not None:
            self.block_count[block] += 1
        self.replicas += first


class PlacementStrategy:
    """Base class of placement strategies; subclasses register with ``name=...``."""

    name: ClassVar[str] = ""

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            return
        if name in _REGISTRY:
            raise ValueError(f"placement strategy {name!r} is already registered by {_REGISTRY[name]!r}")
        cls.name = name
        _REGISTRY[name] = cls

    # ----- hooks: how candidates are ranked (pure) ----------------------------------------------

    def group_of(self, slot: Slot, ctx: Context) -> Hashable:
        """Slots of one group are compared by `pick`; groups by `rank_groups`."""
        return None

    def rank_groups(self, keys: list[Hashable], ctx: Context) -> list[tuple]:
        """A rank per group key (lower is better), for the groups that can take the replica."""
        return [() for _ in keys]

    def slot_key(self, slot: Slot, ctx: Context) -> tuple:
        return (slot.node_pos, slot.pos)

    def pick(self, index: SlotIndex, group, need: int) -> Slot | None:
        """The group's best slot for ``need`` units."""
        return index.first(group, need)

    def candidate_key(self, slot: Slot, ctx: Context) -> tuple:
        """Orders the best slots of equally ranked groups."""
        return self.slot_key(slot, ctx)

    def gang_member_key(self, slot: Slot, ctx: Context, need: int) -> tuple:
        return (slot.node_pos, slot.pos)

    def gang_rank(self, block: Hashable, members: list[Slot], ctx: Context, need: int) -> tuple:
        return ()

    # ----- the shared decision -------------------------------------------------------------------

    def place_replicas(self, request: PlacementRequest, inventory: Inventory,
                       in_use: Counter[str] | None = None) -> PlacementPlan:
        """Place ``request.count`` replicas in one decision.

        Args:
            request: the shape, how many, the version's existing replicas, warm nodes.
            inventory: the nodes.
            in_use: device id (GPU/MIG UUID, ``cpu:N``) -> replicas holding it. Not modified.

        Returns:
            A `PlacementPlan`: one `ReplicaPlacement` per placed replica (at most
            ``request.count``; none when ``all_or_nothing`` and not all fit), and when some are
            left, the reasons by node class and, for MIG shapes, repartition advice.
        """
        held: Counter[str] = Counter(in_use or {})
        shape = request.shape
        if request.count <= 0:
            return PlacementPlan(request, strategy=self.name)
        if shape.kind == "mig" and shape.tensor_parallel_size != 1:
            return PlacementPlan(request, strategy=self.name, note=(
                f"tensor parallel size must be 1 on MIG (got {shape.tensor_parallel_size}): MIG slices have "
                "no NVLink or CUDA IPC, so tensor parallelism across slices is not possible"))
        if shape.kind == "cpu":
            placements = cpu.place_cpu(request, inventory, held)
            product = None
            gang = None
        else:
            product = _choose_product(request, inventory, held)
            gang = gangs.gang_shape(shape, inventory, product_key(product), request.existing) if product else None
            if product is None:
                placements = []
            elif gang is not None:
                placements = gangs.place_gangs(self, request, inventory, held, product, gang, self._context(request, inventory))
            else:
                placements = self._place_single(request, inventory, held, product)
        note = ""
        if request.all_or_nothing and 0 < len(placements) < request.count:
            # Explained on the state with the tentative placements: why the rest did not fit.
            note = f"all or nothing: only {len(placements)} of {request.count} fit, none placed"
            placements = []
        elif not inventory.nodes:
            note = "the inventory has no nodes"
        reasons: tuple = ()
        advice: tuple = ()
        if len(placements) < request.count:
            reasons = explain.by_node_class(request, inventory, held, product, gang)
            if shape.kind == "mig":
                advice = mig_advice.advise(request, inventory, held, product, request.count - len(placements))
        return PlacementPlan(request, tuple(placements), product, reasons, advice, self.name, note, gang)

    def fits_at_all(self, shape: ReplicaShape, inventory: Inventory) -> Unplaceable | None:
        """Why one replica of ``shape`` can never fit, even on empty nodes; None when it can."""
        plan = self.place_replicas(PlacementRequest(shape), inventory, Counter())
        return None if plan.complete else Unplaceable(plan.explain())

    def _context(self, request: PlacementRequest, inventory: Inventory) -> Context:
        ctx = Context(request, {n.name: request.is_warm(n) for n in inventory.nodes})
        for p in request.existing:
            for i, name in enumerate(p.nodes):
                node = inventory.by_name.get(name)
                if node is not None:
                    ctx.record(node, gangs.block_of(node) if i == 0 and len(p.members) > 1 else None, first=i == 0)
        return ctx

    def _place_single(self, request: PlacementRequest, inventory: Inventory, held: Counter[str],
                      product: str) -> list[ReplicaPlacement]:
        shape = request.shape
        pk = product_key(product)
        if shape.kind == "mig":
            slots, need = mig_slots(inventory, held, pk, shape.mig_profile), 1
        else:
            slots, need = gpu_slots(inventory, held, pk), shape.tensor_parallel_size
        ctx = self._context(request, inventory)
        for s in slots:
            ctx.node_free[s.node.name] += s.capacity
        index = SlotIndex(slots, lambda s: self.group_of(s, ctx), lambda s: self.slot_key(s, ctx))
        # Each group's best slot and its key; only the group a replica went to changes.
        best: dict[Hashable, tuple[tuple, Slot]] = {}
        for g in index.groups.values():
            if (s := self.pick(index, g, need)) is not None:
                best[g.key] = (self.candidate_key(s, ctx), s)
        placements = []
        for _ in range(request.count):
            if not best:
                break
            keys = list(best)
            ranks = self.rank_groups(keys, ctx)
            top = min(ranks)
            # Equally ranked groups compete on their best slots (best fit across racks, say).
            slot = min((best[k] for k, r in zip(keys, ranks) if r == top), key=lambda c: c[0])[1]
            ctx.node_free[slot.node.name] -= need
            ctx.record(slot.node)
            units = index.take(slot, need)
            group = index.groups[slot.group]
            if (s := self.pick(index, group, need)) is not None:
                best[slot.group] = (self.candidate_key(s, ctx), s)
            else:
                del best[slot.group]
            placement = ReplicaPlacement((assign(slot, units),), product)
            held.update(placement.devices)
            placements.append(placement)
        return placements


def _choose_product(request: PlacementRequest, inventory: Inventory, held: Counter[str]) -> str | None:
    """The GPU product every replica of this version uses (homogeneity).

    The spec's ``gpuProduct`` if set, else the product of the version's existing replicas, else
    the product that can host most of the batch now (ties: more of it on warm nodes, then more
    capacity, then inventory order). None when no product can host even one replica (the
    explanation then covers each node's own products).
    """
    shape = request.shape
    if shape.gpu_product:
        return shape.gpu_product
    for p in request.existing:
        if p.product:
            return p.product
    best: tuple | None = None
    seen: dict[str, str] = {}
    for node in inventory.nodes:
        for g in node.gpus:
            seen.setdefault(g.product_key, g.product)
    for order, (pk, name) in enumerate(seen.items()):
        total, warm = _capacity(request, inventory, held, name)
        if total == 0:
            continue
        score = (min(total, request.count), warm, total, -order)
        if best is None or score > best[0]:
            best = (score, name)
    return best[1] if best else None


def _capacity(request: PlacementRequest, inventory: Inventory, held: Counter[str], product: str) -> tuple[int, int]:
    """(replicas of the shape that fit now, of which on warm nodes), for one product."""
    shape = request.shape
    pk = product_key(product)
    if shape.kind == "mig":
        per_slot = [(s, s.capacity) for s in mig_slots(inventory, held, pk, shape.mig_profile)]
    else:
        gang = gangs.gang_shape(shape, inventory, pk, ())
        if gang is not None:
            n = gangs.gang_capacity(inventory, held, pk, gang)
            return n, 0
        t = shape.tensor_parallel_size
        per_slot = [(s, s.capacity // t) for s in gpu_slots(inventory, held, pk)]
    total = sum(n for _, n in per_slot)
    warm = sum(n for s, n in per_slot if request.is_warm(s.node))
    return total, warm


class FleetStrategy(PlacementStrategy, name="fleet"):
    """Warm first, spread over failure domains, then best fit; see the module docstring."""

    def group_of(self, slot: Slot, ctx: Context) -> Hashable:
        return (ctx.warm[slot.node.name], slot.node.zone, slot.node.rack)

    rack_max_share: ClassVar[float] = 0.25

    def rank_groups(self, keys: list[Hashable], ctx: Context) -> list[tuple]:
        """(cold, replicas over the zone's share, replicas over the rack's share).

        A zone's share of the version's replicas is even: ``ceil(n / zones that can take one)``
        for the n-th replica (zone counts never differ by more than one). A rack's share is a
        quarter of the replicas, at least one: the first four replicas go to four racks, and
        losing one rack never takes more than a quarter of a large deployment. Within their
        shares, domains are equal and best fit decides; a stricter even spread over racks was
        measured to cost TP=8 headroom (docs/placement.md).
        """
        n = ctx.replicas + 1
        zone_share = -(-n // max(1, len({zone for _, zone, _ in keys})))
        rack_share = max(1, math.ceil(n * self.rack_max_share))
        return [
            (not warm, max(0, ctx.zone_count[zone] + 1 - zone_share),
             max(0, ctx.rack_count[(zone, rack)] + 1 - rack_share))
            for warm, zone, rack in keys
        ]

    def slot_key(self, slot: Slot, ctx: Context) -> tuple:
        name = slot.node.name
        return (ctx.node_count[name], slot.other_free, ctx.node_free[name], slot.node_pos, slot.pos)

    def pick(self, index: SlotIndex, group, need: int) -> Slot | None:
        return index.best_fit(group, need)

    def candidate_key(self, slot: Slot, ctx: Context) -> tuple:
        return (slot.capacity, *self.slot_key(slot, ctx))

    def gang_member_key(self, slot: Slot, ctx: Context, need: int) -> tuple:
        return (not ctx.warm[slot.node.name], slot.capacity - need, ctx.node_free[slot.node.name], slot.node_pos, slot.pos)

    def gang_rank(self, block: Hashable, members: list[Slot], ctx: Context, need: int) -> tuple:
        cold = sum(1 for s in members if not ctx.warm[s.node.name])
        leftover = sum(s.capacity - need for s in members)
        return (cold, block[0] != "fabric", ctx.block_count[block], leftover)


class FirstFitStrategy(PlacementStrategy, name="first-fit"):
    """The first fitting node in inventory order, lowest GPU indexes (benchmark baseline)."""


def strategy_names() -> list[str]:
    """Names of the registered placement strategies, sorted."""
    return sorted(_REGISTRY)


def get_strategy(name: str = DEFAULT_STRATEGY) -> PlacementStrategy:
    """A new strategy instance. Raises KeyError listing the known names."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise KeyError(f"unknown placement strategy {name!r}; known: {', '.join(strategy_names())}") from None
