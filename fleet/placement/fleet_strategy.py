"""The ``fleet`` placement strategy (the default): warm first, spread over failure domains, then
best fit.

Owns `FleetStrategy`: warm nodes first (image and weights, then weights, then image:
`PlacementRequest.warmth`); then spread: no zone beyond an even share of the version's
replicas, no rack beyond a quarter of them (at least one); then best fit (the NVLink domain or
MIG GPU with the fewest free units that still fits, so a free 8-GPU domain is not broken for a
TP=2 replica while a partly used one fits), leftover-aware: a domain the replica would leave
with free GPUs too few for any of `PlacementRequest.fill_shapes` comes after those it would not
(`PlacementRequest.strands`); then nodes with fewer replicas of the deployment; then fuller
nodes. It ranks through the hooks of `fleet.placement.strategies.PlacementStrategy`, which
owns the decision every strategy shares; `_ShareRanking` and `_place_indexed` give the same
picks faster (1,000 replicas on 10,000 nodes: docs/placement.md). Registered by name when
`fleet.placement` is imported; reached through `fleet.placement.strategies.get_strategy`.
Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from collections.abc import Hashable, Mapping, Sequence
from typing import ClassVar

from fleet.inventory.model import Inventory, product_key
from fleet.placement import victims
from fleet.placement.candidates import maybe_warm_nodes
from fleet.placement.context import Context
from fleet.placement.freeindex import FreeIndex, FreeState
from fleet.placement.shapes import WARM, PlacementRequest, ReplicaPlacement
from fleet.placement.slots import Slot, SlotIndex, assign
from fleet.placement.strategies import GroupRanking, PlacementStrategy


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
        maybe_warm = maybe_warm_nodes(request, state)
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
