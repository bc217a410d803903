"""The inventory file: a declared cluster (or a simulated one) in YAML.

Owns the pydantic models of the ``kind: Inventory`` document, loading it into an `Inventory`
(plus the devices the file marks as already in use), and writing an `Inventory` back as a
document (`fleet inventory --discover` prints one, so a discovered machine becomes a file).
Every problem names the file, the node (index and name) and the field:
``inventory.yaml nodes[3] (gpu-node-3).gpus[2].product: required ...``.
Called by `fleet plan` and `fleet inventory`.

A node lists its GPUs one by one (``gpus``), or as ``gpuCount`` GPUs of ``gpuProduct`` /
``gpuMemoryMib``, optionally overriding some by index in ``gpus``. UUIDs default to
``GPU-<node>-<index>`` (and ``MIG-<node>-<index>-<n>``), good for simulation; a cluster that
runs replicas locally needs the real ones (`fleet inventory --discover` prints them).
NVLink: ``nvswitch: true`` (all GPUs of the node share NVSwitch) or ``nvlinkDomains`` (lists of
GPU indexes); with neither, the topology is unknown and GPUs are treated as unlinked.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from fleet.engines.cuda import format_cuda, parse_cuda_version
from fleet.inventory.mig import MigSlot, check_geometry, fit_geometry, mig_model_for
from fleet.inventory.model import CLOCK_EVENT_BITS, Gpu, GpuHealth, Inventory, MigInstance, NodeInventory, clock_event_names
from fleet.spec import format_errors
from fleet.base.names import MIG_PROFILE
from fleet.base.spec import FieldError, SpecModel
from fleet.base.yaml_text import yaml_problem

API_VERSION = "fleet.inference.dev/v1alpha1"
KIND = "Inventory"
# Kubernetes node names are DNS-1123 subdomains.
_DRIVER_VERSION = re.compile(r"^\d+(\.\d+){1,2}$")
_NODE_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class PcieSpec(SpecModel):
    gen: int | None = Field(None, ge=1, le=7, description="Current PCIe link generation.")
    width: int | None = Field(None, ge=1, le=32, description="Current PCIe link width (lanes).")


class HealthSpec(SpecModel):
    ecc_uncorrected: int = Field(0, ge=0, description="Volatile uncorrected ECC errors; any makes the GPU unplaceable.")
    row_remap_pending: bool = Field(False, description="A row remap waits for a GPU reset: unplaceable.")
    row_remap_failure: bool = Field(False, description="Row remapping failed: unplaceable.")
    clock_event_reasons: list[str] = Field(
        default_factory=list,
        description="NVML clock event reasons now active, by name (hwThermalSlowdown, hwSlowdown, "
        "swThermalSlowdown, hwPowerBrakeSlowdown make the GPU unplaceable).",
    )
    temperature_c: int | None = Field(None, description="GPU temperature, degrees Celsius.")
    slowdown_temperature_c: int | None = Field(None, description="NVML slowdown threshold, degrees Celsius.")
    problems: list[str] = Field(default_factory=list, description="Other problems, e.g. 'cordoned for repair'.")

    @field_validator("clock_event_reasons")
    @classmethod
    def _known_reasons(cls, v: list[str]) -> list[str]:
        unknown = [r for r in v if r not in CLOCK_EVENT_BITS]
        if unknown:
            raise ValueError(f"unknown clock event reason(s) {', '.join(unknown)}; known: {', '.join(CLOCK_EVENT_BITS)}")
        return v


class MigInstanceSpec(SpecModel):
    profile: str = Field(..., description="MIG profile, e.g. 3g.40gb.")
    uuid: str | None = Field(None, description="MIG device UUID; default MIG-<node>-<gpu index>-<n>.")
    start: int | None = Field(None, ge=0, le=7, description="First memory slice of its placement; found if unset.")
    in_use: bool = Field(False, description="Already taken by a workload Fleet does not manage.")

    @field_validator("profile")
    @classmethod
    def _mig_name(cls, v: str) -> str:
        if not MIG_PROFILE.match(v):
            raise ValueError(f"{v!r} is not a MIG profile name such as 1g.10gb or 3g.40gb")
        return v


class GpuSpec(SpecModel):
    index: int = Field(..., ge=0, le=63, description="GPU index on the node (NVML order).")
    uuid: str | None = Field(None, description="GPU UUID; default GPU-<node>-<index>.")
    product: str | None = Field(None, description="NVML product name; default the node's gpuProduct.")
    memory_mib: int | None = Field(None, gt=0, description="Memory in MiB; default the node's gpuMemoryMib.")
    mig_enabled: bool = Field(False, description="MIG mode on: the GPU serves only through its MIG instances.")
    mig_instances: list[MigInstanceSpec] = Field(default_factory=list)
    health: HealthSpec = Field(default_factory=HealthSpec)
    pcie: PcieSpec | None = None
    pci_bus_id: str | None = None
    in_use: bool = Field(False, description="Already taken by a workload Fleet does not manage.")

    @model_validator(mode="after")
    def _mig(self) -> GpuSpec:
        if self.mig_instances and not self.mig_enabled:
            raise FieldError("migInstances", "MIG instances need migEnabled: true")
        if self.mig_enabled and self.in_use:
            raise FieldError("inUse", "a GPU in MIG mode is used through its instances; mark those inUse")
        return self


class NodeSpec(SpecModel):
    name: str = Field(..., max_length=253, description="Node name (a DNS-1123 subdomain, as in Kubernetes).")
    zone: str | None = Field(None, description="Failure domain: zone.")
    rack: str | None = Field(None, description="Failure domain: rack.")
    network_block: str | None = Field(None, description="Nodes of one network block may host a gang together.")
    nvlink_fabric: str | None = Field(None, description="Multi-node NVLink domain (e.g. an NVL72 rack).")
    labels: dict[str, str] = Field(default_factory=dict)
    cpu_cores: int = Field(0, ge=0, le=4096, description="CPU cores (for CPU replicas).")
    gpu_count: int | None = Field(None, ge=0, le=64, description="GPUs 0..N-1 of gpuProduct, unless listed in gpus.")
    gpu_product: str | None = Field(None, description="Default product of the node's GPUs.")
    gpu_memory_mib: int | None = Field(None, gt=0, description="Default memory of the node's GPUs, MiB.")
    gpus: list[GpuSpec] = Field(default_factory=list)
    nvswitch: bool = Field(False, description="All GPUs of the node share NVLink through NVSwitch.")
    nvlink_domains: list[list[int]] | None = Field(None, description="GPU indexes that share NVLink, per domain.")
    cached: list[str] = Field(default_factory=list, description="Engine images and model sources present (warm).")
    driver_version: str | None = Field(
        None, description="NVIDIA driver version, e.g. '580.159.04' (nvidia-smi, NVML nvmlSystemGetDriverVersion).")
    cuda_driver_version: str | None = Field(
        None, description="Newest CUDA the driver supports, e.g. '13.0' (nvidia-smi's 'CUDA Version', NVML "
        "nvmlSystemGetCudaDriverVersion). Derived from driverVersion when unset.")

    @field_validator("driver_version")
    @classmethod
    def _driver(cls, v: str | None) -> str | None:
        if v is not None and not _DRIVER_VERSION.match(v):
            raise ValueError(f"{v!r} is not an NVIDIA driver version such as 580.159.04")
        return v

    @field_validator("cuda_driver_version", mode="before")
    @classmethod
    def _cuda(cls, v: object) -> str | None:
        if v is None:
            return None
        if isinstance(v, float):   # YAML reads 13.0 unquoted as a number
            v = f"{v:.1f}"
        return format_cuda(parse_cuda_version(v.strip() if isinstance(v, str) else v))

    @field_validator("name")
    @classmethod
    def _dns(cls, v: str) -> str:
        if not _NODE_NAME.match(v):
            raise ValueError(f"{v!r} is not a DNS-1123 subdomain (lower-case letters, digits, '-' and '.')")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> NodeSpec:
        seen: dict[int, int] = {}
        for i, g in enumerate(self.gpus):
            if g.index in seen:
                raise FieldError(f"gpus[{i}].index", f"GPU index {g.index} is also gpus[{seen[g.index]}]")
            seen[g.index] = i
            if self.gpu_count is not None and g.index >= self.gpu_count:
                raise FieldError(f"gpus[{i}].index", f"{g.index} is outside gpuCount {self.gpu_count} (0..{self.gpu_count - 1})")
            if (g.product or self.gpu_product) is None:
                raise FieldError(f"gpus[{i}].product", "required (or set gpuProduct on the node)")
            if (g.memory_mib or self.gpu_memory_mib) is None:
                raise FieldError(f"gpus[{i}].memoryMib", "required (or set gpuMemoryMib on the node)")
        if self.gpu_count and len(seen) < self.gpu_count:
            if self.gpu_product is None:
                raise FieldError("gpuProduct", "required with gpuCount (the product of GPUs not listed in gpus)")
            if self.gpu_memory_mib is None:
                raise FieldError("gpuMemoryMib", "required with gpuCount (the memory of GPUs not listed in gpus)")
        indexes = set(range(self.gpu_count or 0)) | set(seen)
        if self.nvswitch and self.nvlink_domains is not None:
            raise FieldError("nvlinkDomains", "set either nvswitch: true or nvlinkDomains, not both")
        placed: dict[int, int] = {}
        for d, dom in enumerate(self.nvlink_domains or []):
            for idx in dom:
                if idx not in indexes:
                    raise FieldError(f"nvlinkDomains[{d}]", f"GPU {idx} is not a GPU of this node")
                if idx in placed:
                    raise FieldError(f"nvlinkDomains[{d}]", f"GPU {idx} is also in nvlinkDomains[{placed[idx]}]")
                placed[idx] = d
        for i, g in enumerate(self.gpus):
            problem = _mig_problem(g, g.product or self.gpu_product, g.memory_mib or self.gpu_memory_mib)
            if problem:
                raise FieldError(f"gpus[{i}].{problem[0]}", problem[1])
        return self


def _mig_problem(g: GpuSpec, product: str, memory_mib: int) -> tuple[str, str] | None:
    model = mig_model_for(product, memory_mib)
    if model is None:
        return None   # a product without a table: trust the declared profiles
    for j, m in enumerate(g.mig_instances):
        if model.profile(m.profile) is None:
            return f"migInstances[{j}].profile", (
                f"{m.profile} is not a MIG profile of {model.title} (profiles: {', '.join(model.profile_names())})")
    fixed = [MigSlot(m.profile, m.start) for m in g.mig_instances if m.start is not None]
    problem = check_geometry(model, fixed)
    if problem is None and fit_geometry(model, [m.profile for m in g.mig_instances if m.start is None], fixed) is None:
        problem = "these instances do not fit on one GPU together (MIG placement rules)"
    return ("migInstances", f"invalid MIG geometry for {model.title}: {problem}") if problem else None


class InventoryMetadata(SpecModel):
    name: str = Field("inventory", description="A name for this cluster.")


class InventoryDocument(SpecModel):
    """A declared cluster: nodes, their GPUs, NVLink domains, failure domains and warm caches."""

    api_version: Literal["fleet.inference.dev/v1alpha1"] = Field(..., alias="apiVersion")
    kind: Literal["Inventory"]
    metadata: InventoryMetadata = Field(default_factory=InventoryMetadata)
    nodes: list[NodeSpec] = Field(..., min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> InventoryDocument:
        names: dict[str, int] = {}
        uuids: dict[str, str] = {}
        for i, node in enumerate(self.nodes):
            if node.name in names:
                raise FieldError(f"nodes[{i}].name", f"{node.name!r} is also nodes[{names[node.name]}]")
            names[node.name] = i
            for j, g in enumerate(node.gpus):
                if g.uuid is None:
                    continue
                if g.uuid in uuids:
                    raise FieldError(f"nodes[{i}].gpus[{j}].uuid", f"{g.uuid} is also {uuids[g.uuid]}")
                uuids[g.uuid] = f"nodes[{names[node.name]}].gpus[{j}]"
        return self


@dataclass(frozen=True)
class LoadedInventory:
    inventory: Inventory
    in_use: Counter[str]          # device ids the file marks inUse
    name: str = "inventory"


class InventoryError(Exception):
    """The inventory file is invalid; ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def parse_inventory(doc: Any, where: str = "") -> LoadedInventory:
    """Validate one parsed YAML document. Raises InventoryError naming node and field."""
    if not isinstance(doc, dict):
        raise InventoryError([f"{where}(document): must be a mapping, got {type(doc).__name__}"])
    try:
        parsed = InventoryDocument.model_validate(doc)
    except ValidationError as err:
        raise InventoryError([_name_nodes(line, doc, where) for line in format_errors(err)]) from None
    return _to_inventory(parsed)


def load_inventory(path: Path) -> LoadedInventory:
    """Read and validate an inventory file. Raises InventoryError (unreadable file, YAML syntax
    with line and column, invalid fields)."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise InventoryError([f"{path}: cannot read: {err.strerror or err}"]) from None
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as err:
        raise InventoryError([yaml_problem(str(path), err)]) from None
    if len(docs) != 1:
        raise InventoryError([f"{path}: expected one Inventory document, found {len(docs)}"])
    return parse_inventory(docs[0], f"{path} ")


def _name_nodes(line: str, doc: dict, where: str) -> str:
    """``nodes[3].gpus[2].product: ...`` -> ``<where>nodes[3] (gpu-node-3).gpus[2].product: ...``."""
    match = re.match(r"^nodes\[(\d+)\]", line)
    nodes = doc.get("nodes")
    if match and isinstance(nodes, list) and int(match.group(1)) < len(nodes):
        node = nodes[int(match.group(1))]
        name = node.get("name") if isinstance(node, dict) else None
        if isinstance(name, str):
            line = f"{match.group(0)} ({name}){line[match.end():]}"
    return where + line


def _to_inventory(doc: InventoryDocument) -> LoadedInventory:
    in_use: Counter[str] = Counter()
    nodes = []
    for spec in doc.nodes:
        listed = {g.index: g for g in spec.gpus}
        gpus = []
        for index in sorted(set(range(spec.gpu_count or 0)) | set(listed)):
            g = listed.get(index) or GpuSpec(index=index)
            uuid = g.uuid or f"GPU-{spec.name}-{index}"
            product = g.product or spec.gpu_product
            memory = g.memory_mib or spec.gpu_memory_mib
            gpus.append(Gpu(
                index=index, uuid=uuid, product=product, memory_mib=memory, mig_enabled=g.mig_enabled,
                mig_instances=_mig_instances(spec.name, g, uuid, product, memory, in_use),
                health=GpuHealth(
                    ecc_uncorrected=g.health.ecc_uncorrected, row_remap_pending=g.health.row_remap_pending,
                    row_remap_failure=g.health.row_remap_failure,
                    clock_event_reasons=sum(CLOCK_EVENT_BITS[r] for r in set(g.health.clock_event_reasons)),
                    temperature_c=g.health.temperature_c, slowdown_temperature_c=g.health.slowdown_temperature_c,
                    other_problems=tuple(g.health.problems),
                ),
                pci_bus_id=g.pci_bus_id,
                pcie_gen=g.pcie.gen if g.pcie else None, pcie_width=g.pcie.width if g.pcie else None,
            ))
            if g.in_use:
                in_use[uuid] += 1
        if spec.nvswitch:
            domains: tuple[tuple[int, ...], ...] | None = (tuple(g.index for g in gpus),)
        elif spec.nvlink_domains is not None:
            domains = tuple(tuple(sorted(d)) for d in spec.nvlink_domains)
        else:
            domains = None
        nodes.append(NodeInventory(
            name=spec.name, gpus=tuple(gpus), cpu_cores=tuple(range(spec.cpu_cores)), labels=dict(spec.labels),
            nvlink_domains=domains, zone=spec.zone, rack=spec.rack, network_block=spec.network_block,
            nvlink_fabric=spec.nvlink_fabric, cached=frozenset(spec.cached), driver_version=spec.driver_version,
            cuda_driver_version=parse_cuda_version(spec.cuda_driver_version) if spec.cuda_driver_version else None,
        ))
    return LoadedInventory(Inventory(tuple(nodes)), in_use, doc.metadata.name)


def _mig_instances(node: str, g: GpuSpec, uuid: str, product: str, memory: int, in_use: Counter[str]) -> tuple[MigInstance, ...]:
    model = mig_model_for(product, memory)
    fixed = [MigSlot(m.profile, m.start) for m in g.mig_instances if m.start is not None]
    found = iter(fit_geometry(model, [m.profile for m in g.mig_instances if m.start is None], fixed) or ()) if model else iter(())
    # fit_geometry returns new slots largest first; hand them out per profile in that order.
    free_starts: dict[str, list[int]] = {}
    for slot in found:
        free_starts.setdefault(slot.profile, []).append(slot.start)
    out = []
    for j, m in enumerate(g.mig_instances):
        start = m.start if m.start is not None else (free_starts.get(m.profile) or [None]).pop(0)
        mig_uuid = m.uuid or f"MIG-{node}-{g.index}-{j}"
        out.append(MigInstance(mig_uuid, m.profile, uuid, start))
        if m.in_use:
            in_use[mig_uuid] += 1
    return tuple(out)


def inventory_document(inventory: Inventory, name: str = "inventory", in_use: Counter[str] | None = None) -> dict:
    """An `Inventory` as an inventory-file document (camelCase, defaults left out); loads back equal."""
    in_use = in_use or Counter()
    nodes = []
    for n in inventory.nodes:
        gpus = []
        for g in n.gpus:
            h = g.health
            gpus.append(GpuSpec(
                index=g.index, uuid=g.uuid, product=g.product, memory_mib=g.memory_mib, mig_enabled=g.mig_enabled,
                mig_instances=[MigInstanceSpec(profile=m.profile, uuid=m.uuid, start=m.start, in_use=in_use[m.uuid] > 0)
                               for m in g.mig_instances],
                health=HealthSpec(
                    ecc_uncorrected=h.ecc_uncorrected, row_remap_pending=h.row_remap_pending,
                    row_remap_failure=h.row_remap_failure, clock_event_reasons=clock_event_names(h.clock_event_reasons),
                    temperature_c=h.temperature_c, slowdown_temperature_c=h.slowdown_temperature_c,
                    problems=list(h.other_problems),
                ),
                pcie=PcieSpec(gen=g.pcie_gen, width=g.pcie_width) if (g.pcie_gen or g.pcie_width) else None,
                pci_bus_id=g.pci_bus_id, in_use=in_use[g.uuid] > 0,
            ))
        nodes.append(NodeSpec(
            name=n.name, zone=n.zone, rack=n.rack, network_block=n.network_block, nvlink_fabric=n.nvlink_fabric,
            labels=n.labels, cpu_cores=len(n.cpu_cores), gpus=gpus,
            nvlink_domains=None if n.nvlink_domains is None else [list(d) for d in n.nvlink_domains if len(d) > 1],
            cached=sorted(n.cached), driver_version=n.driver_version,
            cuda_driver_version=format_cuda(n.cuda_driver_version) if n.cuda_driver_version else None,
        ))
    doc = InventoryDocument(apiVersion=API_VERSION, kind=KIND, metadata=InventoryMetadata(name=name), nodes=nodes)
    out = doc.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    out["apiVersion"], out["kind"] = API_VERSION, KIND   # written even though they are "defaults"
    return {"apiVersion": out.pop("apiVersion"), "kind": out.pop("kind"), **out}
