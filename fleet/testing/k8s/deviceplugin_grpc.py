"""The NVIDIA device plugin of one node, served to a REAL kubelet over the device-plugin gRPC API
(v1beta1, fleet/testing/k8s/deviceplugin_api/api.proto). A TEST STAND-IN for
NVIDIA/k8s-device-plugin (its internal/plugin/server.go: one gRPC server per resource name, each
on its own unix socket ``nvidia-<name>.sock`` in the kubelet's device-plugins directory).

The devices, their NVLink domains and their health come from the node's fake NVML state file
through the in-process stand-in's inventory (fleet/testing/k8s/deviceplugin.py `DevicePlugin`:
``nvidia.com/gpu`` and ``nvidia.com/mig-<profile>`` by UUID; an Xid other than the application
ones makes a GPU and its MIG devices unhealthy). Per resource, `ResourcePlugin` answers:

- ``GetDevicePluginOptions``: `OPTIONS` (preferred allocation available, no PreStartContainer);
- ``ListAndWatch``: every device with its health (``Healthy``/``Unhealthy``, `HEALTHY`) and its
  NUMA node when the state file knows it (``numa_node``; a MIG device has its GPU's), then a new
  list each time a device's health changes;
- ``GetPreferredAllocation``: `fleet.testing.k8s.deviceplugin.preferred_devices`, the one function
  Fleet's process kubelet allocates with too (inside one NVLink domain for whole GPUs);
- ``Allocate``: what the NVIDIA device plugin and container toolkit give a container here
  (`container_response`): ``NVIDIA_VISIBLE_DEVICES`` (the device UUIDs, comma-separated: the
  plugin's ``envvar`` device-list strategy) and the fake NVML "driver": the state file's directory
  mounted read-only at `STATE_MOUNT` with ``FLEET_FAKE_NVML`` naming the file in it, and
  fleet/testing/nvml_driver mounted read-only at `DRIVER_MOUNT`, on ``PYTHONPATH`` (the mounts and
  variables fleet/testing/k8s/podconfig.py gives a GPU container of Fleet's process kubelet);
  an unknown device id is refused (INVALID_ARGUMENT), as the plugin does;
- ``PreStartContainer``: nothing.

`NodeDevicePlugins` runs every resource of one node: it registers each with the kubelet's
``Registration`` service on ``kubelet.sock`` (version v1beta1, the socket's name as endpoint,
the resource name, `OPTIONS`) and, on a thread of its own, polls the state file for health and
the kubelet's socket: a kubelet that starts deletes every plugin socket and makes a new
``kubelet.sock`` (Kubernetes pkg/kubelet/cm/devicemanager/manager.go ``Start``), and the plugins
then serve again and register again, as NVIDIA's plugin does on the socket's fsnotify event.
`serve_device_plugins(state, plugin_dir)` starts one in one call; ``stop`` ends it. Called by
tests/unit/test_deviceplugin_grpc.py (a fake kubelet) and by scratch runs against a real kubelet.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from pathlib import Path

import grpc

from fleet.testing.fake_nvml import FAKE_NVML_ENV
from fleet.testing.k8s.deviceplugin import GPU, DevicePlugin, preferred_devices
from fleet.testing.k8s.deviceplugin_api import api_pb2, api_pb2_grpc
from fleet.testing.k8s.nvidia_runtime import DRIVER_MOUNT, STATE_MOUNT
from fleet.testing.nvml_driver import DRIVER_DIR

log = logging.getLogger(__name__)

VERSION = "v1beta1"
"""The API version a plugin registers with (deviceplugin/v1beta1/constants.go ``Version``)."""
PLUGIN_DIR = "var/lib/kubelet/device-plugins"
"""The kubelet's device-plugins directory under a node's root (``DevicePluginPath``)."""
KUBELET_SOCKET = "kubelet.sock"
"""The kubelet's ``Registration`` socket in that directory (``KubeletSocket``)."""
HEALTHY, UNHEALTHY = "Healthy", "Unhealthy"
OPTIONS = api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)
"""What the plugin registers with and answers ``GetDevicePluginOptions`` with (NVIDIA's plugin)."""
MAX_SOCKET_PATH = 107
"""The longest path a unix socket can have (``sun_path`` is 108 bytes with its NUL)."""
REGISTER_TIMEOUT_S = 5.0
"""How long ``Register`` waits for the kubelet to answer (NVIDIA's plugin dials with 5 s)."""


class RegistrationError(RuntimeError):
    """The kubelet refused a plugin's ``Register`` call, or did not answer in time."""


def socket_name(resource: str) -> str:
    """The socket file of ``resource`` (``nvidia.com/gpu`` -> ``nvidia-gpu.sock``,
    ``nvidia.com/mig-3g.40gb`` -> ``nvidia-mig-3g.40gb.sock``), as NVIDIA's plugin names it."""
    return "nvidia-" + resource.split("/", 1)[-1] + ".sock"


def numa_nodes(snapshot: dict) -> dict[str, int]:
    """GPU UUID -> NUMA node, for each device of an NVML snapshot whose ``numa_node`` reading is
    a non-negative integer (a reading NVML could not take is ``{"error": ...}`` and left out)."""
    out = {}
    for d in snapshot.get("devices", []):
        numa = d.get("numa_node")
        if isinstance(numa, int) and not isinstance(numa, bool) and numa >= 0:
            out[d["uuid"]] = numa
    return out


def container_response(ids: Sequence[str], state_path: Path,
                       driver_dir: Path = DRIVER_DIR) -> api_pb2.ContainerAllocateResponse:
    """What one container gets for devices ``ids``: ``NVIDIA_VISIBLE_DEVICES`` and the fake NVML
    (``state_path``'s directory at `STATE_MOUNT`, ``driver_dir`` at `DRIVER_MOUNT`, both
    read-only; ``FLEET_FAKE_NVML`` and ``PYTHONPATH`` pointing at them)."""
    state_path = Path(state_path).resolve()
    envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(ids), FAKE_NVML_ENV: f"{STATE_MOUNT}/{state_path.name}",
            "PYTHONPATH": DRIVER_MOUNT}  # fmt: skip
    mounts = [api_pb2.Mount(container_path=STATE_MOUNT, host_path=str(state_path.parent), read_only=True),
              api_pb2.Mount(container_path=DRIVER_MOUNT, host_path=str(Path(driver_dir).resolve()), read_only=True)]
    return api_pb2.ContainerAllocateResponse(envs=envs, mounts=mounts)


def _check_socket_path(path: Path) -> Path:
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ValueError(f"plugin_dir: the socket path {path} is longer than a unix socket's {MAX_SOCKET_PATH} bytes")
    return path


class NodeState:
    """What every resource plugin of a node shares: the inventory, its health under one lock, and
    a generation counter that `bump` raises when a device's health changes (streams wait on it)."""

    def __init__(self, inventory: DevicePlugin, snapshot: dict, state_path: Path, driver_dir: Path) -> None:
        self.inventory = inventory
        self.numa = numa_nodes(snapshot)
        self.state_path = state_path
        self.driver_dir = driver_dir
        self.changed = threading.Condition()
        self.generation = 0
        self.stopping = False

    def refresh(self) -> bool:
        """Read the state file's Xids; when a device became unhealthy, wake every stream. True then."""
        with self.changed:
            if not self.inventory.refresh_health():
                return False
            self.generation += 1
            self.changed.notify_all()
            return True

    def unhealthy(self) -> frozenset[str]:
        with self.changed:
            return frozenset(self.inventory.unhealthy)

    def numa_of(self, device_id: str) -> int | None:
        return self.numa.get(self.inventory.parent.get(device_id, device_id))


class ResourcePlugin(api_pb2_grpc.DevicePluginServicer):
    """The ``DevicePlugin`` service of one resource (``resource``, e.g. ``nvidia.com/gpu``) over the
    node's shared state, served on ``<plugin_dir>/`` `socket_name` (``resource``)."""

    def __init__(self, node: NodeState, resource: str, plugin_dir: Path) -> None:
        self.node = node
        self.resource = resource
        self.socket = _check_socket_path(Path(plugin_dir) / socket_name(resource))
        self.ids = list(node.inventory.resources()[resource])
        self._server: grpc.Server | None = None

    # -- the service -----------------------------------------------------------------------------
    def GetDevicePluginOptions(self, request, context):   # noqa: N802 - the service's method names
        return OPTIONS

    def devices(self) -> list[api_pb2.Device]:
        """The resource's devices, each with its health and NUMA node, as ``ListAndWatch`` lists them."""
        unhealthy = self.node.unhealthy()
        out = []
        for i in self.ids:
            numa = self.node.numa_of(i)
            topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=numa)]) if numa is not None else None
            out.append(api_pb2.Device(ID=i, health=UNHEALTHY if i in unhealthy else HEALTHY, topology=topology))
        return out

    def ListAndWatch(self, request, context) -> Iterator[api_pb2.ListAndWatchResponse]:   # noqa: N802
        sent: list[api_pb2.Device] | None = None
        seen = -1
        while context.is_active():
            with self.node.changed:
                self.node.changed.wait_for(lambda: self.node.stopping or self.node.generation != seen, timeout=0.5)
                if self.node.stopping:
                    return
                seen = self.node.generation
            devices = self.devices()
            if devices != sent:
                sent = devices
                yield api_pb2.ListAndWatchResponse(devices=devices)

    def GetPreferredAllocation(self, request, context):   # noqa: N802
        domains = self.node.inventory.domains if self.resource == GPU else ()
        responses = []
        for req in request.container_requests:
            try:
                ids = preferred_devices(list(req.available_deviceIDs), req.allocation_size, domains,
                                        list(req.must_include_deviceIDs))
            except ValueError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"preferred allocation of {self.resource}: {exc}")
            responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request, context):   # noqa: N802
        responses = []
        for req in request.container_requests:
            unknown = [i for i in req.devicesIDs if i not in self.ids]
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"invalid allocation request for '{self.resource}': unknown device: {unknown[0]}")
            responses.append(container_response(list(req.devicesIDs), self.node.state_path, self.node.driver_dir))
        return api_pb2.AllocateResponse(container_responses=responses)

    def PreStartContainer(self, request, context):   # noqa: N802
        return api_pb2.PreStartContainerResponse()

    # -- the server ------------------------------------------------------------------------------
    def serve(self) -> None:
        """Listen on the socket (a stale one is removed first, as NVIDIA's plugin does). Raises
        RuntimeError when it cannot be bound."""
        self.stop()
        self.socket.parent.mkdir(parents=True, exist_ok=True)
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix=socket_name(self.resource)))
        api_pb2_grpc.add_DevicePluginServicer_to_server(self, server)
        if not server.add_insecure_port(f"unix://{self.socket}"):
            raise RuntimeError(f"{self.socket}: cannot listen")
        server.start()
        self._server = server

    def register(self, kubelet_socket: Path) -> None:
        """Register with the kubelet's ``Registration`` service at ``kubelet_socket``. Raises
        RegistrationError when the kubelet refuses or does not answer in `REGISTER_TIMEOUT_S`."""
        request = api_pb2.RegisterRequest(version=VERSION, endpoint=self.socket.name, resource_name=self.resource,
                                          options=OPTIONS)  # fmt: skip
        with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
            try:
                api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=REGISTER_TIMEOUT_S,
                                                                wait_for_ready=True)
            except grpc.RpcError as exc:
                raise RegistrationError(f"{self.resource}: the kubelet at {kubelet_socket} refused Register: "
                                        f"{exc.code().name}: {exc.details()}") from None

    def stop(self) -> None:
        """Stop answering at once (open streams end) and remove the socket."""
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


class NodeDevicePlugins:
    """Every resource plugin of the node whose fake NVML state file is ``state_path``, for the
    kubelet whose device-plugins directory is ``plugin_dir`` (a real node's is /`PLUGIN_DIR`).
    ``node``: the node's name (the inventory's); ``driver_dir``: the ``pynvml`` stand-in mounted
    into containers; ``poll_s``: how often the state file and the kubelet's socket are read.
    Raises ValueError when the state file has no GPU or MIG device, or a socket path is too long.

    ``registrations`` counts the registration rounds that succeeded (every resource registered);
    ``errors`` keeps each refused or unanswered registration (`RegistrationError` text)."""

    def __init__(self, state_path: Path, plugin_dir: Path, *, node: str = "node", driver_dir: Path = DRIVER_DIR,
                 poll_s: float = 0.1) -> None:  # fmt: skip
        self.state_path = Path(state_path)
        self.plugin_dir = Path(plugin_dir)
        self.kubelet_socket = _check_socket_path(self.plugin_dir / KUBELET_SOCKET)
        self.poll_s = poll_s
        snapshot = json.loads(self.state_path.read_text())
        inventory = DevicePlugin(node, self.state_path, Path("/"))   # a kubelet's node: this machine
        self.state = NodeState(inventory, snapshot, self.state_path, Path(driver_dir))
        self.plugins = {res: ResourcePlugin(self.state, res, self.plugin_dir) for res in inventory.resources()}
        if not self.plugins:
            raise ValueError(f"state_path: {state_path} has no GPU or MIG device to advertise")
        self.registrations = 0
        self.errors: list[str] = []
        self._kubelet: tuple[int, int] | None = None   # the kubelet socket registered with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NodeDevicePlugins:
        """Serve every resource, register with the kubelet if its socket is there (otherwise when
        it appears), and watch. Returns self. Raises RegistrationError (after stopping) when a
        kubelet that is there refuses a registration."""
        self.state.refresh()
        for plugin in self.plugins.values():
            plugin.serve()
        if not self._follow_kubelet():
            self.stop()
            raise RegistrationError(self.errors[-1])
        self._thread = threading.Thread(target=self._watch, name="device-plugins", daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.state.refresh()
                self._follow_kubelet()
            except (OSError, ValueError, RuntimeError) as exc:   # a half-written file, a socket in flux
                log.warning("device plugins of %s: %s", self.state_path, exc)

    def _follow_kubelet(self) -> bool:
        """Register again when the kubelet's socket is new or one of ours is gone (the kubelet
        started and removed them), serving the missing ones first. False when a registration failed."""
        kubelet = _identity(self.kubelet_socket)
        if kubelet is None:
            return True
        missing = [p for p in self.plugins.values() if not p.socket.exists()]
        if kubelet == self._kubelet and not missing:
            return True
        for plugin in missing:
            plugin.serve()
        self._kubelet = kubelet
        try:
            for plugin in self.plugins.values():
                plugin.register(self.kubelet_socket)
        except RegistrationError as exc:
            log.warning("%s", exc)
            self.errors.append(str(exc))
            return False
        self.registrations += 1
        return True

    def stop(self) -> None:
        """Stop watching and serving (open ``ListAndWatch`` streams end); every plugin socket is
        removed. Safe to call twice; a stopped instance does not start again."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.state.changed:
            self.state.stopping = True
            self.state.changed.notify_all()
        for plugin in self.plugins.values():
            plugin.stop()

    def __enter__(self) -> NodeDevicePlugins:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_device_plugins(state_path: Path, plugin_dir: Path, **options) -> NodeDevicePlugins:
    """Start the device plugins of the node whose fake NVML state file is ``state_path`` for the
    kubelet of ``plugin_dir`` (`NodeDevicePlugins` says what ``options`` it takes and what it
    raises); ``stop()`` the result. ``with NodeDevicePlugins(...) as plugins:`` does both."""
    return NodeDevicePlugins(state_path, plugin_dir, **options).start()
