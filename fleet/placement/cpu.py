"""CPU replicas (vLLM's CPU backend): cores, not GPUs.

Owns `place_cpu`: each replica takes ``cpuCores`` cores of one node, free ones first; when
every core is taken, CPU replicas share the least-used cores (a CPU core, unlike a GPU, can be
time-shared) and the assignment says so. A node where the replica gets its cores to itself goes
first, then a node without GPUs (a GPU node's cores feed its GPU replicas: their engines'
scheduler and tokenizer threads, the host side of every transfer), then a warmer node
(`PlacementRequest.warmth`: it holds the weights, the image), then the node with the most free
cores. Called by
`PlacementStrategy.place_replicas`. Pure.

`cpu_sharing_notes` says, per node, how many CPU replicas share how many cores, for the people
reading `fleet plan` and `fleet up` (`fleet.cli.placement`, `fleet.local.progress`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from fleet.inventory.model import Inventory
from fleet.placement.shapes import Assignment, PlacementRequest, ReplicaPlacement


def place_cpu(request: PlacementRequest, inventory: Inventory, held: Counter[str]) -> list[ReplicaPlacement]:
    """Up to ``request.count`` CPU replicas; only nodes with too few cores in total refuse one.
    Updates ``held``."""
    need = request.shape.cpu_cores
    nodes = [n for n in inventory.nodes if len(n.cpu_cores) >= need]
    warm = {n.name: request.warmth(n) for n in nodes}

    free = {n.name: sum(1 for c in n.cpu_cores if not held[f"cpu:{c}"]) for n in nodes}   # kept as we place

    def rank(n) -> tuple[bool, bool, int, int]:
        return free[n.name] >= need, not n.gpus, warm[n.name], free[n.name]

    placements = []
    for _ in range(request.count if nodes else 0):
        node = max(nodes, key=rank)   # the first of equals: inventory order
        # Least-used cores first, then lowest index: free cores before shared ones.
        chosen = sorted(sorted(node.cpu_cores, key=lambda c: (held[f"cpu:{c}"], c))[:need])
        exclusive = all(held[f"cpu:{c}"] == 0 for c in chosen)
        cores = ",".join(str(c) for c in chosen)
        placement = ReplicaPlacement((Assignment(
            node=node.name,
            devices=tuple(f"cpu:{c}" for c in chosen),
            # vLLM's CPU backend binds its OpenMP threads to these cores (vllm/envs.py,
            # VLLM_CPU_OMP_THREADS_BIND: "0-31" ranges or "0,1" lists).
            env={"VLLM_CPU_OMP_THREADS_BIND": cores, "CUDA_VISIBLE_DEVICES": ""},
            label=f"cpu:{cores}" + ("" if exclusive else " (shared)"),
            exclusive=exclusive,
        ),))
        held.update(placement.devices)
        free[node.name] = sum(1 for c in node.cpu_cores if not held[f"cpu:{c}"])
        placements.append(placement)
    return placements


def cpu_sharing_notes(placements: Iterable[ReplicaPlacement]) -> list[str]:
    """One line per node where CPU replicas hold a core more than once, sorted by node: "cpu
    (shared) on laptop: 5 replicas on 2 cores, they share CPU time". ``placements``: every live
    replica's placement (GPU and MIG members are ignored). Cores are those the replicas hold: a
    core is shared only once no core of the node is free (`place_cpu`), so they are all the
    node's cores then."""
    replicas: Counter[str] = Counter()
    holds: Counter[str] = Counter()
    cores: dict[str, set[str]] = {}
    for placement in placements:
        for m in placement.members:
            if m.devices and all(d.startswith("cpu:") for d in m.devices):
                replicas[m.node] += 1
                holds[m.node] += len(m.devices)
                cores.setdefault(m.node, set()).update(m.devices)
    return [f"cpu (shared) on {node}: {replicas[node]} replicas on {len(cores[node])} cores, they share CPU time"
            for node in sorted(replicas) if holds[node] > len(cores[node])]  # fmt: skip
