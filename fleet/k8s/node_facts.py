"""The node facts the node agent publishes on its own Node, and their reading by the operator.

Owns the keys, their values and the one merge patch that writes them:

- label ``fleet.inference.dev/nvlink-domains``: the NVLink domains NVML reports
  (`fleet.inventory.nvml.node_from_nvml` ``.nvlink_domains``), in the form
  `fleet.inventory.gfd.parse_nvlink_domains` reads (``0-7``, ``0-1_2-3``, ``none``: a legal
  label value; `fleet.inventory.gfd.format_nvlink_domains` writes it). Left alone when NVML is
  unavailable or the value would not fit a label (more than 16 GPUs in an awkward grouping);
- labels ``fleet.inference.dev/driver-version`` (``580.159.04``, NVML ``nvmlSystemGetDriverVersion``)
  and ``fleet.inference.dev/cuda-driver-version`` (``13.0``, NVML ``nvmlSystemGetCudaDriverVersion``
  13000): the NVIDIA driver and the newest CUDA it supports, for clusters without GPU Feature
  Discovery's ``nvidia.com/cuda.*`` labels (`fleet.inventory.gfd.driver_version` prefers GFD's).
  Placement skips nodes whose driver cannot run an engine's CUDA (`fleet.placement.compat`).
  Left alone when NVML is unavailable;
- annotation ``fleet.inference.dev/cached``: the model sources the weight cache holds, comma
  separated, in the cache's canonical form (`fleet.agent.cache.WeightCache.cached_sources`) WITH
  CREDENTIALS STRIPPED (`fleet.sources.redact_source`: no userinfo, query or fragment). The
  operator compares ``redact_source(canonical_source(spec.model.source))`` against it
  (`fleet.placement.shapes.canonical_source`); the kubelet's ``Node.status.images`` is the other
  half of warmth. `fleet.inventory.gfd.node_from_k8s` reads both;
- annotation ``fleet.inference.dev/gpu-health``: JSON, `fleet.inventory.gpu_health.GpuHealthFacts`
  (its key, records, `parse_gpu_health` for the operator and `gpu_health_value` live there and are
  re-exported here): ``{"quarantined": [{"index": 3, "uuid": "GPU-...", "mig": null | "MIG-...",
  "profile": "3g.40gb" (MIG only), "reason": "...", "sinceS": 1764000000.0, "pods": ["<pod uid>"]}],
  "allocations": {"<pod uid>": [0, 1]}, "healthChecks": true}``. ``index`` is the NVML GPU index
  (of the parent GPU for a MIG instance); ``pods`` and ``allocations`` come from the kubelet's
  PodResources API (`fleet.agent.pod_devices`), which names pods by namespace and name: `PodUids`
  gets each one's uid from the API server, so the operator matches its own pods by uid (a pod
  made again under the same name is another pod); ``healthChecks`` is false when the agent has
  no NVML.

Agent side: `node_facts` (pure: the agent's status, its last NVML reading, the pods' allocations
-> `NodeFacts`), `PodUids` (namespace and name -> uid, one GET per pod newly listed),
`node_facts_patch` (pure: what changed since the last publish, as one JSON merge patch) and
`NodeFactsPublisher` (patches the Node through `fleet.k8s.client.Kube` when something changed,
nothing otherwise; a failure is retried at the next step). Used by
`fleet node-agent --annotate-node` (fleet/cli/agent.py), which runs in the chart's DaemonSet with
its node's name from the downward API and a service account that may get and patch nodes and
get pods, nothing else (charts/fleet/templates/agent-daemonset.yaml).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fleet.base.names import MIG_PROFILE_IN_TEXT
from fleet.inventory.gfd import LabelKeys, format_nvlink_domains
from fleet.inventory.gpu_health import ANNOTATION as GPU_HEALTH_ANNOTATION
from fleet.inventory.gpu_health import GpuHealthFacts, QuarantinedGpu, gpu_health_value, parse_gpu_health
from fleet.k8s.client import NODES, PODS, Kube, NotFound
from fleet.sources import redact_source

if TYPE_CHECKING:   # the operator imports this module too, and needs no gRPC
    from fleet.agent.pod_devices import Allocations, PodKey

log = logging.getLogger("fleet.node_agent")

NVLINK_DOMAINS_LABEL = LabelKeys().nvlink_domains
CACHED_ANNOTATION = LabelKeys().cached
DRIVER_VERSION_LABEL = LabelKeys().driver_version
CUDA_DRIVER_VERSION_LABEL = LabelKeys().cuda_driver_version
# A Kubernetes label value: <= 63 characters, alphanumerics with '-', '_', '.' inside.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
__all__ = ["CACHED_ANNOTATION", "CUDA_DRIVER_VERSION_LABEL", "DRIVER_VERSION_LABEL", "GPU_HEALTH_ANNOTATION",
           "NVLINK_DOMAINS_LABEL", "GpuHealthFacts", "NodeFacts",
           "NodeFactsPublisher", "PodUids", "QuarantinedGpu", "cached_value", "node_facts", "node_facts_patch",
           "parse_gpu_health"]
MAX_VALUE_CHARS = 64 * 1024
"""The cached annotation's longest value (the API server caps all annotations of an object at 256 KiB)."""


def cached_value(sources: Iterable[str]) -> str:
    """``a,b,c``: the sources redacted (`fleet.sources.redact_source`), sorted, cut to whole
    entries within `MAX_VALUE_CHARS`; a source with a comma cannot be listed (the annotation is
    comma-separated) and is left out. Pure."""
    value = ""
    for s in sorted({redact_source(s) for s in sources} - {""}):
        if "," in s:
            continue
        candidate = f"{value},{s}" if value else s
        if len(candidate) > MAX_VALUE_CHARS:
            log.warning("annotation %s: %d characters at most; %s and later sources left out", CACHED_ANNOTATION,
                        MAX_VALUE_CHARS, s)  # fmt: skip
            break
        value = candidate
    return value


@dataclass(frozen=True)
class NodeFacts:
    """What the agent publishes. ``nvlink_domains``: the label's value, None when unknown (NVML
    unavailable: the label is left as it is); ``cached``: the cached annotation's value ("": the
    annotation is removed); ``gpu_health``: None leaves the annotation as it is;
    ``driver_version`` / ``cuda_driver_version``: the labels' values (``580.159.04``, ``13.0``),
    None leaves a label as it is."""

    nvlink_domains: str | None
    cached: str
    gpu_health: GpuHealthFacts | None
    driver_version: str | None = None
    cuda_driver_version: str | None = None


def node_facts(status: Mapping[str, Any], devices: Iterable[Mapping[str, Any]],
               allocations: Mapping[str, Iterable[str]], cached_sources: Iterable[str],
               nvlink_domains: tuple[tuple[int, ...], ...] | None, driver_version: str | None = None,
               cuda_driver_version: tuple[int, int] | None = None) -> NodeFacts:
    """The facts of one agent step. ``status``: `fleet.agent.runner.NodeAgent.status` (its
    ``quarantined`` and ``health_checks``); ``devices``: the last NVML reading's devices
    (`fleet.agent.nvml_health.NvmlHealthReader.read`: ``index``, ``uuid``, ``mig_instances``);
    ``allocations``: ``{pod uid: device ids}`` (`fleet.agent.pod_devices`, `PodUids`); a MIG
    instance's ``name`` gives its ``profile`` when it has one; device ids not
    on this node's NVML are left out. ``nvlink_domains``: None when NVML is unavailable. A
    quarantine of the whole node (NVML failed) names no GPU and is not listed.
    ``driver_version`` / ``cuda_driver_version``: NVML's (`fleet.agent.nvml_health.NvmlHealthReader`
    reads them at open), None when unknown; a value that is no valid label value is left out. Pure."""
    gpu_of: dict[str, tuple[int, str, str | None]] = {}   # device id -> (index, GPU uuid, MIG uuid)
    profiles: dict[str, str] = {}
    for d in devices:
        if not isinstance(d.get("uuid"), str):
            continue
        gpu_of[d["uuid"]] = (int(d["index"]), d["uuid"], None)
        for m in d.get("mig_instances") or []:
            if isinstance(m.get("uuid"), str):
                gpu_of[m["uuid"]] = (int(d["index"]), d["uuid"], m["uuid"])
                found = MIG_PROFILE_IN_TEXT.search(str(m.get("name") or ""))
                if found:
                    profiles[m["uuid"]] = found.group(1)
    held: dict[str, set[str]] = {}       # device id -> pods given that very device
    on_gpu: dict[str, set[str]] = {}     # GPU uuid -> pods given one of its MIG instances
    by_pod: dict[str, set[int]] = {}
    for uid, ids in allocations.items():
        for device_id in ids:
            if device_id not in gpu_of:
                continue
            index, gpu, mig = gpu_of[device_id]
            by_pod.setdefault(uid, set()).add(index)
            held.setdefault(device_id, set()).add(uid)
            if mig is not None:
                on_gpu.setdefault(gpu, set()).add(uid)
    quarantined = []
    for q in status.get("quarantined") or []:
        if q.get("gpu") not in gpu_of:
            continue
        index, gpu, mig = gpu_of[q["gpu"]]
        # A whole GPU: its pods and those on its instances; an instance: its pods (and the GPU's).
        pods = held.get(q["gpu"], set()) | (held.get(gpu, set()) if mig is not None else on_gpu.get(gpu, set()))
        quarantined.append(QuarantinedGpu(index=index, uuid=gpu, mig=mig, reason=str(q.get("reason", "")),
                                          since_s=float(q.get("since_s") or 0.0), pods=tuple(sorted(pods)),
                                          profile=profiles.get(mig) if mig else None))
    health = GpuHealthFacts(tuple(sorted(quarantined, key=lambda q: (q.index, q.mig or ""))),
                            {uid: tuple(sorted(ix)) for uid, ix in sorted(by_pod.items())},
                            bool(status.get("health_checks", True)))
    driver = driver_version if driver_version and _LABEL_VALUE.match(driver_version) else None
    cuda = f"{cuda_driver_version[0]}.{cuda_driver_version[1]}" if cuda_driver_version else None
    return NodeFacts(_nvlink_value(nvlink_domains), cached_value(cached_sources), health, driver, cuda)


def _nvlink_value(domains: tuple[tuple[int, ...], ...] | None) -> str | None:
    """The NVLink label's value; None (the label left as it is) when unknown or too long for a
    label value (more GPUs than `fleet.inventory.gfd.NVLINK_LABEL_MAX_GPUS`), which is logged once."""
    if domains is None:
        return None
    try:
        return format_nvlink_domains(domains)
    except ValueError as err:
        if domains not in _UNFIT_DOMAINS:
            _UNFIT_DOMAINS.add(domains)
            log.warning("label %s not published: %s", NVLINK_DOMAINS_LABEL, err)
        return None


_UNFIT_DOMAINS: set[tuple[tuple[int, ...], ...]] = set()   # logged already


def node_facts_patch(facts: NodeFacts, last: NodeFacts | None = None) -> dict | None:
    """One JSON merge patch of the Node writing what differs from ``last`` (everything when
    None); None when nothing does. Pure."""
    labels: dict[str, str | None] = {}
    annotations: dict[str, str | None] = {}
    if facts.nvlink_domains is not None and (last is None or facts.nvlink_domains != last.nvlink_domains):
        labels[NVLINK_DOMAINS_LABEL] = facts.nvlink_domains
    for key, value, before in ((DRIVER_VERSION_LABEL, facts.driver_version, last and last.driver_version),
                               (CUDA_DRIVER_VERSION_LABEL, facts.cuda_driver_version,
                                last and last.cuda_driver_version)):  # fmt: skip
        if value is not None and value != before:
            labels[key] = value
    if last is None or facts.cached != last.cached:
        annotations[CACHED_ANNOTATION] = facts.cached or None
    if facts.gpu_health is not None:
        value = gpu_health_value(facts.gpu_health)
        if last is None or last.gpu_health is None or value != gpu_health_value(last.gpu_health):
            annotations[GPU_HEALTH_ANNOTATION] = value
    metadata = {k: v for k, v in (("labels", labels), ("annotations", annotations)) if v}
    return {"metadata": metadata} if metadata else None


class NodeFactsPublisher:
    """Writes `NodeFacts` on Node ``node``: one merge patch per change, nothing when nothing
    changed. A failed patch is logged and retried at the next publish."""

    def __init__(self, kube: Kube, node: str) -> None:
        self.kube = kube
        self.node = node
        self.last: NodeFacts | None = None
        self.patches = 0

    async def publish(self, facts: NodeFacts) -> bool:
        """Patch the Node if ``facts`` differ from the last written; True when patched. Raises
        `fleet.k8s.client.ApiError` when the API server refuses."""
        patch = node_facts_patch(facts, self.last)
        if patch is None:
            return False
        await self.kube.patch(NODES, None, self.node, patch)
        self.last = facts
        self.patches += 1
        return True

    def publish_sync(self, facts: NodeFacts) -> bool:
        """`publish` from the agent's own thread (no event loop runs there:
        `fleet.agent.runner.NodeAgent` ``on_step``). Never raises; False when not patched."""
        try:
            return asyncio.run(self.publish(facts))
        except Exception as err:  # noqa: BLE001 - the agent's loop survives; the next step retries
            log.warning("cannot write node facts on node %s: %s", self.node, err)
            return False


class PodUids:
    """The uid of each pod the PodResources API names (``(namespace, name)``), got from the API
    server once per pod while it stays listed (a GET of the pod; the agent's service account may
    get pods). A name listed again after it left is got again."""

    def __init__(self, kube: Kube) -> None:
        self.kube = kube
        self.known: dict[PodKey, str] = {}
        self.gets = 0

    async def resolve(self, allocations: Allocations) -> tuple[dict[str, tuple[str, ...]], bool]:
        """``({pod uid: device ids}, complete)``: a pod the API server does not have (404: gone)
        is left out; one whose GET failed otherwise is left out too and makes ``complete``
        False (the weight-cache pins are then left alone: `fleet.agent.pins`). Never raises."""
        self.known = {key: uid for key, uid in self.known.items() if key in allocations}
        out, complete = {}, True
        for key, ids in allocations.items():
            if key not in self.known:
                try:
                    self.gets += 1
                    pod = await self.kube.get(PODS, key[0], key[1])
                except NotFound:
                    continue
                except Exception as err:  # noqa: BLE001 - the next step asks again
                    log.warning("cannot get pod %s/%s (its GPUs go unnamed this step): %s", *key, err)
                    complete = False
                    continue
                self.known[key] = str(pod["metadata"]["uid"])
            out[self.known[key]] = ids
        return out, complete

    def resolve_sync(self, allocations: Allocations) -> tuple[dict[str, tuple[str, ...]], bool]:
        """`resolve` from the agent's own thread (no event loop runs there)."""
        return asyncio.run(self.resolve(allocations))
