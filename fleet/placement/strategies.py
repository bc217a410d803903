"""Placement strategies: turn a `PlacementRequest` and an `Inventory` into a `PlacementPlan`.

Owns the `PlacementStrategy` base class (the registry by name, and the decision every strategy
shares: one product for all replicas of a version, single node or gang, the batch loop, all or
nothing, explanations and MIG advice), and the built-in strategies:

- ``fleet`` (default): warm nodes first (image and weights, then weights, then image:
  `PlacementRequest.warmth`); then spread: no zone beyond an even share of the
  version's replicas, no rack beyond a quarter of them (at least one); then best fit (the NVLink domain or MIG GPU with the fewest free
  units that still fits, so a free 8-GPU domain is not broken for a TP=2 replica while a partly
  used one fits), leftover-aware: a domain the replica would leave with free GPUs too few for
  any of `PlacementRequest.fill_shapes` comes after those it would not (`PlacementRequest.strands`);
  then nodes with fewer replicas of the deployment; then fuller nodes.
- ``first-fit``: the first node, in inventory order, with a domain that fits; lowest GPU
  indexes. The baseline of the benchmark (loadtests/bench_placement.py).

Every strategy sees only the nodes a request may use at all (`_eligible`: today, nodes whose
NVIDIA driver can run the engine's CUDA, `fleet.placement.compat`); the others are explained
with their reason. Strategies differ only in their hooks (`group_of`, `rank_groups`, `slot_key`, `pick`,
`gang_member_key`, `gang_rank`; `ranking` may keep `rank_groups` incrementally, as ``fleet``
does, for speed only); all share `place_replicas`. Called by the controller, `fleet up`
(preflight) and `fleet plan`. Pure: no I/O, no clock; the same inputs give the same plan.
"""

from __future__ import annotations

import heapq
import itertools
import math
import weakref
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import ClassVar

from fleet.inventory.model import Inventory, NodeInventory, product_key
from fleet.models.memory import MemoryNeed
from fleet.placement import cpu, explain, gangs, mig_advice, victims
from fleet.placement.compat import CudaNeed
from fleet.placement.context import Context
from fleet.placement.freeindex import FreeIndex, FreeState, free_state
from fleet.placement.shapes import (
    NodeClass,
    PlacementPlan,
    PlacementRequest,
    WARM,
    ReplicaPlacement,
    ReplicaShape,
    Unplaceable,
    canonical_source,
)
from fleet.placement.slots import Slot, SlotIndex, assign, gpu_slots, mig_slots
from fleet.sources import redact_source
from fleet.base.registry import Registered, Registry

DEFAULT_STRATEGY = "fleet"

PLACEMENT_STRATEGIES: Registry[PlacementStrategy] = Registry("placement strategy")
"""The placement strategies by name (`fleet.base.registry`)."""


class PlacementStrategy(Registered, registry=PLACEMENT_STRATEGIES):
    """Base class of placement strategies; subclasses register with ``name=...`` (`fleet.base.registry`)."""

    # ----- hooks: how candidates are ranked (pure) ----------------------------------------------

    def group_of(self, slot: Slot, ctx: Context) -> Hashable:
        """Slots of one group are compared by `pick`; groups by `rank_groups`."""
        return None

    def rank_groups(self, keys: list[Hashable], ctx: Context) -> list[tuple]:
        """A rank per group key (lower is better), for the groups that can take the replica."""
        return [() for _ in keys]

    def slot_key(self, slot: Slot, ctx: Context) -> tuple:
        return (slot.node_pos, slot.pos)

    def pick(self, index: SlotIndex, group, need: int, ctx: Context | None = None) -> Slot | None:
        """The group's best slot for ``need`` units."""
        return index.first(group, need)

    def ranking(self, ctx: Context) -> GroupRanking:
        """What chooses among the groups' best slots during a batch: `GroupRanking` (calls
        `rank_groups` on every group at every pick) unless a strategy keeps it incrementally."""
        return GroupRanking(self, ctx)

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
        shape = request.shape
        if request.count <= 0:
            return PlacementPlan(request, strategy=self.name)
        everything = inventory
        inventory, excluded = _eligible(request, inventory)
        if shape.kind == "mig" and shape.tensor_parallel_size != 1:
            return PlacementPlan(request, strategy=self.name, note=(
                f"tensor parallel size must be 1 on MIG (got {shape.tensor_parallel_size}): MIG slices have "
                "no NVLink or CUDA IPC, so tensor parallelism across slices is not possible"))
        held: Counter[str] = Counter(in_use or {})
        if shape.kind == "cpu":
            placements = cpu.place_cpu(request, inventory, held)
            product = None
            gang = None
        else:
            state = free_state(inventory)
            with state.lock:
                state.bind(in_use)
                product = _choose_product(request, inventory, state)
                gang = gangs.gang_shape(shape, inventory, product_key(product), request.existing) if product else None
                placements = None
                if product is not None and gang is None:
                    placements = self._place_indexed(request, inventory, state, product)
                elif product is not None:
                    taken: list[str] = []

                    def take_unit(uuid: str) -> None:
                        state.set_held(uuid, True)
                        taken.append(uuid)
                    try:
                        placements = gangs.place_gangs_indexed(
                            self, request, inventory, state.index(product_key(product), None), take_unit, product,
                            gang, self._context(request, inventory, lazy=True))
                    finally:
                        for uuid in taken:
                            state.set_held(uuid, False)
            if product is None:
                placements = []
            elif placements is None:
                placements = self._place_single(request, inventory, held, product)
            else:
                for p in placements:
                    held.update(p.devices)
        note = ""
        if request.all_or_nothing and 0 < len(placements) < request.count:
            # Explained on the state with the tentative placements: why the rest did not fit.
            note = f"all or nothing: only {len(placements)} of {request.count} fit, none placed"
            placements = []
        elif not everything.nodes:
            note = "the inventory has no nodes"
        reasons: tuple = ()
        advice: tuple = ()
        if len(placements) < request.count:
            reasons = explain.by_node_class(request, inventory, held, product, gang)
            if excluded:
                reasons = tuple(sorted((*reasons, *excluded), key=lambda c: (-len(c.nodes), c.reason)))
            if shape.kind == "mig":
                advice = mig_advice.advise(request, inventory, held, product, request.count - len(placements))
        return PlacementPlan(request, tuple(placements), product, reasons, advice, self.name, note, gang, excluded)

    def _place_indexed(self, request: PlacementRequest, inventory: Inventory, state: FreeState,
                       product: str) -> list[ReplicaPlacement] | None:
        """The replicas placed from the kept index (`fleet.placement.freeindex`), or None where a
        strategy has no such path or judges the full build cheaper (then `_place_single` runs)."""
        return None

    def drain_order(self, placements: Sequence[ReplicaPlacement], count: int, inventory: Inventory,
                    in_use: Mapping[str, int]) -> list[int]:
        """Which ``count`` of a version's replicas to drain on a scale-down, best first: indexes
        into ``placements`` (oldest first). ``in_use`` holds every replica's devices. Here: the
        newest first; ``fleet`` frees NVLink domains whole (`fleet.placement.victims`)."""
        n = len(placements)
        return list(range(n - 1, n - 1 - min(count, n), -1))

    def fits_at_all(self, shape: ReplicaShape, inventory: Inventory, memory: MemoryNeed | None = None,
                    cuda: CudaNeed | None = None) -> Unplaceable | None:
        """Why one replica of ``shape`` (of a model needing ``memory``, of an engine needing
        ``cuda`` of a node's driver: each when known) can never fit, even on empty nodes; None
        when it can."""
        plan = self.place_replicas(PlacementRequest(shape, memory=memory, cuda=cuda), inventory, Counter())
        return None if plan.complete else Unplaceable(plan.explain())

    def _context(self, request: PlacementRequest, inventory: Inventory, lazy: bool = False) -> Context:
        """The context with the existing replicas recorded; ``lazy``: warmth looked up per node
        when first read (for loops that read few nodes), else for every node now."""
        warm = _Warmth(request, inventory) if lazy else {n.name: request.warmth(n) for n in inventory.nodes}
        ctx = Context(request, warm)
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
        ranking = self.ranking(ctx)
        for g in index.groups.values():
            if (s := self.pick(index, g, need, ctx)) is not None:
                ranking.set(g.key, (self.candidate_key(s, ctx), s))
        placements = []
        for _ in range(request.count):
            slot = ranking.pick()
            if slot is None:
                break
            ctx.node_free[slot.node.name] -= need
            ctx.record(slot.node)
            units = index.take(slot, need)
            group = index.groups[slot.group]
            s = self.pick(index, group, need, ctx)
            ranking.set(slot.group, (self.candidate_key(s, ctx), s) if s is not None else None)
            placement = ReplicaPlacement((assign(slot, units),), product)
            held.update(placement.devices)
            placements.append(placement)
        return placements


class _Warmth(dict):
    """node name -> `PlacementRequest.warmth`, computed on first read."""

    def __init__(self, request: PlacementRequest, inventory: Inventory) -> None:
        super().__init__()
        self.request = request
        self.by_name = inventory.by_name

    def __missing__(self, name: str) -> int:
        w = self[name] = self.request.warmth(self.by_name[name])
        return w


# id(inventory) -> (weak reference to it, CudaNeed -> (the eligible nodes, the excluded by reason))
_ELIGIBLE: dict[int, tuple[weakref.ref, dict[Hashable, tuple[Inventory, tuple[NodeClass, ...]]]]] = {}


def _eligible(request: PlacementRequest, inventory: Inventory) -> tuple[Inventory, tuple[NodeClass, ...]]:
    """The nodes ``request`` may use at all, and the others grouped by why not
    (`PlacementRequest.node_excluded`: a driver that cannot run the engine's CUDA).

    The node filter of placement: strategies, product choice, gangs and MIG advice see only the
    eligible nodes. With nothing excluded that is ``inventory`` itself; otherwise an `Inventory`
    of the eligible nodes in the same order, kept per inventory object (weakly, as
    `fleet.placement.slots.product_table` keeps its tables) and per CUDA need, so the per-inventory
    tables of slots are reused across calls as they are for the full inventory.
    """
    if request.cuda is None or request.shape.kind == "cpu":
        return inventory, ()
    key = id(inventory)
    entry = _ELIGIBLE.get(key)
    if entry is None or entry[0]() is not inventory:
        def forget(ref: weakref.ref, key: int = key, views: dict = _ELIGIBLE) -> None:
            if views.get(key, (None,))[0] is ref:   # the dict bound here: module globals are gone at exit
                del views[key]
        entry = _ELIGIBLE[key] = (weakref.ref(inventory, forget), {})
    found = entry[1].get(request.cuda)
    if found is None:
        keep = []
        why: dict[str, list[str]] = {}
        by_driver: dict[tuple, str | None] = {}   # nodes share a handful of drivers: judge each once
        for node in inventory.nodes:
            facts = (node.driver_version, node.cuda_driver_version, bool(node.gpus))
            if facts not in by_driver:
                by_driver[facts] = request.node_excluded(node)
            reason = by_driver[facts]
            if reason is None:
                keep.append(node)
            else:
                why.setdefault(reason, []).append(node.name)
        view = inventory if len(keep) == len(inventory.nodes) else Inventory(tuple(keep))
        classes = sorted((NodeClass(r, tuple(n)) for r, n in why.items()), key=lambda c: (-len(c.nodes), c.reason))
        found = entry[1][request.cuda] = (view, tuple(classes))
    return found


class GroupRanking:
    """The groups' best slots during a batch, and the pick among them: the best slot of the
    groups that `rank_groups` ranks lowest, by candidate key (equally ranked groups compete on
    their best slots: best fit across racks, say). Calls `rank_groups` on every group at every
    pick: O(groups) a replica."""

    def __init__(self, strategy: PlacementStrategy, ctx: Context) -> None:
        self.strategy = strategy
        self.ctx = ctx
        self.best: dict[Hashable, tuple[tuple, Slot]] = {}   # group key -> (candidate key, its best slot)

    def set(self, key: Hashable, entry: tuple[tuple, Slot] | None) -> None:
        """The group's best slot changed (None: it can take no more replicas of the batch)."""
        if entry is None:
            self.best.pop(key, None)
        else:
            self.best[key] = entry

    def pick(self) -> Slot | None:
        if not self.best:
            return None
        keys = list(self.best)
        ranks = self.strategy.rank_groups(keys, self.ctx)
        top = min(ranks)
        return min((self.best[k] for k, r in zip(keys, ranks) if r == top), key=lambda c: c[0])[1]


def _choose_product(request: PlacementRequest, inventory: Inventory, state: FreeState) -> str | None:
    """The GPU product every replica of this version uses (homogeneity).

    The product of the version's existing replicas if any; else, with ``gpuProduct`` a single
    name, that name; with a list (most preferred first), the first listed product that can host
    the whole batch now, else the listed one that hosts most of it (ties: list order), else
    (none can host one) the first listed, whose explanation then says why; with no product named,
    the product that can host most of the batch now (ties: more of it on warm nodes, then more
    capacity, then inventory order). None when no product can host even one replica (the
    explanation then covers each node's own products). With ``request.memory``, a product whose
    GPU (or MIG instance) memory cannot hold the model is never chosen: the existing replicas'
    product, or every listed one, then gives None (`explain.memory_reason` says why).
    ``inventory`` holds only the nodes the request may use (`_eligible`); ``state`` is its
    `FreeState`, bound to the devices in use.
    """
    shape = request.shape
    first = inventory.products   # product key -> its first GPU; derived once per inventory

    def holds(product: str) -> bool:
        gpu = first.get(product_key(product))
        return request.memory is None or gpu is None or explain.memory_reason(request.memory, shape, gpu) is None

    for p in request.existing:
        if p.product:
            return p.product if holds(p.product) else None
    if shape.gpu_products:
        # Spelled as the inventory spells it where it has it (GFD's label writes dashes: the
        # Kubernetes engine pod selects that label, fleet.k8s.pods.product_selector).
        listed = [first[k].product if (k := product_key(p)) in first else p for p in shape.gpu_products]
        fitting = [name for name in listed if holds(name)]
        if len(fitting) <= 1:
            return fitting[0] if fitting else None
        scored = [(min(_capacity(request, inventory, state, name)[0], request.count), -order, name)
                  for order, name in enumerate(fitting)]
        best = max(scored)
        return best[2] if best[0] > 0 else fitting[0]
    best: tuple | None = None
    for order, gpu in enumerate(first.values()):
        name = gpu.product
        if not holds(name):
            continue
        total, warm = _capacity(request, inventory, state, name)
        if total == 0:
            continue
        score = (min(total, request.count), warm, total, -order)
        if best is None or score > best[0]:
            best = (score, name)
    return best[1] if best else None


def _capacity(request: PlacementRequest, inventory: Inventory, state: FreeState, product: str) -> tuple[int, int]:
    """(replicas of the shape that fit now, of which on warm nodes), for one product: from the
    index's slot counts by free capacity, and the slots of the nodes that may be warm."""
    shape = request.shape
    pk = product_key(product)
    if shape.kind == "mig":
        idx, per = state.index(pk, shape.mig_profile), 1
    else:
        gang = gangs.gang_shape(shape, inventory, pk, ())
        if gang is not None:
            return gangs.gang_capacity(inventory, Counter(dict.fromkeys(state.held, 1)), pk, gang), 0
        idx, per = state.index(pk, None), shape.tensor_parallel_size
    total = sum(n * (c // per) for c, n in idx.capacity_counts.items())
    warm = sum(s.capacity // per for node in _maybe_warm(request, state) if request.is_warm(node)
               for s in idx.by_node.get(node.name, ()))
    return total, warm


def _maybe_warm(request: PlacementRequest, state: FreeState) -> list[NodeInventory]:
    """The nodes whose `PlacementRequest.warmth` may differ from a node that caches nothing:
    those in ``warm_nodes`` and those caching the image or the model source (any spelling)."""
    out: dict[str, NodeInventory] = {}
    inventory_nodes = state.cached_by
    keys = [request.image] if request.image else []
    if request.model_source:
        src = canonical_source(request.model_source)
        keys += [request.model_source, src, redact_source(src)]
    for key in keys:
        for node in inventory_nodes.get(key, ()):
            out[node.name] = node
    by_name = state.by_name
    for name in request.warm_nodes:
        node = by_name.get(name)
        if node is not None:
            out[name] = node
    return list(out.values())


class FleetStrategy(PlacementStrategy, name="fleet"):
    """Warm first, spread over failure domains, then best fit; see the module docstring."""

    def group_of(self, slot: Slot, ctx: Context) -> Hashable:
        return (ctx.warm[slot.node.name], slot.node.zone, slot.node.rack)

    rack_max_share: ClassVar[float] = 0.25
    indexed_min_budget: ClassVar[int] = 64
    """`_place_indexed` runs while replicas x (special nodes + replicas) stays within this or a
    quarter of the product's slots, whichever is more (beyond, one full build is cheaper)."""

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
            (WARM - warm, max(0, ctx.zone_count[zone] + 1 - zone_share),
             max(0, ctx.rack_count[(zone, rack)] + 1 - rack_share))
            for warm, zone, rack in keys
        ]

    def ranking(self, ctx: Context) -> GroupRanking:
        # _ShareRanking encodes this class's group_of and rank_groups; a subclass that changes
        # either gets the generic ranking.
        cls = type(self)
        if cls.group_of is FleetStrategy.group_of and cls.rank_groups is FleetStrategy.rank_groups:
            return _ShareRanking(self, ctx)
        return GroupRanking(self, ctx)

    def slot_key(self, slot: Slot, ctx: Context) -> tuple:
        name = slot.node.name
        return (ctx.node_count[name], slot.other_free, ctx.node_free[name], slot.node_pos, slot.pos)

    def pick(self, index: SlotIndex, group, need: int, ctx: Context | None = None) -> Slot | None:
        request = ctx.request if ctx is not None else None
        return index.best_fit(group, need, request.strands if request is not None and request.fill_shapes else None)

    def candidate_key(self, slot: Slot, ctx: Context) -> tuple:
        # Leftover-aware best fit: a slot that would strand its leftover GPUs ranks after those
        # that would not (`PlacementRequest.strands`; always False without ``fill_shapes``).
        request = ctx.request
        strands = request.strands(slot.capacity)
        return (strands, slot.capacity, *self.slot_key(slot, ctx))

    def gang_member_key(self, slot: Slot, ctx: Context, need: int) -> tuple:
        return (WARM - ctx.warm[slot.node.name], slot.capacity - need, ctx.node_free[slot.node.name], slot.node_pos,
                slot.pos)

    def gang_rank(self, block: Hashable, members: list[Slot], ctx: Context, need: int) -> tuple:
        cold = sum(WARM - ctx.warm[s.node.name] for s in members)
        leftover = sum(s.capacity - need for s in members)
        return (cold, block[0] != "fabric", ctx.block_count[block], leftover)


    def drain_order(self, placements: Sequence[ReplicaPlacement], count: int, inventory: Inventory,
                    in_use: Mapping[str, int]) -> list[int]:
        return victims.whole_domains_first(placements, count, inventory, in_use)

    def _place_indexed(self, request: PlacementRequest, inventory: Inventory, state: FreeState,
                       product: str) -> list[ReplicaPlacement] | None:
        """The same picks as `_place_single` with `_ShareRanking`, from the kept index.

        `_place_single` picks the slot with the smallest (rank of its (warm, zone, rack) group,
        free units, `slot_key`) among slots that hold the replica. Here that minimum is found
        without looking at most slots: a node that caches nothing the request names and holds
        no replica of the deployment has the base warmth and a node count of 0, so among such
        nodes of one zone in racks under their share, the index's per-zone heap (free units, then
        `FreeIndex.static_key`) gives the best slot. The other slots are ranked one by one: those
        of "special" nodes (maybe warm, or holding replicas of the deployment) and those in
        racks at or over their share (at most a few: a rack's share is a quarter of the
        replicas). Each pick costs O(special nodes + racks over share + zones); a batch whose
        special nodes would grow past a quarter of the slots goes to `_place_single` (O(slots)
        once) instead. None then, and for subclasses that change the ranking hooks.
        """
        cls = type(self)
        if any(getattr(cls, hook) is not getattr(FleetStrategy, hook)
               for hook in ("group_of", "rank_groups", "slot_key", "pick", "candidate_key", "ranking")):
            return None
        shape = request.shape
        pk = product_key(product)
        if shape.kind == "mig":
            idx, need = state.index(pk, shape.mig_profile), 1
        else:
            idx, need = state.index(pk, None), shape.tensor_parallel_size
        maybe_warm = _maybe_warm(request, state)
        holders = {name for p in request.existing for name in p.nodes}
        count = request.count
        work = count * (len(maybe_warm) + len(holders) + count)
        if work > max(self.indexed_min_budget, len(idx.slots) // 4) or len(idx.zones) > 64:
            return None
        base = 1 if request.image is None else 0              # warmth of a node caching nothing
        warmth = {n.name: w for n in maybe_warm if (w := request.warmth(n)) != base}
        ctx = Context(request, warmth)
        for p in request.existing:
            for i, name in enumerate(p.nodes):
                node = inventory.by_name.get(name)
                if node is not None:
                    ctx.record(node, first=i == 0)
        taken: list[str] = []
        placements: list[ReplicaPlacement] = []
        try:
            for _ in range(count):
                slot = self._indexed_pick(idx, ctx, need, base)
                if slot is None:
                    break
                units = slot.free_units(need)
                for u in units:
                    state.set_held(u.uuid, True)
                    taken.append(u.uuid)
                ctx.record(slot.node)
                placements.append(ReplicaPlacement((assign(slot, units),), product))
        finally:
            for uuid in taken:
                state.set_held(uuid, False)
        return placements

    def _indexed_pick(self, idx: FreeIndex, ctx: Context, need: int, base: int):
        zones = [z for z in idx.zones if idx.zone_fits(z, need)]
        if not zones:
            return None
        n = ctx.replicas + 1
        zone_share = -(-n // len(zones))
        rack_share = max(1, math.ceil(n * self.rack_max_share))
        zone_count, rack_count, node_count, warmth = ctx.zone_count, ctx.rack_count, ctx.node_count, ctx.warm
        node_free = idx.node_free
        special = warmth.keys() | {name for name, c in node_count.items() if c}
        crowded = {rack for rack, c in rack_count.items() if c + 1 > rack_share}

        strands = ctx.request.strands if ctx.request.fill_shapes and need > 1 else None

        def key(s, cold: int) -> tuple:
            name = s.node.name
            return (cold, max(0, zone_count[s.zone] + 1 - zone_share), max(0, rack_count[s.rack] + 1 - rack_share),
                    strands is not None and strands(s.capacity),
                    s.capacity, node_count[name], s.other_free, node_free[name], s.node_pos, s.pos)

        candidates = [(s, WARM - warmth.get(name, base)) for name in special for s in idx.by_node.get(name, ())
                      if s.capacity >= need]
        cold = WARM - base
        candidates += [(s, cold) for rack in crowded for s in idx.by_rack.get(rack, ())
                       if s.capacity >= need and s.node.name not in special]
        for zone in zones:
            s = idx.best_in_zone(zone, need, lambda s: s.node.name in special or s.rack in crowded, strands)
            if s is not None:
                candidates.append((s, cold))
        best = min(((key(s, c), s) for s, c in candidates), key=lambda e: e[0], default=None)
        return best[1] if best is not None else None


class _ShareRanking(GroupRanking):
    """`FleetStrategy.rank_groups` kept incrementally: the same pick as `GroupRanking`, without
    ranking every rack group at every pick (1,000 replicas on 10,000 nodes: docs/placement.md).

    A group is (warm, zone, rack). Its rank, (cold, zone over its share, rack over its share),
    is the same for every group of one (warm, zone) but for the rack term, which grows with the
    replicas already in the rack and is 0 below the rack's share. So the groups of each (warm,
    zone) sit in heaps by candidate key, one per replica count of their rack; a pick looks at
    the heads of those heaps in each (warm, zone): the best candidate among racks under their
    share, else the best in the least-loaded rack. Entries are checked when they reach a head:
    a group whose best slot changed is dropped (its new entry was pushed), one whose rack
    gained replicas (from its warm or cold twin) moves to its rack's new count.
    """

    def __init__(self, strategy: FleetStrategy, ctx: Context) -> None:
        super().__init__(strategy, ctx)
        self.rack_max_share = strategy.rack_max_share
        self.zone_groups: Counter[str | None] = Counter()    # zone -> groups with a best slot
        # (warmth, zone) -> replicas in the rack -> heap of (candidate key, seq, group key)
        self.heaps: dict[tuple[int, str | None], dict[int, list[tuple]]] = {}
        self._seq = itertools.count()

    def _rack_count(self, key: Hashable) -> int:
        _, zone, rack = key
        return self.ctx.rack_count[(zone, rack)]

    def set(self, key: Hashable, entry: tuple[tuple, Slot] | None) -> None:
        warm, zone, _ = key
        had = key in self.best
        super().set(key, entry)
        self.zone_groups[zone] += (key in self.best) - had
        if entry is not None:
            by_count = self.heaps.setdefault((warm, zone), {})
            heapq.heappush(by_count.setdefault(self._rack_count(key), []), (entry[0], next(self._seq), key))

    def _head(self, by_count: dict[int, list[tuple]], count: int) -> tuple | None:
        """The live head of the heap for racks with ``count`` replicas, after dropping stale
        entries and moving those whose rack's count grew."""
        heap = by_count[count]
        while heap:
            candidate, _, key = heap[0]
            entry = self.best.get(key)
            if entry is None or entry[0] != candidate:
                heapq.heappop(heap)
            elif (now := self._rack_count(key)) != count:
                heapq.heappush(by_count.setdefault(now, []), heapq.heappop(heap))
            else:
                return heap[0]
        return None

    def _best_in(self, by_count: dict[int, list[tuple]], rack_share: int) -> tuple[int, tuple] | None:
        """(rack over its share, heap entry) of the (warm, zone)'s best group, or None."""
        under = None
        count = -1
        while True:
            later = [c for c, heap in by_count.items() if c > count and heap]
            if not later:
                break
            count = min(later)
            if count >= rack_share and under is not None:
                break
            head = self._head(by_count, count)
            if head is None:
                continue
            if count < rack_share:
                under = head if under is None or head < under else under
            else:
                return count + 1 - rack_share, head
        return (0, under) if under is not None else None

    def pick(self) -> Slot | None:
        if not self.best:
            return None
        ctx = self.ctx
        n = ctx.replicas + 1
        zone_share = -(-n // max(1, sum(1 for c in self.zone_groups.values() if c > 0)))
        rack_share = max(1, math.ceil(n * self.rack_max_share))
        choice: tuple | None = None
        for (warm, zone), by_count in self.heaps.items():
            found = self._best_in(by_count, rack_share)
            if found is None:
                continue
            rack_over, (candidate, _, key) = found
            c = ((WARM - warm, max(0, ctx.zone_count[zone] + 1 - zone_share), rack_over), candidate, key)
            if choice is None or c[:2] < choice[:2]:
                choice = c
        assert choice is not None
        return self.best[choice[2]][1]


class FirstFitStrategy(PlacementStrategy, name="first-fit"):
    """The first fitting node in inventory order, lowest GPU indexes (benchmark baseline)."""


def strategy_names() -> list[str]:
    """Names of the registered placement strategies, sorted."""
    return PLACEMENT_STRATEGIES.names()


def get_strategy(name: str = DEFAULT_STRATEGY) -> PlacementStrategy:
    """A new strategy instance. Raises KeyError listing the known names."""
    return PLACEMENT_STRATEGIES.get(name)()
