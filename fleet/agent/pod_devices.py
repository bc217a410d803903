"""Which pods hold which NVIDIA devices on this node: the kubelet's PodResources API, asked.

Owns `DEFAULT_SOCKET`, `PodResourcesError`, `nvidia_allocations` (pure over one ``List``
answer), `list_pod_devices` (one ``List`` call, time-bounded), `PodDevicesReader` (each step's
reading, the last good answer kept) and the relay file: `write_relay_file`, written by
``fleet pod-devices`` in a root container beside the agent, and `RelayFileReader`, the agent's
reading of it. Called by `fleet node-agent --annotate-node` (fleet/cli/agent.py), which resolves each
pod's uid (`fleet.k8s.node_facts.PodUids`) and hands the allocations to
`fleet.k8s.node_facts.node_facts` (the pods on a quarantined GPU, the GPUs each pod holds) and
`fleet.agent.pins.DepartedPodPins` (the weight-cache pins of pods gone).

The API is the kubelet's gRPC service ``v1.PodResourcesLister`` on the unix socket
``/var/lib/kubelet/pod-resources/kubelet.sock`` (Kubernetes pkg/kubelet/apis/podresources,
``List`` served in v1 since 1.20; the proto: fleet/agent/podresources_api/api.proto), what
NVIDIA's DCGM exporter reads. The kubelet makes the directory 0750 and the socket (0755 under
its umask) owned by root: only uid 0 can connect (pkg/kubelet/kubelet.go ``setupDataDirs``,
pkg/kubelet/util/util_unix.go ``CreateListener``). Device ids are what the device plugin
advertises: GPU UUIDs (``GPU-...``) and MIG UUIDs (``MIG-...``) with NVIDIA's device plugin and
``DEVICE_ID_STRATEGY=uuid``.

Why a relay: the agent shares the weight cache with the engine pods' init containers as uid
10001 (fleet/k8s/pod_weights.py); run as root, it would create cache directories and lock files
those cannot write. So on Kubernetes a second container of the agent's pod runs as root with no
capability, mounts only the PodResources directory, asks the kubelet (``fleet pod-devices``) and
writes the answer into a volume the two share; the agent (``--pod-devices-file``) reads it.
Where the agent itself runs as root, it asks the socket directly (``--pod-resources-socket``).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # gRPC is imported where a call is made: `fleet` commands start without it
    from fleet.agent.podresources_api import api_pb2

log = logging.getLogger("fleet.node_agent")

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
TIMEOUT_S = 10.0
"""The deadline of one ``List`` call (the kubelet's own client, pkg/kubelet/apis/podresources
``GetV1Client``, is given 10 s to connect)."""
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
"""The largest answer taken: the kubelet's client's ``defaultPodResourcesMaxSize`` (16 MiB)."""

MAX_SOCKET_PATH_BYTES = 107
"""The longest path a unix socket is connected by (``sun_path``, less its terminating zero)."""

PodKey = tuple[str, str]
"""``(namespace, name)``: how the PodResources API names a pod (it gives no uid)."""
Allocations = dict[PodKey, tuple[str, ...]]
"""``{(namespace, name): device ids}``: each pod's NVIDIA devices of every container, sorted."""


class PodResourcesError(RuntimeError):
    """A ``List`` call that gave no answer; the message names the socket and the reason."""


def is_nvidia_resource(name: str) -> bool:
    """Whole GPUs (``nvidia.com/gpu``) and MIG devices (``nvidia.com/mig-<profile>``, the
    device plugin's ``mixed`` strategy). Pure."""
    return name == "nvidia.com/gpu" or name.startswith("nvidia.com/mig-")


def nvidia_allocations(response: api_pb2.ListPodResourcesResponse) -> Allocations:
    """The NVIDIA devices of each pod in one ``List`` answer; other resources and pods without
    NVIDIA devices are left out. Pure."""
    out: dict[PodKey, set[str]] = {}
    for pod in response.pod_resources:
        for container in pod.containers:
            for devices in container.devices:
                if is_nvidia_resource(devices.resource_name) and devices.device_ids:
                    out.setdefault((pod.namespace, pod.name), set()).update(devices.device_ids)
    return {key: tuple(sorted(ids)) for key, ids in sorted(out.items())}


def list_pod_devices(socket: Path = DEFAULT_SOCKET, timeout_s: float = TIMEOUT_S) -> Allocations:
    """One ``List`` call on the kubelet's socket, within ``timeout_s`` seconds (connecting
    included). Raises `FileNotFoundError` when no socket is at ``socket`` and
    `PodResourcesError` when the call fails (refused, permission, deadline exceeded), the
    directory is closed to this user (the kubelet's is root's, 0750) or the
    path is longer than a unix socket's (107 bytes, ``sun_path``)."""
    path = os.path.abspath(socket)
    try:
        os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no kubelet PodResources socket") from None
    except PermissionError:
        raise PodResourcesError(f"{path}: permission denied (uid {os.getuid()}): only root reaches the "
                                f"kubelet's socket") from None
    if len(os.fsencode(path)) > MAX_SOCKET_PATH_BYTES:
        raise PodResourcesError(f"{path}: longer than a unix socket's path ({MAX_SOCKET_PATH_BYTES} bytes)")
    import grpc

    from fleet.agent.podresources_api import api_pb2, api_pb2_grpc

    options = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    with grpc.insecure_channel(f"unix://{path}", options=options) as channel:
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = stub.List(api_pb2.ListPodResourcesRequest(), timeout=timeout_s)
        except grpc.RpcError as err:
            raise PodResourcesError(f"{path}: List: {err.code().name}: {err.details()}") from None
    return nvidia_allocations(response)


class PodDevicesReader:
    """Asks the kubelet each step. ``reason``: why the last reading is not a fresh answer
    (None when it is); ``stale``: True when the call failed and `read` gave the last good
    answer. A missing socket (a node whose kubelet serves none, or no mount) reads as no
    allocation, not stale. Each new reason is logged once."""

    def __init__(self, socket: Path = DEFAULT_SOCKET, timeout_s: float = TIMEOUT_S) -> None:
        self.socket = Path(socket)
        self.timeout_s = timeout_s
        self.last: Allocations = {}
        self.reason: str | None = None
        self.stale = False

    def read(self) -> Allocations:
        """The allocations now, or the last good ones. Never raises."""
        try:
            self.last, reason, self.stale = list_pod_devices(self.socket, self.timeout_s), None, False
        except FileNotFoundError as err:
            self.last, reason, self.stale = {}, f"{err}: no GPU allocations known", False
        except PodResourcesError as err:
            reason, self.stale = f"{err}: GPU allocations as last read", True
        if reason is not None and reason != self.reason:
            log.warning("kubelet PodResources: %s", reason)
        self.reason = reason
        return self.last


# ----- the relay's file: the answer handed from a root container to the agent's user -----------

RELAY_MAX_AGE_S = 90.0
"""A relay file older than this is stale (its writer stopped): 3 of the chart's 30 s intervals."""


def write_relay_file(path: Path, reader: PodDevicesReader, now_s: float) -> None:
    """Write ``reader``'s last answer to ``path`` (JSON, 0644, replaced atomically):
    ``{"askedS": <Unix s>, "stale": bool, "reason": str | null, "pods": [{"namespace": ..., "name":
    ..., "devices": [...]}]}``. `RelayFileReader` reads it. Raises OSError when it cannot be written."""
    doc = {"askedS": now_s, "stale": reader.stale, "reason": reader.reason,
           "pods": [{"namespace": ns, "name": name, "devices": list(ids)} for (ns, name), ids in reader.last.items()]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, sort_keys=True))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def parse_relay_file(text: str, where: str) -> tuple[Allocations, float, bool, str | None]:
    """``(allocations, askedS, stale, reason)`` of a relay file's text. Raises ValueError naming
    ``where`` and the field. Pure."""
    try:
        doc = json.loads(text)
        asked_s, pods = float(doc["askedS"]), doc["pods"]
        allocations = {(str(p["namespace"]), str(p["name"])): tuple(str(i) for i in p["devices"]) for p in pods}
    except (ValueError, TypeError, KeyError) as err:
        raise ValueError(f"{where}: not a pod-devices relay file ({type(err).__name__}: {err})") from None
    return allocations, asked_s, bool(doc.get("stale")), doc.get("reason")


class RelayFileReader:
    """`PodDevicesReader`'s interface (``read``, ``last``, ``reason``, ``stale``) over the file
    `write_relay_file` keeps (``fleet pod-devices``, the chart's root container beside the
    agent): stale when the file is missing, unreadable, older than ``max_age_s`` or says so."""

    def __init__(self, path: Path, clock: Callable[[], float], max_age_s: float = RELAY_MAX_AGE_S) -> None:
        self.path = Path(path)
        self.clock = clock
        self.max_age_s = max_age_s
        self.last: Allocations = {}
        self.reason: str | None = None
        self.stale = True

    def read(self) -> Allocations:
        """The allocations the file holds, or the last good ones. Never raises."""
        try:
            allocations, asked_s, stale, reason = parse_relay_file(self.path.read_text(), str(self.path))
        except (OSError, ValueError) as err:
            reason, stale = f"{getattr(err, 'strerror', None) or err}: GPU allocations as last read", True
            if isinstance(err, FileNotFoundError):
                reason = f"{self.path}: no answer from the kubelet relayed yet"
        else:
            self.last = allocations
            age_s = self.clock() - asked_s
            if age_s > self.max_age_s:
                reason, stale = f"{self.path}: last answer {age_s:.0f} s old (the relay stopped?)", True
        if reason is not None and reason != self.reason:
            log.warning("kubelet PodResources: %s", reason)
        self.reason, self.stale = reason, stale
        return self.last
