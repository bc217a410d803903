"""Which pods hold which GPUs on this node: the kubelet's device-manager checkpoint, read.

Owns `DEFAULT_CHECKPOINT`, `CheckpointError`, `read_device_checkpoint` (pure over the file's
text: `parse_device_checkpoint`) and `CheckpointReader` (each step's reading, the last good one
kept). Called by `fleet node-agent --annotate-node` (fleet/cli/agent.py)
through `fleet.k8s.node_facts`, which names the pods on a quarantined GPU and the GPUs each pod
holds in the node's ``fleet.inference.dev/gpu-health`` annotation.

The file is the kubelet's (pkg/kubelet/cm/devicemanager/checkpoint, kubelet >= 1.20, "v2"):
``{"Data": {"PodDeviceEntries": [{"PodUID": "...", "ContainerName": "engine", "ResourceName":
"nvidia.com/gpu", "DeviceIDs": {"-1": ["GPU-...", ...]}, "AllocResp": "..."}],
"RegisteredDevices": {"nvidia.com/gpu": [...]}}, "Checksum": 0}``; ``DeviceIDs`` keyed by NUMA
node, or a plain list in the older format. Device ids are what the device plugin advertises: GPU
UUIDs (``GPU-...``) and MIG UUIDs (``MIG-...``) with NVIDIA's device plugin and
``DEVICE_ID_STRATEGY=uuid``. The kubelet rewrites the file on every allocation; the DaemonSet
mounts its directory read-only. The checksum is not checked: a torn read fails to parse and the
caller keeps its last reading.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("fleet.node_agent")

DEFAULT_CHECKPOINT = Path("/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")

Allocations = dict[str, tuple[str, ...]]
"""``{pod uid: device ids}``, each pod's devices of every container and resource, sorted."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or is not one; the message names the file."""


def parse_device_checkpoint(text: str, where: str = "device checkpoint") -> Allocations:
    """The allocations in a checkpoint's text. Entries of resources other than NVIDIA's
    (``nvidia.com/...``) are left out. Raises CheckpointError naming ``where``. Pure."""
    try:
        doc = json.loads(text)
    except ValueError as err:
        raise CheckpointError(f"{where}: not JSON: {err}") from None
    data = doc.get("Data") if isinstance(doc, dict) else None
    entries = data.get("PodDeviceEntries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise CheckpointError(f"{where}: no Data.PodDeviceEntries list (not a kubelet device-manager checkpoint)")
    out: dict[str, set[str]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or not str(entry.get("ResourceName", "")).startswith("nvidia.com/"):
            continue
        uid = entry.get("PodUID")
        if not isinstance(uid, str) or not uid:
            continue
        out.setdefault(uid, set()).update(_device_ids(entry.get("DeviceIDs")))
    return {uid: tuple(sorted(ids)) for uid, ids in sorted(out.items()) if ids}


def _device_ids(raw: Any) -> list[str]:
    if isinstance(raw, dict):   # v2: {"<numa node>": [ids]}
        return [str(i) for ids in raw.values() if isinstance(ids, list) for i in ids]
    if isinstance(raw, list):   # v1
        return [str(i) for i in raw]
    return []


def read_device_checkpoint(path: Path = DEFAULT_CHECKPOINT) -> Allocations:
    """The allocations in the checkpoint at ``path``; none when the file does not exist (no
    device plugin, no GPU pod yet). Raises CheckpointError when it cannot be read (permission)
    or parsed."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    except OSError as err:
        raise CheckpointError(f"{path}: {err.strerror or err}") from None
    return parse_device_checkpoint(text, str(path))


class CheckpointReader:
    """Reads the checkpoint at ``path`` each step, keeping the last good reading when a read
    fails (a torn write, a permission problem), and logging each new failure once."""

    def __init__(self, path: Path = DEFAULT_CHECKPOINT) -> None:
        self.path = Path(path)
        self.last: Allocations = {}
        self.error: str | None = None

    def read(self) -> Allocations:
        """The allocations now, or the last good ones. Never raises."""
        try:
            self.last = read_device_checkpoint(self.path)
            self.error = None
        except CheckpointError as err:
            if str(err) != self.error:
                log.warning("device checkpoint unreadable, GPU allocations as last read: %s", err)
            self.error = str(err)
        return self.last
