"""The inventory data model: nodes -> GPUs -> MIG instances, NVLink domains, health, labels.

Owns the immutable records every inventory source produces (NVML discovery in
`fleet.inventory.nvml`, Kubernetes node labels in `fleet.inventory.gfd`, the inventory file in
`fleet.inventory.file`) and that placement (`fleet.placement`) reads: `Gpu`, `MigInstance`,
`GpuHealth`, `NodeInventory`, `Inventory`, and `product_key`, the one way products are compared.
Pure data: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

# NVML clock event ("throttle") reason bits, nvml.h `nvmlClocksEventReason*` (same values as the
# older `nvmlClocksThrottleReason*`). Names are the YAML spelling used in inventory files.
CLOCK_EVENT_BITS: dict[str, int] = {
    "gpuIdle": 0x1,
    "applicationsClocksSetting": 0x2,
    "swPowerCap": 0x4,
    "hwSlowdown": 0x8,
    "syncBoost": 0x10,
    "swThermalSlowdown": 0x20,
    "hwThermalSlowdown": 0x40,
    "hwPowerBrakeSlowdown": 0x80,
    "displayClockSetting": 0x100,
}
# The reasons that mean the GPU is being held back by heat or by a hardware/power fault. Idle,
# application clocks, the software power cap (normal under full load), sync boost and display
# clocks are ordinary operation and do not make a GPU unplaceable.
_CLOCK_EVENT_PROBLEMS: dict[int, str] = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake slowdown",
}


@lru_cache(maxsize=1024)
def product_key(product: str) -> str:
    """Comparable form of a GPU product name.

    NVML says ``NVIDIA H100 80GB HBM3``; GPU Feature Discovery labels the same GPU
    ``NVIDIA-H100-80GB-HBM3`` (spaces turned into dashes, label values allow no spaces) and older
    GFD versions drop the ``NVIDIA`` prefix (``A100-SXM4-40GB``). All three give ``h100-80gb-hbm3``
    / ``a100-sxm4-40gb``.
    """
    key = re.sub(r"[\s_\-]+", "-", product.strip()).lower()
    return key.removeprefix("nvidia-")


def clock_event_names(bits: int) -> list[str]:
    """Names of the set NVML clock event reason bits, e.g. ``0x41 -> ['gpuIdle', 'hwThermalSlowdown']``."""
    return [name for name, bit in CLOCK_EVENT_BITS.items() if bits & bit]


@dataclass(frozen=True)
class GpuHealth:
    """Health readings of one GPU (NVML). Unknown readings stay at their healthy default.

    Sources: ``nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE)``, ``nvmlDeviceGetRemappedRows``
    (pending: a GPU reset is needed to apply a remap; failure: remapping failed, the GPU should be
    serviced - NVIDIA "GPU Memory Error Management" guide), ``nvmlDeviceGetCurrentClocksEventReasons``
    and ``nvmlDeviceGetTemperature`` / ``nvmlDeviceGetTemperatureThreshold(SLOWDOWN)``.
    """

    ecc_uncorrected: int = 0
    row_remap_pending: bool = False
    row_remap_failure: bool = False
    clock_event_reasons: int = 0            # NVML bitmask, see CLOCK_EVENT_BITS
    temperature_c: int | None = None
    slowdown_temperature_c: int | None = None
    other_problems: tuple[str, ...] = ()    # from other sources: device plugin, an operator's note

    def problems(self) -> tuple[str, ...]:
        """Why this GPU must not host a replica; empty when healthy. Short, node-independent
        phrases, so explanations can group nodes by them."""
        out = []
        if self.ecc_uncorrected > 0:
            out.append("uncorrected ECC errors")
        if self.row_remap_pending:
            out.append("row remap pending (needs GPU reset)")
        if self.row_remap_failure:
            out.append("row remap failure")
        for bit, what in _CLOCK_EVENT_PROBLEMS.items():
            if self.clock_event_reasons & bit:
                out.append(what)
        if (self.temperature_c is not None and self.slowdown_temperature_c is not None
                and self.temperature_c >= self.slowdown_temperature_c):
            out.append("at slowdown temperature")
        out.extend(self.other_problems)
        return tuple(out)

    @property
    def healthy(self) -> bool:
        return not self.problems()


@dataclass(frozen=True)
class MigInstance:
    """One MIG GPU instance (with its compute instance) as CUDA sees it."""

    uuid: str            # "MIG-..." as NVML reports it; what CUDA_VISIBLE_DEVICES takes
    profile: str         # e.g. "3g.40gb"
    parent_uuid: str
    start: int | None = None   # first memory slice of its placement (nvmlGpuInstanceGetInfo), if known


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str            # "GPU-..."
    product: str         # NVML device name, e.g. "NVIDIA H100 80GB HBM3"
    memory_mib: int
    mig_enabled: bool = False
    mig_instances: tuple[MigInstance, ...] = ()
    health: GpuHealth = GpuHealth()
    pci_bus_id: str | None = None
    pcie_gen: int | None = None          # current PCIe link generation
    pcie_width: int | None = None        # current PCIe link width (lanes)

    @property
    def product_key(self) -> str:
        return product_key(self.product)


@dataclass(frozen=True)
class NodeInventory:
    """One node: its GPUs, how they are linked, where it sits, and what it has cached.

    ``nvlink_domains`` lists GPU indexes that share NVLink (through NVSwitch or direct links);
    GPUs in no listed domain have no NVLink peer. ``None`` means the source did not report
    topology (GFD labels alone, for instance): placement then treats every GPU as unlinked and
    says so. ``nvlink_fabric`` names a multi-node NVLink domain (GB200 NVL72 rack: GFD's
    ``nvidia.com/gpu.clique``); ``network_block`` a group of nodes behind one network block;
    both let a replica wider than a node be placed as a gang. ``cached`` holds the engine images
    and model sources present on the node (warm), as the node agent reports them.
    ``driver_version`` is the NVIDIA driver (``580.159.04``: NVML ``nvmlSystemGetDriverVersion``,
    GFD's ``nvidia.com/cuda.driver-version.full``) and ``cuda_driver_version`` the newest CUDA it
    supports as (major, minor) (NVML ``nvmlSystemGetCudaDriverVersion`` 13000 -> (13, 0), GFD's
    ``nvidia.com/cuda.runtime-version.*``); None when the source does not say. Placement skips a
    node whose driver cannot run the engine's CUDA (`fleet.placement.compat`).
    """

    name: str
    gpus: tuple[Gpu, ...] = ()
    cpu_cores: tuple[int, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    nvlink_domains: tuple[tuple[int, ...], ...] | None = None
    zone: str | None = None
    rack: str | None = None
    network_block: str | None = None
    nvlink_fabric: str | None = None
    cached: frozenset[str] = frozenset()
    quarantined: dict[str, str] = field(default_factory=dict)   # GPU / MIG uuid -> why (node agent)
    driver_version: str | None = None
    cuda_driver_version: tuple[int, int] | None = None

    def with_quarantine(self, quarantined: dict[str, str]) -> NodeInventory:
        """This node as placement must see it while the node agent quarantines ``quarantined``
        (GPU or MIG instance uuid -> reason): a quarantined GPU is unhealthy (placement skips it,
        `GpuHealth.problems` says why), a quarantined MIG instance is left out. Pure."""
        if not quarantined:
            return self if not self.quarantined else replace(self, quarantined={})
        gpus = []
        for g in self.gpus:
            if g.uuid in quarantined:
                g = replace(g, health=replace(g.health, other_problems=(
                    *g.health.other_problems, f"quarantined: {quarantined[g.uuid]}")))
            if any(m.uuid in quarantined for m in g.mig_instances):
                g = replace(g, mig_instances=tuple(m for m in g.mig_instances if m.uuid not in quarantined))
            gpus.append(g)
        return replace(self, gpus=tuple(gpus), quarantined=dict(quarantined))

    @cached_property
    def domains(self) -> tuple[tuple[Gpu, ...], ...]:
        """Every GPU in exactly one NVLink domain: the declared ones, then each unlinked GPU
        alone. GPUs in a domain are in index order."""
        by_index = {g.index: g for g in self.gpus}
        out: list[tuple[Gpu, ...]] = []
        seen: set[int] = set()
        for dom in self.nvlink_domains or ():
            members = tuple(by_index[i] for i in sorted(dom) if i in by_index and i not in seen)
            seen.update(g.index for g in members)
            if members:
                out.append(members)
        out.extend((g,) for g in self.gpus if g.index not in seen)
        return tuple(out)

    @property
    def topology_known(self) -> bool:
        return self.nvlink_domains is not None

    def describe(self) -> str:
        """One line for humans, e.g. ``2 CPU cores, no GPU``."""
        parts = [f"{len(self.cpu_cores)} CPU cores"]
        if not self.gpus:
            parts.append("no GPU")
        for gpu in self.gpus:
            mig = f", MIG: {', '.join(m.profile for m in gpu.mig_instances)}" if gpu.mig_enabled else ""
            sick = f", UNHEALTHY: {'; '.join(gpu.health.problems())}" if not gpu.health.healthy else ""
            parts.append(f"GPU{gpu.index} {gpu.product} ({gpu.memory_mib} MiB{mig}{sick})")
        linked = [d for d in self.domains if len(d) > 1]
        if linked:
            parts.append("NVLink: " + " ".join("{" + ",".join(str(g.index) for g in d) + "}" for d in linked))
        if self.driver_version or self.cuda_driver_version:
            cuda = self.cuda_driver_version
            parts.append(f"driver {self.driver_version or '?'}" + (f" (CUDA {cuda[0]}.{cuda[1]})" if cuda else ""))
        if self.cached:   # weights and images held here: placement counts the node warm for them
            parts.append(f"holds: {', '.join(sorted(self.cached))}")
        return "; ".join(parts)


@dataclass(frozen=True)
class Inventory:
    """All nodes placement may use, in a fixed order (first-fit and tie-breaks follow it)."""

    nodes: tuple[NodeInventory, ...] = ()

    @cached_property
    def by_name(self) -> dict[str, NodeInventory]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def products(self) -> dict[str, Gpu]:
        """`product_key` -> the first GPU of that product in inventory order: its ``product`` is
        the name as this inventory spells it (NVML's ``NVIDIA H100 80GB HBM3`` locally, GFD's
        ``NVIDIA-H100-80GB-HBM3`` on Kubernetes), its memory the product's. Derived once per
        inventory (it is immutable)."""
        first: dict[str, Gpu] = {}
        for n in self.nodes:
            for g in n.gpus:
                first.setdefault(g.product_key, g)
        return first

    def node(self, name: str) -> NodeInventory:
        """The node called ``name``. Raises KeyError."""
        return self.by_name[name]

    def gpu_count(self) -> int:
        return sum(len(n.gpus) for n in self.nodes)
