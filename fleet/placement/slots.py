"""Free capacity as slots, and the index that placement strategies pick slots from.

Owns `Slot` (one NVLink domain's free GPUs of one product, or one MIG-mode GPU's free instances
of one profile), the builders that derive slots from an `Inventory` and the devices in use
(`gpu_slots`, `mig_slots`), the per-inventory tables those builders read (`product_table`:
which NVLink domains and MIG GPUs hold a product, derived once per `Inventory` object and
reused while that object lives), and `SlotIndex`, which keeps slots bucketed by free capacity
inside strategy-defined groups, so that a batch re-examines only the group it just took from
instead of scanning every node again (1,000 replicas on 10,000 nodes: docs/placement.md).
Used by `fleet.placement.strategies` and `fleet.placement.gangs`. Pure, no I/O.
"""

from __future__ import annotations

import heapq
import itertools
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fleet.inventory.model import Gpu, Inventory, MigInstance, NodeInventory
from fleet.placement.shapes import Assignment


# ----- per-inventory tables --------------------------------------------------------------------

@dataclass(frozen=True)
class DomainSpec:
    """One NVLink domain's GPUs of one product outside MIG mode (what `gpu_slots` makes a slot of)."""

    node: NodeInventory
    node_pos: int                      # the node's index in the inventory
    pos: int                           # the domain's index in ``node.domains``
    name: str                          # "nvlink0", or "gpu3" for a GPU without NVLink peers
    size: int                          # members, healthy or not
    healthy: tuple[Gpu, ...]           # the healthy members, index order: the GPUs a replica may use


@dataclass(frozen=True)
class MigGpuSpec:
    """One healthy MIG-mode GPU with instances of one profile (what `mig_slots` makes a slot of)."""

    node: NodeInventory
    node_pos: int
    gpu: Gpu
    mine: tuple[MigInstance, ...]      # its instances of the profile
    others: tuple[MigInstance, ...]    # its instances of other profiles


@dataclass
class ProductTable:
    """What an inventory holds of one product, independent of what is in use. Every list is in
    inventory order (node, then domain or GPU index), the order placement breaks ties in."""

    domains: list[DomainSpec] = field(default_factory=list)
    widest_node: int = 0               # most GPUs of the product outside MIG mode on one node
    largest_domain: int = 0            # most GPUs of the product outside MIG mode in one NVLink domain
    mig_gpus: list[tuple[int, NodeInventory, Gpu]] = field(default_factory=list)   # healthy, MIG mode
    _mig: dict[str, list[MigGpuSpec]] = field(default_factory=dict)               # by profile, lazily

    def mig(self, profile: str) -> list[MigGpuSpec]:
        """The healthy MIG-mode GPUs of the product with at least one ``profile`` instance
        (derived on the first call per profile, then kept with the table)."""
        specs = self._mig.get(profile)
        if specs is None:
            specs = self._mig[profile] = [
                MigGpuSpec(node, pos, gpu, mine, tuple(m for m in gpu.mig_instances if m.profile != profile))
                for pos, node, gpu in self.mig_gpus
                if (mine := tuple(m for m in gpu.mig_instances if m.profile == profile))
            ]
        return specs


# id(inventory) -> (weak reference to that inventory, product key -> its table)
_TABLES: dict[int, tuple[weakref.ref, dict[str, ProductTable]]] = {}


def product_table(inventory: Inventory, pk: str) -> ProductTable:
    """The `ProductTable` of product key ``pk`` (`fleet.inventory.model.product_key`) in
    ``inventory``.

    Cached per inventory object (by identity, with a weak reference to it) and per product key;
    derived on first use, O(GPUs), and dropped when the inventory is garbage-collected. This is
    sound because an `Inventory` is immutable: it and everything the table reads (its nodes,
    their GPUs, GPU health, MIG instances, NVLink domains) are frozen dataclasses and tuples, and
    every producer (inventory files, GFD, NVML, the controller's and ``fleet up``'s local node)
    builds a new `Inventory` when anything changes, which gets tables of its own. The entry is
    checked against the weak reference, so an id reused by a later object never hits a stale
    entry. Nothing here depends on the devices in use: the in-use map is read afresh on every
    call (`gpu_slots`, `mig_slots`).
    """
    key = id(inventory)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not inventory:
        def forget(ref: weakref.ref, key: int = key) -> None:
            if _TABLES.get(key, (None,))[0] is ref:
                del _TABLES[key]
        entry = _TABLES[key] = (weakref.ref(inventory, forget), {})
    tables = entry[1]
    table = tables.get(pk)
    if table is None:
        table = tables[pk] = _build_table(inventory, pk)
    return table


def _build_table(inventory: Inventory, pk: str) -> ProductTable:
    t = ProductTable()
    for pos, node in enumerate(inventory.nodes):
        t.widest_node = max(t.widest_node, sum(1 for g in node.gpus if g.product_key == pk and not g.mig_enabled))
        for d, dom in enumerate(node.domains):
            members = tuple(g for g in dom if g.product_key == pk and not g.mig_enabled)
            if not members:
                continue
            t.largest_domain = max(t.largest_domain, len(members))
            name = f"nvlink{d}" if len(dom) > 1 else f"gpu{dom[0].index}"
            t.domains.append(DomainSpec(node, pos, d, name, len(members), tuple(g for g in members if g.health.healthy)))
        for gpu in node.gpus:
            if gpu.mig_enabled and gpu.product_key == pk and gpu.health.healthy:
                t.mig_gpus.append((pos, node, gpu))
    return t


# ----- slots -----------------------------------------------------------------------------------

@dataclass(eq=False)
class Slot:
    """Free units of one kind in one place. A replica's GPUs come from a single slot."""

    node: NodeInventory
    node_pos: int                     # node's index in the inventory (first-fit order)
    name: str                         # "nvlink0" (NVLink domain), "gpu3" (lone GPU or MIG parent)
    pos: int                          # order within the node
    free: list[Any]                   # free units, in pick order: Gpu or MigInstance
    size: int                         # units of this kind here, free or not, healthy or not
    parent: Gpu | None = None         # the GPU of a MIG slot
    other_free: int = 0               # MIG: free instances of other profiles on the same GPU
    group: Hashable = None
    version: int = field(default=0)

    @property
    def capacity(self) -> int:
        return len(self.free)


def gpu_slots(inventory: Inventory, in_use: Mapping[str, int], product_key: str) -> list[Slot]:
    """One slot per NVLink domain holding GPUs of ``product_key`` outside MIG mode; its free
    units are the domain's healthy GPUs nobody holds, lowest index first. O(GPUs of the product):
    the domains come from `product_table`, only the in-use map is read per call."""
    get = in_use.get
    return [Slot(d.node, d.node_pos, d.name, d.pos, [g for g in d.healthy if not get(g.uuid)], d.size)
            for d in product_table(inventory, product_key).domains]


def mig_slots(inventory: Inventory, in_use: Mapping[str, int], product_key: str, profile: str) -> list[Slot]:
    """One slot per healthy MIG-mode GPU of ``product_key`` with instances of ``profile``
    (from `product_table`; the in-use map is read per call)."""
    get = in_use.get
    slots = []
    for m in product_table(inventory, product_key).mig(profile):
        free: list[MigInstance] = [i for i in m.mine if not get(i.uuid)]
        others = sum(1 for i in m.others if not get(i.uuid))
        slots.append(Slot(m.node, m.node_pos, f"gpu{m.gpu.index}", m.gpu.index, free, len(m.mine),
                          parent=m.gpu, other_free=others))
    return slots


class _Group:
    __slots__ = ("key", "order", "buckets", "counts")

    def __init__(self, key: Hashable, order: int) -> None:
        self.key = key
        self.order = order
        self.buckets: dict[int, list[tuple]] = {}   # capacity -> heap of (slot key, seq, slot, version)
        self.counts: Counter[int] = Counter()       # capacity -> live slots with that capacity


class SlotIndex:
    """Slots grouped by ``group_of`` and, inside a group, bucketed by capacity, each bucket a
    heap ordered by ``slot_key``. Changing a slot (or a node's other slots, whose keys may
    depend on it) bumps its version and re-pushes it; stale heap entries are skipped lazily.
    """

    def __init__(self, slots: list[Slot], group_of: Callable[[Slot], Hashable],
                 slot_key: Callable[[Slot], tuple]) -> None:
        self._slot_key = slot_key
        self._seq = itertools.count()
        self.groups: dict[Hashable, _Group] = {}
        self.by_node: dict[str, list[Slot]] = defaultdict(list)
        for s in slots:
            s.group = group_of(s)
            g = self.groups.get(s.group)
            if g is None:
                g = self.groups[s.group] = _Group(s.group, len(self.groups))
            self.by_node[s.node.name].append(s)
            if s.capacity:
                g.counts[s.capacity] += 1
                self._push(g, s)

    def _push(self, g: _Group, s: Slot) -> None:
        heapq.heappush(g.buckets.setdefault(s.capacity, []), (self._slot_key(s), next(self._seq), s, s.version))

    def _top(self, g: _Group, capacity: int) -> tuple | None:
        heap = g.buckets.get(capacity, [])
        while heap:
            entry = heap[0]
            if entry[2].version == entry[3]:
                return entry
            heapq.heappop(heap)
        return None

    def best_fit(self, g: _Group, need: int, strands: Callable[[int], bool] | None = None) -> Slot | None:
        """The slot with the fewest free units that still holds ``need``; ties by slot key.
        With ``strands`` (a slot's free units -> whether taking the replica from it wastes room,
        `PlacementRequest.strands`), slots it judges false come first."""
        fitting = sorted(c for c, n in g.counts.items() if n > 0 and c >= need)
        if strands is not None:
            fitting.sort(key=strands)
        for capacity in fitting:
            entry = self._top(g, capacity)
            if entry is not None:
                return entry[2]
        return None

    def first(self, g: _Group, need: int) -> Slot | None:
        """The slot with the smallest slot key among those holding ``need``."""
        tops = [e for c, n in g.counts.items() if n > 0 and c >= need if (e := self._top(g, c)) is not None]
        return min(tops, key=lambda e: e[:2])[2] if tops else None

    def take(self, slot: Slot, n: int) -> list[Any]:
        """Remove the first ``n`` free units of ``slot`` and return them; re-key the node's slots."""
        g = self.groups[slot.group]
        units = slot.free[:n]
        g.counts[slot.capacity] -= 1
        del slot.free[:n]
        if slot.capacity:
            g.counts[slot.capacity] += 1
        self.refresh_node(slot.node.name)
        return units

    def refresh_node(self, node: str) -> None:
        """Re-push the node's slots: their keys may depend on node-level counts that changed."""
        for s in self.by_node.get(node, ()):
            s.version += 1
            if s.capacity:
                self._push(self.groups[s.group], s)


def assign(slot: Slot, units: list[Any]) -> Assignment:
    """The assignment of ``units`` taken from ``slot``: CUDA_VISIBLE_DEVICES takes GPU and MIG
    UUIDs, so the engine sees exactly its devices."""
    if slot.parent is not None:   # a MIG slot: one instance
        mig = units[0]
        return Assignment(
            node=slot.node.name, devices=(mig.uuid,), env={"CUDA_VISIBLE_DEVICES": mig.uuid},
            label=f"mig:{mig.profile}@gpu{slot.parent.index}", domain=slot.name,
        )
    uuids = tuple(g.uuid for g in units)
    return Assignment(
        node=slot.node.name, devices=uuids, env={"CUDA_VISIBLE_DEVICES": ",".join(uuids)},
        label="gpu:" + ",".join(str(g.index) for g in units), domain=slot.name,
    )
