"""What one node offers to replicas: whole GPUs, MIG instances and CPU cores.

Owns the inventory data model of a node and its discovery on this machine: GPUs and MIG
instances through NVML (`nvidia-ml-py`, behind the thin `NvmlReader` wrapper so tests can fake
it) and CPU cores from the process's CPU affinity. Called by `fleet up` (local backend) to feed
`fleet.placement`. The placement issue extends this with NVLink domains, health and
failure-domain labels; the data model keeps room for them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class MigInstance:
    uuid: str            # "MIG-..." as NVML reports it; what CUDA_VISIBLE_DEVICES takes
    profile: str         # e.g. "3g.40gb"
    parent_uuid: str


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str            # "GPU-..."
    product: str         # NVML device name, e.g. "NVIDIA H100 80GB HBM3"
    memory_mib: int
    mig_enabled: bool = False
    mig_instances: tuple[MigInstance, ...] = ()


@dataclass(frozen=True)
class NodeInventory:
    name: str
    gpus: tuple[Gpu, ...] = ()
    cpu_cores: tuple[int, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        """One line for humans, e.g. ``2 CPU cores, no GPU``."""
        parts = [f"{len(self.cpu_cores)} CPU cores"]
        if not self.gpus:
            parts.append("no GPU")
        for gpu in self.gpus:
            mig = f", MIG: {', '.join(m.profile for m in gpu.mig_instances)}" if gpu.mig_enabled else ""
            parts.append(f"GPU{gpu.index} {gpu.product} ({gpu.memory_mib} MiB{mig})")
        return "; ".join(parts)


class NvmlReader(Protocol):
    """The few NVML calls discovery makes. `PynvmlReader` is the real one."""

    def devices(self) -> list[dict]:
        """One dict per GPU: index, uuid, name, memory_total_mib, mig_enabled, mig (list of
        dicts with uuid and name). Raises RuntimeError when NVML is unavailable."""
        ...


class PynvmlReader:
    """NVML through nvidia-ml-py. Every call to the library is in this class."""

    def devices(self) -> list[dict]:
        try:
            import pynvml
        except ImportError as err:  # nvidia-ml-py is a dependency; a broken install lands here
            raise RuntimeError(f"nvidia-ml-py not importable: {err}") from err
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise RuntimeError(f"NVML unavailable: {err}") from err
        try:
            out = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                try:
                    mig_enabled = pynvml.nvmlDeviceGetMigMode(h)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
                except pynvml.NVMLError:
                    mig_enabled = False
                migs = []
                if mig_enabled:
                    for j in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                        try:
                            m = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                        except pynvml.NVMLError:
                            continue
                        migs.append({"uuid": pynvml.nvmlDeviceGetUUID(m), "name": pynvml.nvmlDeviceGetName(m)})
                out.append({
                    "index": i,
                    "uuid": pynvml.nvmlDeviceGetUUID(h),
                    "name": pynvml.nvmlDeviceGetName(h),
                    "memory_total_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // (1024 * 1024),
                    "mig_enabled": mig_enabled,
                    "mig": migs,
                })
            return out
        finally:
            pynvml.nvmlShutdown()


# MIG device names end in the profile: "NVIDIA H100 80GB HBM3 MIG 3g.40gb".
_MIG_NAME = re.compile(r"MIG\s+([1-7]g\.[0-9]+gb(?:\+me)?)\s*$")


def discover_local(nvml: NvmlReader | None = None, node_name: str = "local") -> NodeInventory:
    """Inventory of this machine. A machine without NVML (no driver, no GPU) has no GPUs."""
    try:
        raw = (nvml or PynvmlReader()).devices()
    except RuntimeError:
        raw = []
    gpus = []
    for d in raw:
        migs = []
        for m in d.get("mig", []):
            match = _MIG_NAME.search(m["name"])
            if match:
                migs.append(MigInstance(uuid=m["uuid"], profile=match.group(1), parent_uuid=d["uuid"]))
        gpus.append(Gpu(
            index=d["index"], uuid=d["uuid"], product=d["name"], memory_mib=int(d["memory_total_mib"]),
            mig_enabled=bool(d.get("mig_enabled")), mig_instances=tuple(migs),
        ))
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return NodeInventory(name=node_name, gpus=tuple(gpus), cpu_cores=cores)
