"""Placement of replicas on one node's devices: the seam the placement issue fills out.

Owns the replica shape derived from a deployment (`ReplicaShape`), the result of placing one
replica (`Assignment`, with the environment that pins the engine to its devices), and
`LocalPlacer`, a pure strategy over a `NodeInventory` and the devices already in use:

- MIG: one free MIG instance of the requested profile (TP is 1 by spec validation).
- GPU: ``tensorParallelSize`` free whole GPUs of one product (not in MIG mode), lowest index first.
- CPU: ``cpuCores`` cores, free ones first; when every core is taken, CPU replicas share the
  least-used cores (a CPU core, unlike a GPU, can be time-shared) and say so.

Called by the controller. No I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from fleet.inventory import NodeInventory
from fleet.spec import InferenceDeployment


@dataclass(frozen=True)
class ReplicaShape:
    accelerator: str                 # "gpu" | "cpu"
    gpu_product: str | None = None
    tensor_parallel_size: int = 1
    mig_profile: str | None = None
    cpu_cores: int = 1

    @classmethod
    def of(cls, dep: InferenceDeployment) -> ReplicaShape:
        r = dep.spec.resources
        return cls(r.accelerator, r.gpu_product, r.tensor_parallel_size, r.mig_profile, r.cpu_cores)

    def describe(self) -> str:
        if self.accelerator == "cpu":
            return f"{self.cpu_cores} CPU core(s)"
        if self.mig_profile:
            return f"1 MIG {self.mig_profile} instance"
        return f"{self.tensor_parallel_size} whole GPU(s) of {self.gpu_product or 'any product'}"


@dataclass(frozen=True)
class Assignment:
    devices: tuple[str, ...]                      # device ids held: GPU/MIG UUIDs, "cpu:N"
    env: dict[str, str] = field(default_factory=dict)
    label: str = ""                               # for humans: "cpu:0", "gpu:0,1", "mig:3g.40gb@gpu0"
    exclusive: bool = True                        # False when devices are shared with other replicas


@dataclass(frozen=True)
class Unplaceable:
    reason: str


class LocalPlacer:
    """Places replicas on one node. Pure: same inputs, same answer."""

    def place(self, shape: ReplicaShape, node: NodeInventory, in_use: Counter[str]) -> Assignment | Unplaceable:
        """Choose devices for one replica.

        Args:
            shape: what one replica needs.
            node: the node's devices.
            in_use: device id -> number of live replicas holding it.
        """
        if shape.accelerator == "cpu":
            return self._place_cpu(shape, node, in_use)
        if shape.mig_profile:
            return self._place_mig(shape, node, in_use)
        return self._place_gpus(shape, node, in_use)

    def fits_at_all(self, shape: ReplicaShape, node: NodeInventory) -> Unplaceable | None:
        """Why ``shape`` can never fit this node even when empty, or None if it can."""
        result = self.place(shape, node, Counter())
        return result if isinstance(result, Unplaceable) else None

    @staticmethod
    def _place_cpu(shape: ReplicaShape, node: NodeInventory, in_use: Counter[str]) -> Assignment | Unplaceable:
        if shape.cpu_cores > len(node.cpu_cores):
            return Unplaceable(f"needs {shape.cpu_cores} CPU cores, node {node.name} has {len(node.cpu_cores)}")
        # Least-used cores first, then lowest index: free cores before shared ones.
        ranked = sorted(node.cpu_cores, key=lambda c: (in_use[f"cpu:{c}"], c))
        chosen = sorted(ranked[: shape.cpu_cores])
        exclusive = all(in_use[f"cpu:{c}"] == 0 for c in chosen)
        cores = ",".join(str(c) for c in chosen)
        return Assignment(
            devices=tuple(f"cpu:{c}" for c in chosen),
            # vLLM's CPU backend binds its OpenMP threads to these cores (vllm/envs.py,
            # VLLM_CPU_OMP_THREADS_BIND: "0-31" ranges or "0,1" lists).
            env={"VLLM_CPU_OMP_THREADS_BIND": cores, "CUDA_VISIBLE_DEVICES": ""},
            label=f"cpu:{cores}" + ("" if exclusive else " (shared)"),
            exclusive=exclusive,
        )

    @staticmethod
    def _place_gpus(shape: ReplicaShape, node: NodeInventory, in_use: Counter[str]) -> Assignment | Unplaceable:
        candidates = [
            g for g in node.gpus
            if not g.mig_enabled and (shape.gpu_product is None or g.product == shape.gpu_product)
        ]
        if len(candidates) < shape.tensor_parallel_size:
            products = sorted({g.product for g in node.gpus}) or ["no GPU"]
            return Unplaceable(
                f"needs {shape.describe()}; node {node.name} has {len(candidates)} such GPU(s) "
                f"outside MIG mode (present: {', '.join(products)})"
            )
        free = [g for g in candidates if in_use[g.uuid] == 0]
        if len(free) < shape.tensor_parallel_size:
            return Unplaceable(f"needs {shape.tensor_parallel_size} free GPU(s), {len(free)} free")
        chosen = free[: shape.tensor_parallel_size]
        return Assignment(
            devices=tuple(g.uuid for g in chosen),
            env={"CUDA_VISIBLE_DEVICES": ",".join(g.uuid for g in chosen)},
            label="gpu:" + ",".join(str(g.index) for g in chosen),
        )

    @staticmethod
    def _place_mig(shape: ReplicaShape, node: NodeInventory, in_use: Counter[str]) -> Assignment | Unplaceable:
        matching = [
            (g, m) for g in node.gpus for m in g.mig_instances
            if m.profile == shape.mig_profile and (shape.gpu_product is None or g.product == shape.gpu_product)
        ]
        if not matching:
            return Unplaceable(f"needs {shape.describe()}; node {node.name} has no MIG instance of that profile")
        for gpu, mig in matching:
            if in_use[mig.uuid] == 0:
                return Assignment(
                    devices=(mig.uuid,),
                    env={"CUDA_VISIBLE_DEVICES": mig.uuid},
                    label=f"mig:{mig.profile}@gpu{gpu.index}",
                )
        return Unplaceable(f"all {len(matching)} MIG {shape.mig_profile} instance(s) are in use")
