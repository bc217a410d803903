"""Small inventory builders for placement tests (unique UUIDs per node: GPU-<node>-<i>)."""

from __future__ import annotations

from collections import Counter

from fleet.inventory.model import Gpu, GpuHealth, Inventory, MigInstance, NodeInventory

H100 = "NVIDIA H100 80GB HBM3"
A100_80 = "NVIDIA A100-SXM4-80GB"
L40S = "NVIDIA L40S"

TOPOLOGIES = {
    "nvswitch": lambda n: (tuple(range(n)),),
    "quads": lambda n: tuple(tuple(range(i, min(i + 4, n))) for i in range(0, n, 4)),
    "pairs": lambda n: tuple(tuple(range(i, min(i + 2, n))) for i in range(0, n, 2)),
    "pcie": lambda n: (),
}


def node(name: str, n: int = 8, product: str = H100, memory_mib: int = 81559, topology: str = "nvswitch",
         mig: dict[int, list[tuple[str, int]]] | None = None, sick: dict[int, GpuHealth] | None = None,
         **fields) -> NodeInventory:
    mig = mig or {}
    sick = sick or {}
    gpus = []
    for i in range(n):
        uuid = f"GPU-{name}-{i}"
        instances = tuple(MigInstance(f"MIG-{name}-{i}-{j}", p, uuid, s) for j, (p, s) in enumerate(mig.get(i, [])))
        gpus.append(Gpu(i, uuid, product, memory_mib, mig_enabled=i in mig, mig_instances=instances,
                        health=sick.get(i, GpuHealth())))
    return NodeInventory(name, tuple(gpus), nvlink_domains=TOPOLOGIES[topology](n), **fields)


def cluster(*nodes: NodeInventory) -> Inventory:
    return Inventory(tuple(nodes))


def busy(node: NodeInventory, *indexes: int) -> Counter[str]:
    """in_use marking GPUs of ``node`` as held."""
    return Counter(f"GPU-{node.name}-{i}" for i in indexes)
