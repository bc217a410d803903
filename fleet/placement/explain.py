"""Why replicas did not fit, grouped by node class.

Owns `by_node_class`: for every node, the first reason it cannot take one more replica of the
shape (other product, no GPU, GPUs in MIG mode, unhealthy GPUs, NVLink domains too small, not
enough free GPUs in one domain, no MIG instance of the profile, gang block too small, CPU cores,
GPU or MIG instance memory too small for the model: `memory_reason`),
and nodes grouped by identical reason, largest group first:
``12 nodes: other GPU product (NVIDIA A100-SXM4-80GB); 3 nodes: at most 2 free GPUs in one NVLink
domain, need 4``. Reasons name no node, so nodes that fail alike fall into one class.
Called by `PlacementStrategy.place_replicas` on the state after the batch was placed. Pure.
"""

from __future__ import annotations

import functools
import weakref
from collections import Counter
from collections.abc import Hashable

from fleet.inventory.model import Gpu, Inventory, NodeInventory, product_key
from fleet.models.advise import mig_memory_mib
from fleet.models.memory import MemoryNeed
from fleet.placement.gangs import blocks_of, describe_block
from fleet.placement.shapes import GangShape, NodeClass, PlacementRequest, ReplicaShape


def by_node_class(request: PlacementRequest, inventory: Inventory, held: Counter[str],
                  product: str | None, gang: GangShape | None) -> tuple[NodeClass, ...]:
    """Nodes grouped by why they cannot take one more replica; nodes that could are left out.

    ``product`` is the version's product (None: each node is judged on its own products).
    """
    shape = request.shape
    pk = product_key(product) if product else None
    capable = _gang_capable(inventory, held, pk, gang) if gang else {}
    classes: dict[str, list[str]] = {}
    if pk is not None and shape.kind == "gpus" and gang is None:
        # The usual case (one product, whole GPUs in one node): each node's reason up to the
        # free-GPU count is the same on every call for this inventory, product and width
        # (`_static_gpus_reasons`); only the nodes that get that far read ``held``.
        need = shape.tensor_parallel_size
        memory = request.memory
        get = held.get
        for node, static, data in _static_gpus_reasons(inventory, pk, need):
            reason = static
            if data is not None:
                gpu, domains, sick_note = data
                if memory is not None and (reason := memory_reason(memory, shape, gpu)) is not None:
                    pass
                else:
                    free = max(sum(1 for u in dom if not get(u)) for dom in domains)
                    reason = (f"at most {_plural(free, 'free GPU')} in one NVLink domain, need {need}{sick_note}"
                              if free < need else None)
            elif memory is not None and node.gpus:
                gpu = next((g for g in node.gpus if g.product_key == pk), None)
                if gpu is not None and (why := memory_reason(memory, shape, gpu)) is not None:
                    reason = why
            if reason is not None:
                classes.setdefault(reason, []).append(node.name)
        return tuple(sorted((NodeClass(r, tuple(n)) for r, n in classes.items()),
                            key=lambda c: (-len(c.nodes), c.reason)))
    for node in inventory.nodes:
        reason = node_reason(node, shape, pk, held, gang, capable, memory=request.memory)
        if reason is not None:
            classes.setdefault(reason, []).append(node.name)
    return tuple(sorted((NodeClass(r, tuple(n)) for r, n in classes.items()),
                        key=lambda c: (-len(c.nodes), c.reason)))


# id(inventory) -> (weak reference to it, (product key, width) -> per node: (node, reason, data))
_STATIC: dict[int, tuple[weakref.ref, dict[tuple[str, int], list[tuple]]]] = {}


def _static_gpus_reasons(inventory: Inventory, pk: str, need: int) -> list[tuple]:
    """Per node, in inventory order, what `_gpus_reason` says before it reads the devices in use:
    ``(node, reason, None)`` where that settles it (no GPU, other product, MIG mode, unhealthy,
    NVLink domains too small), else ``(node, None, (its first GPU of the product, each domain's
    healthy whole GPUs' UUIDs, the note on its unhealthy GPUs))``. Derived once per inventory
    object, product key and width, kept while the inventory lives (inventories are immutable:
    `fleet.placement.slots.product_table`)."""
    key = id(inventory)
    entry = _STATIC.get(key)
    if entry is None or entry[0]() is not inventory:
        def forget(ref: weakref.ref, key: int = key, kept: dict = _STATIC) -> None:
            if kept.get(key, (None,))[0] is ref:
                del kept[key]
        entry = _STATIC[key] = (weakref.ref(inventory, forget), {})
    found = entry[1].get((pk, need))
    if found is None:
        found = entry[1][(pk, need)] = [_static_gpus_reason(node, pk, need) for node in inventory.nodes]
    return found


def _static_gpus_reason(node: NodeInventory, key: str, need: int) -> tuple:
    if not node.gpus:
        return node, "no GPU", None
    mine = [g for g in node.gpus if g.product_key == key]
    if not mine:
        return node, _other_product(node), None
    whole = [g for g in mine if not g.mig_enabled]
    if not whole:
        return node, "GPUs in MIG mode (the replica needs whole GPUs)", None
    healthy = {g.index for g in whole if g.health.healthy}
    sick = [g for g in whole if g.index not in healthy]
    if not healthy:
        return node, f"GPUs unhealthy: {_sickness(sick)}", None
    sick_note = f" ({_plural(len(sick), 'GPU')} unhealthy: {_sickness(sick)})" if sick else ""
    largest = max(sum(1 for g in dom if g.index in healthy) for dom in node.domains)
    if largest < need:
        topo = "" if node.topology_known else " (NVLink topology not reported)"
        return node, f"at most {_plural(largest, 'GPU')} in one NVLink domain, need {need}{topo}{sick_note}", None
    domains = tuple(tuple(g.uuid for g in dom if g.index in healthy) for dom in node.domains)
    return node, None, (mine[0], domains, sick_note)


def node_reason(node: NodeInventory, shape: ReplicaShape, pk: str | None, held: Counter[str],
                gang: GangShape | None = None, capable: dict[Hashable, int] | None = None,
                memory: MemoryNeed | None = None) -> str | None:
    """Why ``node`` cannot take one more replica of ``shape``, or None when it can."""
    if shape.kind == "cpu":
        n = len(node.cpu_cores)
        return None if n >= shape.cpu_cores else f"{n} CPU core{'s' if n != 1 else ''}, need {shape.cpu_cores}"
    if not node.gpus:
        return "no GPU"
    keys = [pk] if pk else list(dict.fromkeys(g.product_key for g in node.gpus))
    first = None
    for key in keys:
        gpu = next((g for g in node.gpus if g.product_key == key), None)
        if memory is not None and gpu is not None and (reason := memory_reason(memory, shape, gpu)) is not None:
            first = first or reason
            continue
        if shape.kind == "mig":
            reason = _mig_reason(node, key, held, shape.mig_profile)
        else:
            need = gang.per_node if gang else shape.tensor_parallel_size
            reason = _gpus_reason(node, key, held, need, gang, capable or {})
        if reason is None:
            return None
        first = first or reason
    return first


def device_memory_mib(shape: ReplicaShape, gpu: Gpu) -> int | None:
    """Memory one device of ``shape`` has on ``gpu``'s product: the GPU's, or its MIG
    instance's (`fleet.models.advise.mig_memory_mib`; None when the product has no such profile)."""
    if shape.kind == "mig":
        return mig_memory_mib(gpu.product, gpu.memory_mib, shape.mig_profile or "")
    return gpu.memory_mib


def memory_reason(memory: MemoryNeed, shape: ReplicaShape, gpu: Gpu) -> str | None:
    """Why a device of ``shape`` on ``gpu``'s product cannot hold the model (weights and one
    ``max_model_len`` sequence per device, `fleet.models.memory.MemoryNeed.fits`), or None.
    Names the product and device memory, never the node, so nodes that fail alike group."""
    mib = device_memory_mib(shape, gpu)
    if mib is None:
        return None
    return _memory_reason(memory, shape.mig_profile if shape.kind == "mig" else None, gpu.product, mib)


@functools.lru_cache(maxsize=1024)
def _memory_reason(memory: MemoryNeed, mig_profile: str | None, product: str, mib: int) -> str | None:
    """`memory_reason` once per model, device kind and memory size (an explanation of 10,000 nodes
    asks it for each)."""
    problem = memory.fits(mib)
    if problem is None:
        return None
    what = f"MIG {mig_profile} of {product}" if mig_profile else product
    return f"model does not fit {what} ({mib} MiB): {problem}"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _other_product(node: NodeInventory) -> str:
    return f"other GPU product ({', '.join(dict.fromkeys(g.product for g in node.gpus))})"


def _sickness(gpus: list[Gpu]) -> str:
    return ", ".join(sorted({p for g in gpus for p in g.health.problems()}))


def _gpus_reason(node: NodeInventory, key: str, held: Counter[str], need: int, gang: GangShape | None,
                 capable: dict[Hashable, int]) -> str | None:
    mine = [g for g in node.gpus if g.product_key == key]
    if not mine:
        return _other_product(node)
    whole = [g for g in mine if not g.mig_enabled]
    if not whole:
        return "GPUs in MIG mode (the replica needs whole GPUs)"
    healthy = {g.index for g in whole if g.health.healthy}
    sick = [g for g in whole if g.index not in healthy]
    if not healthy:
        return f"GPUs unhealthy: {_sickness(sick)}"
    sick_note = f" ({_plural(len(sick), 'GPU')} unhealthy: {_sickness(sick)})" if sick else ""
    what = f"need {need}" + (" per gang member" if gang else "")
    largest = max(sum(1 for g in dom if g.index in healthy) for dom in node.domains)
    if largest < need:
        topo = "" if node.topology_known else " (NVLink topology not reported)"
        return f"at most {_plural(largest, 'GPU')} in one NVLink domain, {what}{topo}{sick_note}"
    free = max(sum(1 for g in dom if g.index in healthy and not held[g.uuid]) for dom in node.domains)
    if free < need:
        return f"at most {_plural(free, 'free GPU')} in one NVLink domain, {what}{sick_note}"
    if gang is not None:
        blocks = blocks_of(node)
        if not blocks:
            return f"no NVLink fabric or network block (a gang of {gang.nodes} nodes needs one)"
        block = max(blocks, key=lambda b: capable.get(b, 0))
        return (f"{describe_block(block)} has {_plural(capable.get(block, 0), 'node')} with {need} free GPUs "
                f"in one NVLink domain, a gang needs {gang.nodes}")
    return None


def _mig_reason(node: NodeInventory, key: str, held: Counter[str], profile: str) -> str | None:
    mine = [g for g in node.gpus if g.product_key == key]
    if not mine:
        return _other_product(node)
    migged = [g for g in mine if g.mig_enabled]
    if not migged:
        return "MIG mode off"
    healthy = [g for g in migged if g.health.healthy]
    if not healthy:
        return f"GPUs unhealthy: {_sickness(migged)}"
    instances = [m for g in healthy for m in g.mig_instances if m.profile == profile]
    if not instances:
        have = Counter(m.profile for g in healthy for m in g.mig_instances)
        listed = ", ".join(f"{n}x {p}" for p, n in sorted(have.items())) or "none"
        return f"no {profile} instance (MIG instances: {listed})"
    if all(held[m.uuid] for m in instances):
        return f"every {profile} instance in use"
    return None


def _gang_capable(inventory: Inventory, held: Counter[str], pk: str | None, gang: GangShape) -> dict[Hashable, int]:
    """Per gang block: nodes that could host one more member now."""
    capable: Counter[Hashable] = Counter()
    for node in inventory.nodes:
        ok = any(sum(1 for g in dom if g.product_key == pk and not g.mig_enabled and g.health.healthy
                      and not held[g.uuid]) >= gang.per_node for dom in node.domains)
        if ok:
            for block in blocks_of(node):
                capable[block] += 1
    return capable
