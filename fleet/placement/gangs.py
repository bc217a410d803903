"""Gangs: a replica wider than a node, placed over several nodes at once, all or nothing.

Owns the gang shape of a request (`gang_shape`: how many nodes, how many GPUs on each), which
nodes may form a gang together (`blocks_of`: one multi-node NVLink fabric, or one network
block), how many gangs fit now (`gang_capacity`, for choosing a product) and the gang loop
(`place_gangs`) that the strategies' `gang_member_key` / `gang_rank` hooks steer.
Called by `fleet.placement.strategies`. Pure.

A replica is a gang when its tensor parallel size exceeds the GPUs of its product on any one
node. Each member then holds ``per_node`` GPUs inside one NVLink domain of its node, where
``per_node`` is the largest divisor of the tensor parallel size that fits in the largest
NVLink domain of that product (TP=16 on 8-GPU NVSwitch nodes: 2 members of 8). Every replica
of a version has the same gang shape (it is taken from the existing replicas when there are
some). A gang is placed whole or not at all: members are chosen first, devices taken after.
"""

from __future__ import annotations

import weakref
from collections import Counter, defaultdict
from collections.abc import Hashable
from typing import TYPE_CHECKING, Protocol

from fleet.inventory.model import Inventory, NodeInventory, product_key
from fleet.placement.context import Context
from fleet.placement.shapes import GangShape, PlacementRequest, ReplicaPlacement, ReplicaShape
from fleet.placement.slots import Slot, assign, gpu_slots, product_table

if TYPE_CHECKING:
    from fleet.placement.freeindex import FreeIndex


class GangRanking(Protocol):
    """What the gang loop asks of a placement strategy (`fleet.placement.strategies.PlacementStrategy`
    implements it): how to rank one node's candidate slot for a member needing ``need`` GPUs, and
    how to rank a block's chosen members (lower is better)."""

    def gang_member_key(self, slot: Slot, ctx: Context, need: int) -> tuple: ...

    def gang_rank(self, block: Hashable, members: list[Slot], ctx: Context, need: int) -> tuple: ...


def blocks_of(node: NodeInventory) -> list[Hashable]:
    """The groups of nodes this node may form a gang with: its multi-node NVLink fabric (GB200
    NVL72 style; preferred) and its network block."""
    out: list[Hashable] = []
    if node.nvlink_fabric:
        out.append(("fabric", node.nvlink_fabric))
    if node.network_block:
        out.append(("block", node.network_block))
    return out


def block_of(node: NodeInventory) -> Hashable:
    """The node's preferred gang group, or None."""
    blocks = blocks_of(node)
    return blocks[0] if blocks else None


def describe_block(block: Hashable) -> str:
    kind, name = block
    return f"NVLink fabric {name}" if kind == "fabric" else f"network block {name}"


def gang_shape(shape: ReplicaShape, inventory: Inventory, pk: str,
               existing: tuple[ReplicaPlacement, ...]) -> GangShape | None:
    """The gang shape of ``shape`` on product ``pk``, or None for a single-node replica."""
    t = shape.tensor_parallel_size
    if shape.kind != "gpus" or t == 1:
        return None
    if existing:
        members = len(existing[0].members)
        return GangShape(t // members, members) if members > 1 else None
    table = product_table(inventory, pk)     # widest node and largest domain, derived once per inventory
    if table.widest_node == 0 or t <= table.widest_node:
        return None
    per_node = max(d for d in range(1, table.largest_domain + 1) if t % d == 0)
    return GangShape(per_node, t // per_node)


def gang_capacity(inventory: Inventory, held: Counter[str], pk: str, gang: GangShape) -> int:
    """About how many gangs fit now (members counted per node's preferred block)."""
    members: Counter[Hashable] = Counter()
    for s in gpu_slots(inventory, held, pk):
        block = block_of(s.node)
        if block is not None:
            members[block] += s.capacity // gang.per_node
    return sum(n // gang.nodes for n in members.values())


def place_gangs(strategy: GangRanking, request: PlacementRequest, inventory: Inventory,
                held: Counter[str], product: str, gang: GangShape, ctx: Context) -> list[ReplicaPlacement]:
    """Place up to ``request.count`` gangs; each whole or not at all. Updates ``held``. Derives
    the product's slots from ``held`` (O(GPUs)); `place_gangs_indexed` reads a kept index."""
    by_node: dict[str, list[Slot]] = defaultdict(list)
    for s in gpu_slots(inventory, held, product_key(product)):
        by_node[s.node.name].append(s)
        ctx.node_free[s.node.name] += s.capacity

    def take(slot: Slot, n: int) -> list:
        units = slot.free[:n]
        del slot.free[:n]
        return units
    placements = _gang_loop(strategy, request, inventory, by_node, block_order(inventory), product, gang, ctx, take)
    for p in placements:
        held.update(p.devices)
    return placements


def place_gangs_indexed(strategy: GangRanking, request: PlacementRequest, inventory: Inventory, index: FreeIndex,
                        take_unit, product: str, gang: GangShape, ctx: Context) -> list[ReplicaPlacement]:
    """`place_gangs` over the nodes whose slots in ``index`` (`fleet.placement.freeindex`) can
    hold a member now: O(such nodes) a gang, not O(GPUs). ``take_unit(uuid)`` takes a device
    tentatively (the caller gives it back). Same picks as `place_gangs`."""
    need = gang.per_node
    by_node: dict[str, list] = {}
    for s in index.fitting(need):
        name = s.node.name
        if name not in by_node:
            by_node[name] = index.by_node[name]
            ctx.node_free[name] = index.node_free[name]

    def take(slot, n: int) -> list:
        units = slot.free_units(n)
        for u in units:
            take_unit(u.uuid)
        return units
    return _gang_loop(strategy, request, inventory, by_node, block_order(inventory), product, gang, ctx, take)


_BLOCK_ORDER: dict[int, tuple[weakref.ref, dict[Hashable, int]]] = {}


def block_order(inventory: Inventory) -> dict[Hashable, int]:
    """Each gang block's rank in inventory order (first node first), the gang loop's last tie
    break; derived once per inventory object (kept as `fleet.placement.slots.product_table` is)."""
    key = id(inventory)
    entry = _BLOCK_ORDER.get(key)
    if entry is None or entry[0]() is not inventory:
        order: dict[Hashable, int] = {}
        for node in inventory.nodes:
            for block in blocks_of(node):
                order.setdefault(block, len(order))

        def forget(ref: weakref.ref, key: int = key) -> None:
            if _BLOCK_ORDER.get(key, (None,))[0] is ref:
                del _BLOCK_ORDER[key]
        entry = _BLOCK_ORDER[key] = (weakref.ref(inventory, forget), order)
    return entry[1]


def _gang_loop(strategy: GangRanking, request: PlacementRequest, inventory: Inventory, by_node: dict[str, list],
               order: dict[Hashable, int], product: str, gang: GangShape, ctx: Context, take) -> list[ReplicaPlacement]:
    need = gang.per_node
    placements: list[ReplicaPlacement] = []
    for _ in range(request.count):
        members_of: dict[Hashable, list] = defaultdict(list)     # block -> each node's best fitting slot
        for name, slots in by_node.items():
            fitting = [s for s in slots if s.capacity >= need]
            if fitting:
                best_slot = fitting[0] if len(fitting) == 1 else min(
                    fitting, key=lambda s: strategy.gang_member_key(s, ctx, need))
                for block in blocks_of(best_slot.node):
                    members_of[block].append(best_slot)
        best = None
        for block, candidates in members_of.items():
            if len(candidates) < gang.nodes:
                continue
            candidates.sort(key=lambda s: strategy.gang_member_key(s, ctx, need))
            chosen = candidates[: gang.nodes]
            rank = (strategy.gang_rank(block, chosen, ctx, need), order[block])
            if best is None or rank < best[0]:
                best = (rank, block, chosen)
        if best is None:
            break
        _, block, chosen = best
        members = []
        for i, slot in enumerate(chosen):
            units = take(slot, need)
            ctx.node_free[slot.node.name] -= need
            ctx.record(slot.node, block if i == 0 else None, first=i == 0)
            members.append(assign(slot, units))
        placements.append(ReplicaPlacement(tuple(members), product))
    return placements
