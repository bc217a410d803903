"""The NVIDIA device plugin of one box node. A TEST STAND-IN for NVIDIA/k8s-device-plugin and
the kubelet's device manager.

`DevicePlugin` advertises the node's devices from its fake NVML state file (the JSON the node's
`pynvml` stand-in reads, fleet/testing/nvml_driver): whole GPUs as ``nvidia.com/gpu`` and MIG
devices as ``nvidia.com/mig-<profile>`` (the plugin's ``mixed`` strategy), by UUID (the plugin's
DEVICE_ID_STRATEGY=uuid). `allocate` picks devices as the plugin's preferred allocation does for
whole GPUs (`preferred_devices`, go-gpuallocator's best-effort policy: a set inside one NVLink
domain when one has room, the fullest such domain first), never an unhealthy or allocated
device, and records the allocation with the pod's namespace and name, which the node's
PodResources server answers from as the kubelet's device manager does
(fleet/testing/k8s/podresources.py, what Fleet's node agent asks). The same inventory and
`preferred_devices` serve a real kubelet over the device-plugin gRPC API
(fleet/testing/k8s/deviceplugin_grpc.py).

Health, as the real plugin: an Xid in the state file's ``xid_events`` other than the ones it
ignores (13, 31, 43, 45, 68, 109: application errors) marks the GPU (and its MIG devices)
unhealthy; `allocatable` then leaves it out.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from fleet.inventory.nvml import node_from_nvml

IGNORED_XIDS = frozenset({13, 31, 43, 45, 68, 109})
GPU = "nvidia.com/gpu"


def preferred_devices(available: Sequence[str], count: int, domains: Iterable[Sequence[str]] = (),
                      must_include: Sequence[str] = ()) -> list[str]:
    """``count`` device ids out of ``available`` as NVIDIA's device plugin prefers them for whole
    GPUs (go-gpuallocator's best-effort policy, NVIDIA/k8s-device-plugin ``GetPreferredAllocation``):
    for more than one device, a set inside one NVLink domain (``domains``: lists of GPU ids) that
    holds every id of ``must_include`` and has room, the fullest such domain first (the one with
    the fewest available ids); otherwise ``must_include`` then ``available`` in its order. Ids keep
    the order of the domain or of ``available``. Raises ValueError when ``available`` holds fewer
    than ``count`` ids or lacks one of ``must_include``, or when ``must_include`` has more than
    ``count``. Used by `DevicePlugin.allocate` (Fleet's process kubelet) and by the gRPC device
    plugin's ``GetPreferredAllocation`` (fleet/testing/k8s/deviceplugin_grpc.py)."""
    free = list(dict.fromkeys(available))
    must = list(dict.fromkeys(must_include))
    if len(free) < count:
        raise ValueError(f"count: {count} devices asked, {len(free)} available")
    if len(must) > count or not set(must) <= set(free):
        raise ValueError(f"must_include: {must} must be at most {count} of the available devices {free}")
    if count > 1:
        fits = [[i for i in d if i in free] for d in domains]
        fits = [f for f in fits if len(f) >= count and set(must) <= set(f)]
        if fits:
            domain = min(fits, key=len)
            return must + [i for i in domain if i not in must][:count - len(must)]
    return must + [i for i in free if i not in must][:count - len(must)]


class DevicePlugin:
    def __init__(self, node: str, state_path: Path, node_root: Path) -> None:
        self.node = node
        self.state_path = state_path
        self.node_root = node_root
        snapshot = json.loads(state_path.read_text())
        inv = node_from_nvml(snapshot, node)
        by_index = {d["index"]: d["uuid"] for d in snapshot["devices"]}
        self.gpus: list[str] = []                      # whole-GPU uuids, by index
        self.mig: dict[str, list[str]] = {}            # profile -> MIG uuids
        self.parent: dict[str, str] = {}               # MIG uuid -> GPU uuid
        for g in inv.gpus:
            uuid = by_index[g.index]
            if g.mig_enabled:
                for m in g.mig_instances:
                    self.mig.setdefault(m.profile, []).append(m.uuid)
                    self.parent[m.uuid] = uuid
            else:
                self.gpus.append(uuid)
        self.domains: list[list[str]] = [[by_index[i] for i in d] for d in (inv.nvlink_domains or ())]
        self.allocations: dict[tuple[str, str], tuple[str, list[str]]] = {}   # (pod uid, container) -> (res, ids)
        self.pods: dict[str, tuple[str, str]] = {}   # pod uid -> (namespace, name)
        self.unhealthy: set[str] = set()

    def resources(self) -> dict[str, list[str]]:
        out = {GPU: list(self.gpus)} if self.gpus else {}
        out.update({f"nvidia.com/mig-{p}": list(ids) for p, ids in self.mig.items()})
        return out

    def refresh_health(self) -> bool:
        """Read the state file's Xids; True when a device became unhealthy."""
        try:
            events = json.loads(self.state_path.read_text()).get("xid_events") or []
        except (OSError, ValueError):
            return False
        before = set(self.unhealthy)
        for e in events:
            if int(e.get("xid", 0)) in IGNORED_XIDS:
                continue
            uuid = e.get("uuid", "")
            self.unhealthy.add(uuid)
            self.unhealthy |= {m for m, parent in self.parent.items() if parent == uuid}
        return self.unhealthy != before

    def allocatable(self) -> dict[str, str]:
        self.refresh_health()
        return {res: str(sum(1 for i in ids if i not in self.unhealthy)) for res, ids in self.resources().items()}

    def _used(self) -> set[str]:
        return {i for _res, ids in self.allocations.values() for i in ids}

    def allocate(self, pod_uid: str, container: str, resource: str, count: int,
                 pod: tuple[str, str] = ("", "")) -> list[str] | None:
        """``count`` devices of ``resource`` for the container of the pod ``pod_uid`` (``pod``:
        its namespace and name), or None when too few are free."""
        self.refresh_health()
        ids = self.resources().get(resource, [])
        free = [i for i in ids if i not in self._used() and i not in self.unhealthy]
        if len(free) < count:
            return None
        chosen = preferred_devices(free, count, self.domains if resource == GPU else ())
        self.allocations[(pod_uid, container)] = (resource, chosen)
        self.pods[pod_uid] = pod
        return chosen

    def release(self, pod_uid: str) -> None:
        for key in [k for k in self.allocations if k[0] == pod_uid]:
            del self.allocations[key]
        self.pods.pop(pod_uid, None)

    def pod_devices(self) -> list[tuple[str, str, str, str, list[str]]]:
        """``[(namespace, name, container, resource, device ids)]`` of every allocation, by pod
        and container: what the kubelet's PodResources ``List`` reports."""
        out, pods = [], self.pods.copy()       # copies: the kubelet's thread allocates meanwhile
        for (uid, container), (resource, ids) in sorted(self.allocations.copy().items()):
            namespace, name = pods.get(uid, ("", uid))
            out.append((namespace, name, container, resource, list(ids)))
        return out
