"""Inventory from Kubernetes node objects labelled by NVIDIA GPU Feature Discovery (GFD).

Owns `node_from_k8s` and `inventory_from_k8s`: pure functions over node objects as the
Kubernetes API returns them (dicts with ``metadata.labels`` and ``status.capacity`` /
``status.allocatable``). Called by the Kubernetes backend when it reports inventory; tests call
it with literal node dicts. No API calls here: the backend's client wrapper fetches the nodes.

Label names are those of the GFD README (NVIDIA/k8s-device-plugin,
docs/gpu-feature-discovery/README.md, "Generated Labels"):

- ``nvidia.com/gpu.product``, ``nvidia.com/gpu.count``, ``nvidia.com/gpu.memory`` (MiB);
- ``nvidia.com/mig.strategy``: ``none``, ``single`` (every GPU cut the same way; product,
  count and memory then describe the MIG devices, the product reads ``<GPU>-MIG-<profile>``) or
  ``mixed`` (``nvidia.com/mig-<profile>.count`` per profile);
- ``nvidia.com/gpu.clique``: ``<clusterUUID>.<cliqueID>`` of a multi-node NVLink domain;
- ``nvidia.com/cuda.driver-version.full`` (``580.159.04``) and ``nvidia.com/cuda.runtime-version.major``
  / ``.minor`` (``13`` / ``0``: despite the name, the CUDA version of the *driver*, GFD's
  ``newVersionLabeler`` reads it with NVML's ``nvmlSystemGetCudaDriverVersion``, internal/lm/nvml.go),
  or their deprecated spellings ``nvidia.com/cuda.driver.major`` / ``.minor`` / ``.rev`` and
  ``nvidia.com/cuda.runtime.major`` / ``.minor``; without GFD, the node agent's own labels
  (`LabelKeys.driver_version`, `LabelKeys.cuda_driver_version`, written by `fleet.k8s.node_facts`).

GFD reports neither GPU UUIDs nor NVLink topology nor per-GPU health. GPUs get stable
synthetic ids (``<node>/gpu<i>``; the Kubernetes backend asks for counts, not UUIDs); NVLink
domains come from Fleet's node label (`LabelKeys.nvlink_domains`, e.g. ``0-7`` or ``0-3_4-7``;
the node agent writes it from NVML: `format_nvlink_domains`), and are unknown without it; GPUs the NVIDIA device plugin
withholds from ``status.allocatable`` are marked unhealthy.

Quarantine (`quarantine_marks`): the node agent's annotation ``fleet.inference.dev/gpu-health``
(`fleet.inventory.gpu_health`) lists the GPUs and MIG instances it quarantines, by NVML index.
Each is marked on one synthetic id through `NodeInventory.with_quarantine`, so placement keeps
off it and `fleet.controller.drain.Drainer.drain_unhealthy` drains the replica placed there. Which synthetic id:
the device plugin, not Fleet, picks the GPUs a pod gets, so a replica placed on ``gpu0`` may
hold physical GPU 5. When the annotation says which pod holds the device and ``held`` says
which synthetic devices that pod was placed on, the mark goes on one of those (the drain hits
the replica that really holds it); otherwise on ``<node>/gpu<index>`` when no replica holds it
(its NVLink domain stays right), else on a GPU no replica holds. A GPU the device plugin
withholds and the agent quarantines is counted once.

Warmth (`NodeInventory.cached`, what `fleet.placement.shapes.PlacementRequest.is_warm` reads):
the container images of ``Node.status.images`` (the kubelet's list: ``names`` per image, at
most 50 images, largest first), each under every spelling `image_aliases` gives, plus the model
sources in Fleet's node-agent annotation (`LabelKeys.cached`, written by
`fleet.k8s.node_facts`). Owns `image_aliases` and `node_images` (also used by the
image pre-pull, `fleet.k8s.prepull`).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fleet.engines.cuda import parse_cuda_version
from fleet.inventory.gpu_health import ANNOTATION as GPU_HEALTH, GpuHealthFacts, parse_gpu_health
from fleet.inventory.mig import MigSlot, fit_geometry, max_instances, mig_model_for
from fleet.inventory.model import Gpu, GpuHealth, Inventory, MigInstance, NodeInventory

GFD_PRODUCT = "nvidia.com/gpu.product"
GFD_COUNT = "nvidia.com/gpu.count"
GFD_MEMORY = "nvidia.com/gpu.memory"
GFD_MIG_STRATEGY = "nvidia.com/mig.strategy"
GFD_CLIQUE = "nvidia.com/gpu.clique"
GFD_DRIVER = "nvidia.com/cuda.driver-version.full"
GFD_DRIVER_OLD = ("nvidia.com/cuda.driver.major", "nvidia.com/cuda.driver.minor", "nvidia.com/cuda.driver.rev")
GFD_CUDA = ("nvidia.com/cuda.runtime-version.major", "nvidia.com/cuda.runtime-version.minor")
GFD_CUDA_OLD = ("nvidia.com/cuda.runtime.major", "nvidia.com/cuda.runtime.minor")
_MIG_COUNT = re.compile(r"^nvidia\.com/mig-([1-7]g\.[0-9]+gb(?:\+me)?)\.count$")
_SINGLE_PRODUCT = re.compile(r"^(.+)-MIG-([1-7]g\.[0-9]+gb(?:\+me)?|INVALID)$")
_DRIVER_TEXT = re.compile(r"^\d+(\.\d+){1,2}$")
_UNHEALTHY = ("withheld from status.allocatable by the NVIDIA device plugin (unhealthy)",)


@dataclass(frozen=True)
class LabelKeys:
    """Which node labels carry failure domains and topology. Defaults: the well-known zone
    label of Kubernetes, and Fleet's own labels for what Kubernetes has no standard for."""

    zone: str = "topology.kubernetes.io/zone"
    rack: str = "fleet.inference.dev/rack"
    network_block: str = "fleet.inference.dev/network-block"
    nvlink_domains: str = "fleet.inference.dev/nvlink-domains"
    cached: str = "fleet.inference.dev/cached"   # annotation: comma-separated images / model sources
    driver_version: str = "fleet.inference.dev/driver-version"             # 580.159.04 (node agent, NVML)
    cuda_driver_version: str = "fleet.inference.dev/cuda-driver-version"   # 13.0 (node agent, NVML)


NVLINK_LABEL_MAX_CHARS = 63
"""A label value's longest (Kubernetes `IsValidLabelValue`, apimachinery/pkg/util/validation)."""
NVLINK_LABEL_MAX_GPUS = 16
"""The most GPUs a node may have for `format_nvlink_domains` to fit any grouping in a label value:
16 GPUs written one by one take 37 characters (22 digits, 15 separators); 32 could take 85."""
_NVLINK_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_nvlink_domains(value: str) -> tuple[tuple[int, ...], ...]:
    """The NVLink domains of a node label value: ``"0-7"`` -> ((0..7),); ``"0-3_4-7"`` -> two
    domains; ``"0.2-3_5"`` -> ((0, 2, 3), (5,)); ``"none"`` or ``""`` -> () (no GPU shares NVLink).
    Domains are joined by ``_``, the members of one by ``.``, runs written ``a-b``. The spelling
    with ``;`` and ``,`` (``"0-1;2-3"``, ``"0,1;2,3"``), which a real API server refuses in a label
    but a node labelled through a permissive stand-in may carry, reads the same. Pure.

    Raises ValueError on anything else.
    """
    value = value.strip()
    if value in ("", "none"):
        return ()
    domains = []
    for part in re.split(r"[_;]", value):
        members: list[int] = []
        for item in re.split(r"[.,]", part):
            found = _NVLINK_ITEM.match(item.strip())
            if found is None:
                raise ValueError(f"bad NVLink domain list {value!r}: expected e.g. '0-7' or '0-3_4-7'")
            lo, hi = int(found.group(1)), int(found.group(2) or found.group(1))
            if hi < lo:
                raise ValueError(f"bad range {item!r}")
            members.extend(range(lo, hi + 1))
        domains.append(tuple(sorted(set(members))))
    return tuple(domains)


def format_nvlink_domains(domains: Iterable[Iterable[int]]) -> str:
    """The label value `parse_nvlink_domains` reads back, legal as a Kubernetes label value
    (alphanumerics, ``-``, ``_``, ``.``; at most `NVLINK_LABEL_MAX_CHARS`): ``((0..7),)`` ->
    ``"0-7"``, ``((0, 1), (2, 3))`` -> ``"0-1_2-3"``, ``((0, 2),)`` -> ``"0.2"``, no domain ->
    ``"none"`` (the topology is known: no GPU shares NVLink). Domains sorted by their first GPU,
    runs of consecutive indices written as ranges. Any grouping of up to `NVLINK_LABEL_MAX_GPUS`
    GPUs fits. Pure.

    Raises ValueError when the value would be longer than a label value may be.
    """
    parts = []
    for domain in sorted(tuple(sorted(set(d))) for d in domains if d):
        runs: list[list[int]] = []
        for i in domain:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        parts.append(".".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs))
    value = "_".join(parts) or "none"
    if len(value) > NVLINK_LABEL_MAX_CHARS:
        raise ValueError(f"NVLink domains {value!r} take {len(value)} characters; a label value holds at most "
                         f"{NVLINK_LABEL_MAX_CHARS} (any grouping of up to {NVLINK_LABEL_MAX_GPUS} GPUs fits)")
    return value


@functools.lru_cache(maxsize=4096)
def image_aliases(ref: str) -> frozenset[str]:
    """Every spelling of one image reference that means the same image, after Docker's
    normalisation (distribution/reference: a name without a registry is on ``docker.io``, a
    one-part Docker Hub name is under ``library/``, no tag and no digest means ``:latest``):
    ``vllm/vllm-openai:v0.11.0`` -> {itself, ``docker.io/vllm/vllm-openai:v0.11.0``};
    ``ubuntu`` -> {``ubuntu``, ``ubuntu:latest``, ``library/ubuntu:latest``,
    ``docker.io/library/ubuntu:latest``, and the same without ``:latest``}. A reference with a digest is spelled by the digest
    only (``name@sha256:...``: how runtimes list pulled digests; a tag beside it is ignored). Pure."""
    ref = ref.strip()
    if not ref:
        return frozenset()
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = name[colon + 1:] if colon > slash else ""
    repo = name[:colon] if colon > slash else name
    first, _, rest = repo.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        domain, path = first, rest
    else:
        domain, path = "docker.io", repo
    if domain == "docker.io" and "/" not in path:
        path = f"library/{path}"
    full = f"{domain}/{path}"
    short = path[len("library/"):] if domain == "docker.io" and path.startswith("library/") else path
    names = {full, short if domain == "docker.io" else full}
    if domain == "docker.io":
        names.add(path)
    out = {ref}
    if digest:
        out |= {f"{n}@{digest}" for n in names}
    else:   # a digest fixes the content; a tag beside it says nothing more
        out |= {f"{n}:{tag or 'latest'}" for n in names}
        if tag in ("", "latest"):
            out |= names
    return frozenset(out)


def node_images(node: Mapping[str, Any]) -> frozenset[str]:
    """The image names a Node object's ``status.images`` lists, with their `image_aliases`."""
    out: set[str] = set()
    for image in (node.get("status") or {}).get("images") or []:
        for name in image.get("names") or []:
            out |= image_aliases(name)
    return frozenset(out)


def _int(value: Any, default: int = 0) -> int:
    try:
        return int(str(value))
    except (TypeError, ValueError):
        return default


def node_from_k8s(node: Mapping[str, Any], keys: LabelKeys = LabelKeys(),
                  held: Mapping[str, Sequence[str]] | None = None) -> NodeInventory:  # fmt: skip
    """One Kubernetes node object -> `NodeInventory`, with the node agent's quarantine applied
    (`quarantine_marks`; ``held``: pod uid -> the synthetic device ids its replica was placed on,
    for the pods on this node). Pure.

    Raises ValueError naming the node and the label or annotation when one of Fleet's is malformed.
    """
    meta = node.get("metadata", {})
    name = meta.get("name", "?")
    labels: dict[str, str] = dict(meta.get("labels") or {})
    annotations: dict[str, str] = dict(meta.get("annotations") or {})
    status = node.get("status") or {}
    capacity = status.get("capacity") or {}
    allocatable = status.get("allocatable") or {}

    strategy = labels.get(GFD_MIG_STRATEGY, "none")
    product = labels.get(GFD_PRODUCT, "")
    count = _int(labels.get(GFD_COUNT))
    memory = _int(labels.get(GFD_MEMORY))
    gpus: list[Gpu] = []
    try:
        health = parse_gpu_health(annotations.get(GPU_HEALTH))
    except ValueError as err:
        raise ValueError(f"node {name}: {err}") from None

    def gpu(i: int, product: str, memory: int, healthy: bool = True, mig: tuple[MigInstance, ...] | None = None) -> Gpu:
        uuid = f"{name}/gpu{i}"
        return Gpu(
            index=i, uuid=uuid, product=product, memory_mib=memory, mig_enabled=mig is not None,
            mig_instances=tuple(MigInstance(m.uuid, m.profile, uuid, m.start) for m in (mig or ())),
            health=GpuHealth() if healthy else GpuHealth(other_problems=_UNHEALTHY),
        )

    single = _SINGLE_PRODUCT.match(product) if strategy == "single" else None
    if single:
        # count and memory describe MIG devices; every GPU holds the same number of them.
        base, profile = single.group(1), single.group(2)
        model = mig_model_for(base)
        per_gpu = len(max_instances(model, profile)) if model and profile != "INVALID" else 0
        n_gpus = math.ceil(count / per_gpu) if per_gpu else 0
        full_memory = (model.profiles[-1].memory_mib or 0) if model else 0   # labels give MIG memory only
        left = count
        for i in range(n_gpus):
            slots = max_instances(model, profile)[: min(per_gpu, left)]
            left -= len(slots)
            gpus.append(gpu(i, base, full_memory, mig=tuple(
                MigInstance(f"{name}/gpu{i}/mig{j}", s.profile, "", s.start) for j, s in enumerate(slots))))
    else:
        mig_counts = {m.group(1): _int(v) for k, v in labels.items() if (m := _MIG_COUNT.match(k))}
        mig_counts = {p: n for p, n in mig_counts.items() if n > 0} if strategy == "mixed" else {}
        mig_gpus = _pack_mig(name, product, memory, mig_counts)
        whole = count - len(mig_gpus)   # gpu.count counts physical GPUs, MIG-enabled ones too
        healthy_whole = _int(allocatable.get("nvidia.com/gpu"), whole) if "nvidia.com/gpu" in allocatable else whole
        # A GPU the agent quarantines is likely the one the device plugin withholds: count it once.
        quarantined_whole = len({q.index for q in health.quarantined if q.mig is None and 0 <= q.index < whole})
        healthy_whole = min(whole, healthy_whole + min(quarantined_whole, max(0, whole - healthy_whole)))
        for i in range(max(whole, 0)):
            gpus.append(gpu(i, product, memory, healthy=i < healthy_whole))
        for j, slots in enumerate(mig_gpus):
            i = len(gpus)
            gpus.append(gpu(i, product, memory, mig=tuple(
                MigInstance(f"{name}/gpu{i}/mig{k}", s.profile, "", s.start) for k, s in enumerate(slots))))

    domains = None
    if keys.nvlink_domains in labels:
        try:
            domains = parse_nvlink_domains(labels[keys.nvlink_domains])
        except ValueError as err:
            raise ValueError(f"node {name} label {keys.nvlink_domains}: {err}") from None
    cached = frozenset(x.strip() for x in annotations.get(keys.cached, "").split(",") if x.strip())
    cached |= {n for n in node_images(node) if not n.startswith("library/")}   # the spellings people write
    base = NodeInventory(
        name=name,
        gpus=tuple(gpus),
        cpu_cores=tuple(range(_int(capacity.get("cpu")))),
        labels=labels,
        nvlink_domains=domains,
        zone=labels.get(keys.zone),
        rack=labels.get(keys.rack),
        network_block=labels.get(keys.network_block),
        nvlink_fabric=labels.get(GFD_CLIQUE),
        cached=cached,
        driver_version=driver_version(labels, keys),
        cuda_driver_version=cuda_driver_version(labels, keys),
    )
    marks = quarantine_marks(base, health, held or {})
    return base.with_quarantine(marks) if marks else base


def driver_version(labels: Mapping[str, str], keys: LabelKeys = LabelKeys()) -> str | None:
    """The node's NVIDIA driver version from GFD's labels (current spelling, then the deprecated
    major/minor/rev), else the node agent's label; None when none is set or it is malformed."""
    value = labels.get(GFD_DRIVER, "").strip()
    if not value and all(labels.get(k, "").strip() for k in GFD_DRIVER_OLD[:2]):
        value = ".".join(v for k in GFD_DRIVER_OLD if (v := labels.get(k, "").strip()))
    value = value or labels.get(keys.driver_version, "").strip()
    return value if _DRIVER_TEXT.match(value) else None


def cuda_driver_version(labels: Mapping[str, str], keys: LabelKeys = LabelKeys()) -> tuple[int, int] | None:
    """The newest CUDA the node's driver supports, from GFD's ``cuda.runtime-version`` labels (or
    their deprecated ``cuda.runtime`` spelling), else the node agent's label; None when unset or
    malformed."""
    for major, minor in (GFD_CUDA, GFD_CUDA_OLD):
        if labels.get(major, "").strip().isdigit() and labels.get(minor, "").strip().isdigit():
            return int(labels[major]), int(labels[minor])
    try:
        return parse_cuda_version(labels.get(keys.cuda_driver_version, "").strip())
    except ValueError:
        return None


def quarantine_marks(node: NodeInventory, health: GpuHealthFacts,
                     held: Mapping[str, Sequence[str]]) -> dict[str, str]:  # fmt: skip
    """Synthetic GPU / MIG instance id -> why, one per device ``health`` quarantines (see the
    module docstring for which id carries it). ``held``: pod uid -> synthetic device ids its
    replica was placed on. A device with no counterpart in ``node`` (more quarantined than the
    labels list) is left out. Pure."""
    marks: dict[str, str] = {}
    taken = {d for devices in held.values() for d in devices}
    parent = {m.uuid: g.uuid for g in node.gpus for m in g.mig_instances}
    by_index = {g.index: g for g in node.gpus}
    domain_of = {g.index: i for i, dom in enumerate(node.domains) for g in dom}
    for q in health.quarantined:
        why = f"node agent: {q.describe()}"
        holder = [d for uid in q.pods for d in held.get(uid, ())]
        if q.mig is not None:
            fits = [m for g in node.gpus for m in g.mig_instances if q.profile in (None, m.profile)]
            on_gpu = [m.uuid for m in fits if by_index.get(q.index) is not None and parent[m.uuid] == by_index[q.index].uuid]
            order = ([d for d in holder if d in parent] + [u for u in on_gpu if u not in taken]
                     + [m.uuid for m in fits if m.uuid not in taken] + [m.uuid for m in fits])  # fmt: skip
        else:
            own = [parent.get(d, d) for d in holder]
            same = by_index[q.index].uuid if q.index in by_index else None
            near = sorted((g for g in node.gpus if g.uuid not in taken),
                          key=lambda g: (domain_of.get(g.index) != domain_of.get(q.index), g.index))
            order = (sorted(own, key=lambda u: u != same) + ([same] if same and same not in taken else [])
                     + [g.uuid for g in near] + ([same] if same else []))  # fmt: skip
        choice = next((u for u in order if u not in marks), None)
        if choice is not None:
            marks[choice] = why
    return marks


def _pack_mig(node: str, product: str, memory: int, counts: dict[str, int]) -> list[list[MigSlot]]:
    """Spread the node's MIG devices over as few GPUs as their geometry allows (largest first).

    GFD gives counts per profile, not which GPU holds which device; the split only matters for
    repartition advice, so any valid one will do. Unknown GPU model: one device per GPU.
    """
    model = mig_model_for(product, memory or None)
    wanted = sorted((p for p, n in counts.items() for _ in range(n)),
                    key=lambda p: -(model.profile(p).memory_slices if model and model.profile(p) else 0))
    gpus: list[list[MigSlot]] = []
    for profile in wanted:
        for slots in gpus:
            new = fit_geometry(model, [profile], slots) if model else None
            if new:
                slots.extend(new)
                break
        else:
            new = fit_geometry(model, [profile]) if model else None
            gpus.append(list(new) if new else [MigSlot(profile, 0)])
    return gpus


def inventory_from_k8s(nodes: Iterable[Mapping[str, Any]], keys: LabelKeys = LabelKeys()) -> Inventory:
    """Every node object -> one `Inventory`, in the order given (nodes without GPUs included:
    they can host CPU replicas)."""
    return Inventory(tuple(node_from_k8s(n, keys) for n in nodes))
