"""The node agent's GPU health facts as the operator reads them: the Node annotation
``fleet.inference.dev/gpu-health``.

Owns the annotation's key, its records (`GpuHealthFacts`, `QuarantinedGpu`), `parse_gpu_health`
(operator side: `fleet.inventory.gfd.node_from_k8s` and the Kubernetes backend,
`fleet.k8s.backend`) and `gpu_health_value` (the JSON the agent writes, its inverse). The
agent's side of the node facts (`fleet.k8s.node_facts`) imports these rather than redefining
them. Pure: no I/O.

The value (JSON, written by the agent only when it changes)::

    {"quarantined": [{"index": 3, "uuid": "GPU-...", "mig": null | "MIG-...",
                      "reason": "xid: Xid 79 ...", "sinceS": 1764000000.0,
                      "pods": ["<pod uid>", ...]}],
     "allocations": {"<pod uid>": [0, 1]}, "healthChecks": true}

``index`` is the NVML GPU index; ``pods`` (the pods holding that GPU or MIG instance) and
``allocations`` (GPU indexes per pod) come from the kubelet's PodResources API
(``/var/lib/kubelet/pod-resources/kubelet.sock``, `fleet.agent.pod_devices`), which says which
devices the device plugin gave each pod. An optional ``profile`` (``3g.40gb``) on a MIG entry lets placement
leave out a slice of the right size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

ANNOTATION = "fleet.inference.dev/gpu-health"


@dataclass(frozen=True)
class QuarantinedGpu:
    """One GPU (``mig`` None) or MIG instance the node agent quarantines. ``since_s``: Unix
    seconds; ``pods``: uids of the pods the device plugin gave it to."""

    index: int
    uuid: str
    reason: str
    mig: str | None = None
    since_s: float | None = None
    pods: tuple[str, ...] = ()
    profile: str | None = None

    def describe(self) -> str:
        """``GPU 3 (GPU-ab..): xid: Xid 79 ...``, the MIG instance named when there is one."""
        what = f"GPU {self.index} ({self.uuid}" + (f", MIG {self.mig}" if self.mig else "") + ")"
        return f"{what}: {self.reason}"


@dataclass(frozen=True)
class GpuHealthFacts:
    """What one node's agent says about its GPUs. ``allocations``: pod uid -> the NVML indexes
    of the GPUs it holds (whole GPUs, and the parents of its MIG instances); ``health_checks``:
    whether the agent's NVML checks run at all (False: no driver; nothing is known)."""

    quarantined: tuple[QuarantinedGpu, ...] = ()
    allocations: dict[str, tuple[int, ...]] = field(default_factory=dict)
    health_checks: bool = False

    def sick_pods(self) -> dict[str, QuarantinedGpu]:
        """Pod uid -> the first quarantined device it holds: listed in the entry's ``pods``, or
        holding a quarantined whole GPU by ``allocations``."""
        out: dict[str, QuarantinedGpu] = {}
        for q in self.quarantined:
            for uid in q.pods:
                out.setdefault(uid, q)
        whole = {q.index: q for q in self.quarantined if q.mig is None}
        for uid, indexes in sorted(self.allocations.items()):
            hit = next((whole[i] for i in indexes if i in whole), None)
            if hit is not None:
                out.setdefault(uid, hit)
        return out


def parse_gpu_health(value: str | None) -> GpuHealthFacts:
    """The annotation's value -> `GpuHealthFacts` (None or "" -> nothing quarantined, checks
    unknown). Raises ValueError naming the annotation on bad JSON or a malformed entry."""
    if not value or not value.strip():
        return GpuHealthFacts()
    try:
        doc = json.loads(value)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        quarantined = []
        for i, q in enumerate(doc.get("quarantined") or []):
            if not isinstance(q, dict) or isinstance(q.get("index"), bool) or not isinstance(q.get("index"), int):
                raise ValueError(f"quarantined[{i}]: an object with an integer index is required")
            since = q.get("sinceS")
            quarantined.append(QuarantinedGpu(
                index=q["index"], uuid=str(q.get("uuid") or f"gpu{q['index']}"), reason=str(q.get("reason") or "?"),
                mig=str(q["mig"]) if q.get("mig") else None,
                since_s=float(since) if isinstance(since, (int, float)) and not isinstance(since, bool) else None,
                pods=tuple(str(p) for p in q.get("pods") or ()),
                profile=str(q["profile"]) if q.get("profile") else None))  # fmt: skip
        allocations = {}
        for uid, indexes in (doc.get("allocations") or {}).items():
            if not isinstance(indexes, list) or not all(isinstance(x, int) and not isinstance(x, bool)
                                                        for x in indexes):  # fmt: skip
                raise ValueError(f"allocations[{uid!r}]: a list of GPU indexes is required")
            allocations[str(uid)] = tuple(indexes)
    except (ValueError, TypeError, AttributeError) as err:   # json.JSONDecodeError is a ValueError
        raise ValueError(f"annotation {ANNOTATION}: {err}") from None
    return GpuHealthFacts(tuple(quarantined), allocations, bool(doc.get("healthChecks", False)))


def gpu_health_value(facts: GpuHealthFacts) -> str:
    """The annotation's value for ``facts`` (compact JSON, keys sorted: equal facts give equal
    strings, so a writer patches only on change). `parse_gpu_health` reads it back."""
    doc = {
        "quarantined": [{"index": q.index, "uuid": q.uuid, "mig": q.mig, "reason": q.reason, "sinceS": q.since_s,
                         "pods": list(q.pods), **({"profile": q.profile} if q.profile else {})}
                        for q in facts.quarantined],
        "allocations": {uid: list(ix) for uid, ix in facts.allocations.items()},
        "healthChecks": facts.health_checks,
    }  # fmt: skip
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))
