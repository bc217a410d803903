"""Free capacity kept across placement calls: `DeviceUse` and the per-inventory `FreeIndex`.

Deriving every slot (NVLink domain or MIG GPU) of a product from the in-use map and ranking them
all is O(GPUs) per placement call, ~45 ms on 10,000 nodes x 8 GPUs even for one replica. Instead
the free units of each slot live in an index kept with the `Inventory` object
(like `fleet.placement.slots.product_table`: by identity, with a weak reference, dropped with
the inventory) and brought up to date from what changed in the in-use map since the last call:

- `DeviceUse`: a `Counter` of devices in use that journals the keys it changes. An index synced
  with one reads only the keys changed since (O(changes)); the controller passes one.
- any other mapping: compared with a copy of the map the index last saw (one C-level dict
  comparison, ~3 ms for 45,000 devices in use; the changed keys from a C-level item diff).

`FreeState` holds one inventory's indexes, the devices they treat as held, and the nodes that
cache something (so warmth is looked up only where it can differ). `FreeIndex` holds one
product's slots of one unit kind (whole GPUs, or MIG instances of one profile), bucketed per
zone by free capacity, each bucket a heap by (other free instances, node's free units, node
order, slot order): the request-independent part of `FleetStrategy`'s slot key. Strategies
take units tentatively during a call and give them back before it returns, so the index always
mirrors the in-use map the caller passed. Used by `fleet.placement.strategies`. Pure, no I/O;
one lock per inventory serialises calls on the same inventory object.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

from fleet.inventory.model import Inventory, NodeInventory
from fleet.placement.slots import product_table


class DeviceUse(Counter):
    """device id -> replicas holding it, like ``Counter``, journaling every key it changes.

    `FreeState.sync` reads the keys changed since its last sync with this very object instead of
    comparing the whole map. The journal is dropped when it grows past four times the map (plus
    4,096 keys); an index that fell behind it then compares the whole map once.
    """

    def __init__(self, iterable: Iterable | Mapping | None = None, /, **kwds: int) -> None:
        self._journal: list[Hashable] = []
        self._dropped = 0
        super().__init__(iterable, **kwds)

    @property
    def mark(self) -> int:
        """Changes journaled so far (a position for `changes_since`)."""
        return self._dropped + len(self._journal)

    def changes_since(self, mark: int) -> list[Hashable] | None:
        """Keys changed since ``mark`` (repeats possible), or None when the journal no longer
        reaches back that far."""
        if mark < self._dropped:
            return None
        return self._journal[mark - self._dropped:]

    def _note(self, key: Hashable) -> None:
        self._journal.append(key)
        if len(self._journal) > 4096 + 4 * len(self):
            self._dropped += len(self._journal)
            self._journal = []

    def __setitem__(self, key: Hashable, value: int) -> None:
        super().__setitem__(key, value)
        self._note(key)

    def __delitem__(self, key: Hashable) -> None:
        super().__delitem__(key)
        self._note(key)

    def update(self, iterable: Iterable | Mapping | None = None, /, **kwds: int) -> None:
        if isinstance(iterable, Mapping) and not self:
            dict.update(self, iterable)        # Counter's own fast path for an empty counter
            for key in iterable:
                self._note(key)
            iterable = None
        super().update(iterable, **kwds)

    def pop(self, key: Hashable, *default: Any) -> Any:
        self._note(key)
        return super().pop(key, *default)

    def popitem(self) -> tuple[Hashable, int]:
        item = super().popitem()
        self._note(item[0])
        return item

    def setdefault(self, key: Hashable, default: int = 0) -> int:
        if key not in self:
            self[key] = default
        return self[key]

    def clear(self) -> None:
        keys = list(self)
        super().clear()
        for key in keys:
            self._note(key)


class FreeSlot:
    """One slot of a `FreeIndex`: an NVLink domain's healthy GPUs of the product outside MIG
    mode, or one healthy MIG GPU's instances of the profile. Reads like `fleet.placement.slots.Slot`
    for `fleet.placement.slots.assign`."""

    __slots__ = ("node", "node_pos", "name", "pos", "size", "parent", "units", "taken", "capacity",
                 "other_free", "zone", "rack", "version")

    def __init__(self, node: NodeInventory, node_pos: int, name: str, pos: int, size: int, parent: Any,
                 units: tuple, other_free: int) -> None:
        self.node = node
        self.node_pos = node_pos
        self.name = name
        self.pos = pos
        self.size = size
        self.parent = parent
        self.units = units                        # Gpu or MigInstance, pick order
        self.taken = [False] * len(units)
        self.capacity = len(units)                # free units
        self.other_free = other_free              # MIG: free instances of other profiles on the GPU
        self.zone = node.zone
        self.rack = (node.zone, node.rack)        # the key of `Context.rack_count`
        self.version = 0

    def free_units(self, n: int) -> list:
        """The first ``n`` free units, in pick order."""
        return [u for u, t in zip(self.units, self.taken) if not t][:n]


class _Zone:
    __slots__ = ("buckets", "counts", "entries", "slots")

    def __init__(self) -> None:
        self.buckets: dict[int, list[tuple]] = {}   # capacity -> heap of (static key, seq, slot, version)
        self.counts: Counter[int] = Counter()       # capacity -> slots with that capacity
        self.entries = 0                            # heap entries, live or stale
        self.slots: list[FreeSlot] = []


class FreeIndex:
    """One product's slots of one unit kind in one inventory, with their free units as of the
    last `FreeState.sync` (and the tentative takes of the call in progress)."""

    def __init__(self, inventory: Inventory, pk: str, profile: str | None, held: set[str]) -> None:
        self.slots: list[FreeSlot] = []
        self.unit_of: dict[str, tuple[FreeSlot, int]] = {}
        self.other_of: dict[str, FreeSlot] = {}
        self.by_node: dict[str, list[FreeSlot]] = defaultdict(list)
        self.by_rack: dict[tuple, list[FreeSlot]] = defaultdict(list)
        self.node_free: Counter[str] = Counter()
        self.capacity_counts: Counter[int] = Counter()
        self.by_capacity: dict[int, set[FreeSlot]] = defaultdict(set)   # free units -> slots
        self.zones: dict[str | None, _Zone] = {}
        self._seq = itertools.count()
        table = product_table(inventory, pk)
        if profile is None:
            for d in table.domains:
                self._add(FreeSlot(d.node, d.node_pos, d.name, d.pos, d.size, None, d.healthy, 0), held)
        else:
            for m in table.mig(profile):
                others = sum(1 for i in m.others if i.uuid not in held)
                slot = FreeSlot(m.node, m.node_pos, f"gpu{m.gpu.index}", m.gpu.index, len(m.mine), m.gpu, m.mine, others)
                for i in m.others:
                    self.other_of[i.uuid] = slot
                self._add(slot, held)
        for z in self.zones.values():
            self._rebuild(z)

    def _add(self, slot: FreeSlot, held: set[str]) -> None:
        for i, unit in enumerate(slot.units):
            self.unit_of[unit.uuid] = (slot, i)
            if unit.uuid in held:
                slot.taken[i] = True
                slot.capacity -= 1
        self.slots.append(slot)
        self.by_node[slot.node.name].append(slot)
        self.by_rack[slot.rack].append(slot)
        self.node_free[slot.node.name] += slot.capacity
        z = self.zones.get(slot.zone)
        if z is None:
            z = self.zones[slot.zone] = _Zone()
        z.slots.append(slot)
        self._count(slot, 1)

    def static_key(self, slot: FreeSlot) -> tuple:
        """The request-independent tail of `FleetStrategy.slot_key`."""
        return (slot.other_free, self.node_free[slot.node.name], slot.node_pos, slot.pos)

    def _count(self, slot: FreeSlot, d: int) -> None:
        if slot.capacity:
            self.zones[slot.zone].counts[slot.capacity] += d
            self.capacity_counts[slot.capacity] += d
            if d > 0:
                self.by_capacity[slot.capacity].add(slot)
            else:
                self.by_capacity[slot.capacity].discard(slot)

    def fitting(self, need: int) -> list[FreeSlot]:
        """The slots with at least ``need`` free units (any order)."""
        return [s for c, slots in self.by_capacity.items() if c >= need for s in slots]

    def _push(self, slot: FreeSlot) -> None:
        slot.version += 1
        if slot.capacity:
            z = self.zones[slot.zone]
            heapq.heappush(z.buckets.setdefault(slot.capacity, []),
                           (self.static_key(slot), next(self._seq), slot, slot.version))
            z.entries += 1
            if z.entries > 64 + 4 * len(z.slots):
                self._rebuild(z)

    def _rebuild(self, z: _Zone) -> None:
        """The zone's heaps from its live slots only (stale entries dropped)."""
        buckets: dict[int, list[tuple]] = defaultdict(list)
        for s in z.slots:
            if s.capacity:
                buckets[s.capacity].append((self.static_key(s), next(self._seq), s, s.version))
        for heap in buckets.values():
            heapq.heapify(heap)
        z.buckets = dict(buckets)
        z.entries = sum(len(h) for h in buckets.values())

    def set_held(self, uuid: str, held: bool) -> None:
        """A device became held (or free): move its slot, and its node's other slots (their key
        holds the node's free units), to their new place."""
        ref = self.unit_of.get(uuid)
        if ref is not None:
            slot, i = ref
            if slot.taken[i] == held:
                return
            self._count(slot, -1)
            slot.taken[i] = held
            d = -1 if held else 1
            slot.capacity += d
            self._count(slot, 1)
            self.node_free[slot.node.name] += d
            for s in self.by_node[slot.node.name]:
                self._push(s)
            return
        slot = self.other_of.get(uuid)
        if slot is not None:
            slot.other_free += -1 if held else 1
            self._push(slot)

    def zone_fits(self, zone: str | None, need: int) -> bool:
        """Whether the zone has a slot with ``need`` free units."""
        return any(n > 0 and c >= need for c, n in self.zones[zone].counts.items())

    def best_in_zone(self, zone: str | None, need: int, skip, strands=None) -> FreeSlot | None:
        """The zone's slot with the fewest free units that still holds ``need``, ties by
        `static_key`, among slots for which ``skip(slot)`` is false; with ``strands`` (a slot's
        free units -> wastes room, `PlacementRequest.strands`), slots it judges false first."""
        z = self.zones[zone]
        fitting = sorted(c for c, n in z.counts.items() if n > 0 and c >= need)
        if strands is not None:
            fitting.sort(key=strands)
        for capacity in fitting:
            heap = z.buckets.get(capacity, [])
            skipped = []
            found = None
            while heap:
                entry = heap[0]
                slot = entry[2]
                if slot.version != entry[3]:
                    heapq.heappop(heap)
                    z.entries -= 1
                elif skip(slot):
                    skipped.append(heapq.heappop(heap))
                else:
                    found = slot
                    break
            for entry in skipped:
                heapq.heappush(heap, entry)
            if found is not None:
                return found
        return None


class FreeState:
    """One inventory's `FreeIndex` objects and the in-use map they mirror."""

    REBUILD_AFTER = 4096
    """A sync that changes more devices than this drops the indexes (rebuilt on next use, O(GPUs)
    of the product) instead of moving each slot: updating costs a few microseconds a device."""

    def __init__(self, inventory: Inventory) -> None:
        self._inventory = weakref.ref(inventory)
        self.lock = threading.Lock()
        self.indexes: dict[tuple[str, str | None], FreeIndex] = {}
        self.held: set[str] = set()                 # devices the indexes treat as held
        self._last: dict[Hashable, Any] = {}        # the mapping last synced with, copied
        self._source: weakref.ref | None = None     # the DeviceUse last synced with
        self._mark = 0
        self._pending: tuple[Mapping[str, int] | None] | None = None   # `bind`
        self.by_name = inventory.by_name
        self.cached_by: dict[str, list[NodeInventory]] = defaultdict(list)   # cached item -> nodes
        for node in inventory.nodes:
            for item in node.cached:
                self.cached_by[item].append(node)

    def bind(self, in_use: Mapping[str, int] | None) -> None:
        """The in-use map of the call in progress: `index` syncs with it on first use (a call
        that reads no index costs nothing here). Hold ``lock`` from here to the call's end."""
        self._pending = (in_use,)

    def index(self, pk: str, profile: str | None) -> FreeIndex:
        """The index of product key ``pk``'s whole GPUs (``profile`` None) or MIG ``profile``
        instances, synced with the bound in-use map; built on first use (O(GPUs of the
        product)), then kept."""
        pending = self._pending
        if pending is not None:
            self._pending = None
            self.sync(pending[0])
        key = (pk, profile)
        idx = self.indexes.get(key)
        if idx is None:
            inventory = self._inventory()
            assert inventory is not None
            idx = self.indexes[key] = FreeIndex(inventory, pk, profile, self.held)
        return idx

    def sync(self, in_use: Mapping[str, int] | None) -> None:
        """Bring every index to ``in_use`` (device id -> replicas holding it; a device is held
        when its count is truthy, as everywhere in placement)."""
        in_use = in_use if in_use is not None else {}
        source = self._source() if self._source is not None else None
        if source is in_use and isinstance(in_use, DeviceUse):
            changed = in_use.changes_since(self._mark)
            if changed is not None:
                last = self._last
                for key in set(changed):
                    if key in in_use:
                        last[key] = dict.__getitem__(in_use, key)
                    else:
                        last.pop(key, None)
                self._mark = in_use.mark
                self._apply(set(changed), in_use)
                return
        plain = in_use if type(in_use) in (dict, Counter, DeviceUse) else dict(in_use)
        if not self.indexes:      # nothing built yet: only remember what is held
            self.held = {k for k, v in plain.items() if v}
            self._last = dict(plain)
        elif not dict.__eq__(plain, self._last):
            changed = {k for k, _ in plain.items() ^ self._last.items()}
            self._last = dict(plain)
            if len(changed) > self.REBUILD_AFTER:    # another map altogether (a preflight on empty nodes)
                self.indexes.clear()                 # cheaper to build again, when next asked for
                self.held = {k for k, v in plain.items() if v}
            else:
                self._apply(changed, plain)
        if isinstance(in_use, DeviceUse):
            self._source, self._mark = weakref.ref(in_use), in_use.mark
        else:
            self._source = None

    def _apply(self, changed: Iterable[Hashable], in_use: Mapping) -> None:
        get = in_use.get
        for key in changed:
            now = bool(get(key))
            if now != (key in self.held):
                self.set_held(key, now)

    def set_held(self, uuid: Hashable, held: bool) -> None:
        """Mark one device held or free in every index (also for a tentative take)."""
        if held:
            self.held.add(uuid)
        else:
            self.held.discard(uuid)
        for idx in self.indexes.values():
            idx.set_held(uuid, held)


# id(inventory) -> (weak reference to that inventory, its state)
_STATES: dict[int, tuple[weakref.ref, FreeState]] = {}


def free_state(inventory: Inventory) -> FreeState:
    """The `FreeState` of ``inventory``, made on first use and dropped with the inventory (same
    soundness argument as `fleet.placement.slots.product_table`: inventories are immutable)."""
    key = id(inventory)
    entry = _STATES.get(key)
    if entry is None or entry[0]() is not inventory:
        def forget(ref: weakref.ref, key: int = key) -> None:
            if _STATES.get(key, (None,))[0] is ref:
                del _STATES[key]
        entry = _STATES[key] = (weakref.ref(inventory, forget), FreeState(inventory))
    return entry[1]
