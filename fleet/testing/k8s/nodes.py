"""Node objects as the API serves them, labelled as NVIDIA GPU Feature Discovery labels them
(tests use them as the inventory of the fake cluster)."""

from __future__ import annotations


def node(name: str, *, cpu: int = 8, gpus: int = 0, product: str = "NVIDIA-H100-80GB-HBM3", memory_mib: int = 81559,
         mig: dict[str, int] | None = None, ready: bool = True, unschedulable: bool = False,
         taints: list[dict] | None = None, labels: dict[str, str] | None = None,
         images: list[str] | None = None, annotations: dict[str, str] | None = None) -> dict:  # fmt: skip
    """A Node: ``gpus`` whole GPUs in one NVLink domain (Fleet's node-agent label), or MIG
    devices per profile (mixed strategy) on one GPU; ``images`` in ``status.images`` as a
    container runtime lists them (fully qualified: ``docker.io/library/x:tag``)."""
    lab = {"kubernetes.io/hostname": name, **(labels or {})}
    allocatable = {"cpu": str(cpu), "memory": "64Gi", "pods": "110"}
    if gpus:
        lab.update({"nvidia.com/gpu.product": product, "nvidia.com/gpu.count": str(gpus),
                    "nvidia.com/gpu.memory": str(memory_mib), "nvidia.com/gpu.present": "true",
                    "nvidia.com/mig.strategy": "mixed" if mig else "none"})  # fmt: skip
        if not mig:
            lab["fleet.inference.dev/nvlink-domains"] = f"0-{gpus - 1}"
            allocatable["nvidia.com/gpu"] = str(gpus)
        for profile, count in (mig or {}).items():
            lab[f"nvidia.com/mig-{profile}.count"] = str(count)
            allocatable[f"nvidia.com/mig-{profile}"] = str(count)
    from fleet.inventory.gfd import image_aliases

    listed = [{"names": [max(image_aliases(i), key=lambda n: (n.count("/"), len(n)))], "sizeBytes": 9_000_000_000}
              for i in images or []]  # fmt: skip
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": lab, **({"annotations": annotations} if annotations else {})},
        "spec": {"unschedulable": unschedulable, "taints": taints or []},
        "status": {"capacity": dict(allocatable), "allocatable": allocatable,
                   "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                   **({"images": listed} if listed else {})},
    }  # fmt: skip
