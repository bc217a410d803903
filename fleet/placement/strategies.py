"""Placement strategies: turn a `PlacementRequest` and an `Inventory` into a `PlacementPlan`.

Owns the registry of strategies by name (`PLACEMENT_STRATEGIES`, `get_strategy`), the
`PlacementStrategy` base class with the decision every strategy shares (one product for all
replicas of a version, single node or gang, the batch loop, all or nothing, explanations and
MIG advice), `GroupRanking` (the pick among the groups' best slots), and ``first-fit``: the
first node, in inventory order, with a domain that fits; lowest GPU indexes (the base's own
hooks; the baseline of loadtests/bench_placement.py). The default, ``fleet``, is
`fleet.placement.fleet_strategy`, registered by the `fleet.placement` package, which Python
imports before this module.

Every strategy sees only the nodes a request may use at all
(`fleet.placement.candidates.eligible_nodes`: today, nodes whose NVIDIA driver can run the
engine's CUDA, `fleet.placement.compat`); the others are explained with their reason.
Strategies differ only in their hooks (`group_of`, `rank_groups`, `slot_key`, `pick`,
`gang_member_key`, `gang_rank`; `ranking` may keep `rank_groups` incrementally, as ``fleet``
does, for speed only); all share `place_replicas`. Called by the controller, `fleet up`
(preflight) and `fleet plan`. Pure: no I/O, no clock; the same inputs give the same plan.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Mapping, Sequence

from fleet.inventory.model import Inventory, product_key
from fleet.models.memory import MemoryNeed
from fleet.placement import cpu, explain, gangs, mig_advice
from fleet.placement.candidates import choose_product, eligible_nodes
from fleet.placement.compat import CudaNeed
from fleet.placement.context import Context
from fleet.placement.freeindex import FreeState, free_state
from fleet.placement.shapes import PlacementPlan, PlacementRequest, ReplicaPlacement, ReplicaShape, Unplaceable
from fleet.placement.slots import Slot, SlotIndex, assign, gpu_slots, mig_slots
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
            left, the reasons by node class and, for MIG shapes, repartition advice. None
            placed, with the reason as the plan's note, where no node could ever take one: TP
            above 1 on MIG, or a ``--max-model-len`` vLLM refuses for the model
            (``request.memory``'s `fleet.models.memory.MemoryNeed.max_len_problem`).
        """
        shape = request.shape
        if request.count <= 0:
            return PlacementPlan(request, strategy=self.name)
        everything = inventory
        inventory, excluded = eligible_nodes(request, inventory)
        if shape.kind == "mig" and shape.tensor_parallel_size != 1:
            return PlacementPlan(request, strategy=self.name, note=(
                f"tensor parallel size must be 1 on MIG (got {shape.tensor_parallel_size}): MIG slices have "
                "no NVLink or CUDA IPC, so tensor parallelism across slices is not possible"))
        if request.memory is not None and (refused := request.memory.max_len_problem) is not None:
            return PlacementPlan(request, strategy=self.name, note=refused)
        held: Counter[str] = Counter(in_use or {})
        if shape.kind == "cpu":
            placements = cpu.place_cpu(request, inventory, held)
            product = None
            gang = None
        else:
            state = free_state(inventory)
            with state.lock:
                state.bind(in_use)
                product = choose_product(request, inventory, state)
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


class FirstFitStrategy(PlacementStrategy, name="first-fit"):
    """The first fitting node in inventory order, lowest GPU indexes (benchmark baseline)."""


def strategy_names() -> list[str]:
    """Names of the registered placement strategies, sorted."""
    return PLACEMENT_STRATEGIES.names()


def get_strategy(name: str = DEFAULT_STRATEGY) -> PlacementStrategy:
    """A new strategy instance. Raises KeyError listing the known names."""
    return PLACEMENT_STRATEGIES.get(name)()
