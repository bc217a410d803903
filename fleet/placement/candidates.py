"""Which nodes and which GPU product a placement request uses: the filter and the choice every
placement strategy shares.

Owns `eligible_nodes` (the nodes a request may use at all: today, nodes whose NVIDIA driver can
run the engine's CUDA, `fleet.placement.compat`; the others grouped by reason for the plan's
explanation), `choose_product` (the one GPU product every replica of a version runs on) and
`maybe_warm_nodes` (the nodes that may cache the request's image or weights). Called by
`fleet.placement.strategies.PlacementStrategy.place_replicas` and the ``fleet`` strategy
(`fleet.placement.fleet_strategy`). Pure: no I/O, no clock.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Hashable

from fleet.inventory.model import Inventory, NodeInventory, product_key
from fleet.placement import explain, gangs
from fleet.placement.freeindex import FreeState
from fleet.placement.shapes import NodeClass, PlacementRequest, canonical_source
from fleet.sources import redact_source

# id(inventory) -> (weak reference to it, CudaNeed -> (the eligible nodes, the excluded by reason))
_ELIGIBLE: dict[int, tuple[weakref.ref, dict[Hashable, tuple[Inventory, tuple[NodeClass, ...]]]]] = {}


def eligible_nodes(request: PlacementRequest, inventory: Inventory) -> tuple[Inventory, tuple[NodeClass, ...]]:
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


def choose_product(request: PlacementRequest, inventory: Inventory, state: FreeState) -> str | None:
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
    ``inventory`` holds only the nodes the request may use (`eligible_nodes`); ``state`` is its
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
    warm = sum(s.capacity // per for node in maybe_warm_nodes(request, state) if request.is_warm(node)
               for s in idx.by_node.get(node.name, ()))
    return total, warm


def maybe_warm_nodes(request: PlacementRequest, state: FreeState) -> list[NodeInventory]:
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

