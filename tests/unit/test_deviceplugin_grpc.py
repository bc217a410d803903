"""The device-plugin stand-in a real kubelet talks to (fleet/testing/k8s/deviceplugin_grpc.py), over
real unix sockets in a short temporary directory, against a FAKE kubelet that does what Kubernetes
1.20's device manager does (pkg/kubelet/cm/devicemanager): a ``Registration`` server on
``kubelet.sock`` that, on each ``Register``, dials the plugin's endpoint and follows its
``ListAndWatch`` stream, and a restart that deletes every plugin socket and makes a new
``kubelet.sock``. Checked: the registration's fields, the stream's new list on an Xid (and none on
an application Xid), NUMA topology, the preferred allocation inside an NVLink pair (the function
Fleet's process kubelet allocates with), Allocate's envs and mounts (read back through the fake
NVML a container would load), re-registration after the kubelet restarts, clean stops."""

from __future__ import annotations

import shutil
import tempfile
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from fleet.testing.fake_nvml import FileNvml, device, inject_xid, mig_h100, nvlink_pairs_4gpu, write_state
from fleet.testing.k8s.deviceplugin import DevicePlugin, preferred_devices
from fleet.testing.k8s.deviceplugin_api import api_pb2, api_pb2_grpc
from fleet.testing.k8s.deviceplugin_grpc import (
    DRIVER_MOUNT, HEALTHY, KUBELET_SOCKET, STATE_MOUNT, UNHEALTHY, NodeDevicePlugins, RegistrationError,
    serve_device_plugins,
)
from fleet.testing.nvml_driver import DRIVER_DIR
from tests.support.waits import wait_until

PAIRS = nvlink_pairs_4gpu()
GPU = [d["uuid"] for d in PAIRS["devices"]]        # NVLink pairs: GPU[0]-GPU[1], GPU[2]-GPU[3]
WHOLE = "GPU-00000001-0000-0000-0000-000000000000"
STREAM_S = 30.0     # the longest a test waits for the next message of a stream


class FakeKubelet(api_pb2_grpc.RegistrationServicer):
    """The kubelet's device manager as far as a plugin sees it. ``requests``: every RegisterRequest;
    ``devices[resource]``: ``{id: health}`` from the latest ListAndWatch list; ``refuse``: an error
    text ``Register`` answers with instead."""

    def __init__(self, plugin_dir: Path, refuse: str = "") -> None:
        self.dir = plugin_dir
        self.refuse = refuse
        self.requests: list[api_pb2.RegisterRequest] = []
        self.devices: dict[str, dict[str, str]] = {}
        self.lists = 0
        self._server: grpc.Server | None = None
        self._calls: list = []

    def Register(self, request, context):   # noqa: N802 - the service's method name
        if self.refuse:
            context.abort(grpc.StatusCode.UNKNOWN, self.refuse)
        self.requests.append(request)
        threading.Thread(target=self._follow, args=(request,), daemon=True).start()
        return api_pb2.Empty()

    def _follow(self, request: api_pb2.RegisterRequest) -> None:
        channel = grpc.insecure_channel(f"unix://{self.dir / request.endpoint}")
        call = api_pb2_grpc.DevicePluginStub(channel).ListAndWatch(api_pb2.Empty(), wait_for_ready=True)
        self._calls.append((channel, call))
        try:
            for response in call:
                self.devices[request.resource_name] = {d.ID: d.health for d in response.devices}
                self.lists += 1
        except grpc.RpcError:
            pass                                     # the plugin stopped, or this kubelet did

    def start(self) -> FakeKubelet:
        """Remove every plugin socket (the checkpoint and directories stay) and serve kubelet.sock,
        as the device manager's ``Start`` does."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for path in self.dir.iterdir():
            if path.is_socket():
                path.unlink()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, self._server)
        assert self._server.add_insecure_port(f"unix://{self.dir / KUBELET_SOCKET}")
        self._server.start()
        return self

    def stop(self) -> None:
        for channel, call in self._calls:
            call.cancel()
            channel.close()
        self._calls.clear()
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
        (self.dir / KUBELET_SOCKET).unlink(missing_ok=True)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def short_tmp():
    """A directory with a short path (a unix socket's path has at most 107 bytes)."""
    where = Path(tempfile.mkdtemp(prefix="dp-"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def plugin_dir(short_tmp) -> Path:
    return short_tmp / "var/lib/kubelet/device-plugins"


@pytest.fixture
def kubelet(plugin_dir):
    fake = FakeKubelet(plugin_dir).start()
    yield fake
    fake.stop()


def state_file(short_tmp: Path, snapshot: dict) -> Path:
    """The node's fake NVML state file, in a directory of its own (what containers get mounted)."""
    (short_tmp / "nvidia").mkdir(exist_ok=True)
    return write_state(short_tmp / "nvidia" / "state.json", snapshot)


def pairs_node(short_tmp: Path, **overrides) -> Path:
    snapshot = nvlink_pairs_4gpu()
    for d in snapshot["devices"]:
        d.update(overrides.get(d["uuid"], {}))
    return state_file(short_tmp, snapshot)


def mig_node(short_tmp: Path) -> Path:
    """One H100 cut into two 3g.40gb instances, and one whole H100."""
    snapshot = mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)]])
    snapshot["devices"].append(device(1, uuid=WHOLE))
    return state_file(short_tmp, snapshot)


@pytest.fixture
def plugins(short_tmp, plugin_dir, kubelet):
    served = serve_device_plugins(pairs_node(short_tmp), plugin_dir, poll_s=0.02)
    yield served
    served.stop()


def stub(plugin_dir: Path, resource_socket: str):
    channel = grpc.insecure_channel(f"unix://{plugin_dir / resource_socket}")
    return channel, api_pb2_grpc.DevicePluginStub(channel)


def test_each_resource_registers_with_the_kubelet_on_a_socket_of_its_own(short_tmp, plugin_dir, kubelet):
    with NodeDevicePlugins(mig_node(short_tmp), plugin_dir) as plugins:
        by_name = {r.resource_name: r for r in kubelet.requests}
        assert sorted(by_name) == ["nvidia.com/gpu", "nvidia.com/mig-3g.40gb"]
        for name, socket in (("nvidia.com/gpu", "nvidia-gpu.sock"),
                             ("nvidia.com/mig-3g.40gb", "nvidia-mig-3g.40gb.sock")):
            r = by_name[name]
            assert (r.version, r.endpoint) == ("v1beta1", socket)
            assert r.options.get_preferred_allocation_available and not r.options.pre_start_required
            assert (plugin_dir / socket).is_socket()
        assert plugins.registrations == 1 and plugins.errors == []
        devices = wait_until(lambda: len(kubelet.devices) == 2 and kubelet.devices, what="both lists at the kubelet")
        assert devices["nvidia.com/gpu"] == {WHOLE: HEALTHY}
        assert len(devices["nvidia.com/mig-3g.40gb"]) == 2
        assert all(i.startswith("MIG-") for i in devices["nvidia.com/mig-3g.40gb"])
    assert sorted(p.name for p in plugin_dir.iterdir()) == [KUBELET_SOCKET]   # stopped: our sockets are gone


def test_options_and_pre_start_answer_as_nvidias_plugin(plugin_dir, plugins):
    channel, plugin = stub(plugin_dir, "nvidia-gpu.sock")
    with channel:
        options = plugin.GetDevicePluginOptions(api_pb2.Empty(), timeout=STREAM_S)
        assert options.get_preferred_allocation_available and not options.pre_start_required
        assert plugin.PreStartContainer(api_pb2.PreStartContainerRequest(devicesIDs=[GPU[0]]), timeout=STREAM_S) \
            == api_pb2.PreStartContainerResponse()


def test_list_and_watch_sends_a_new_list_when_an_xid_makes_a_gpu_unhealthy(short_tmp, plugin_dir, kubelet):
    state = pairs_node(short_tmp, **{GPU[2]: {"numa_node": 1}})
    with NodeDevicePlugins(state, plugin_dir, poll_s=0.02):
        channel, plugin = stub(plugin_dir, "nvidia-gpu.sock")
        with channel:
            stream = plugin.ListAndWatch(api_pb2.Empty(), timeout=STREAM_S)
            first = next(stream).devices
            assert [(d.ID, d.health) for d in first] == [(g, HEALTHY) for g in GPU]
            numa = {d.ID: [n.ID for n in d.topology.nodes] if d.HasField("topology") else None for d in first}
            assert numa == {GPU[0]: None, GPU[1]: None, GPU[2]: [1], GPU[3]: None}
            inject_xid(state, GPU[1], 13)            # an application error: no list
            inject_xid(state, GPU[0], 79)            # fallen off the bus
            second = next(stream).devices
            assert {d.ID: d.health for d in second} == {GPU[0]: UNHEALTHY, GPU[1]: HEALTHY, GPU[2]: HEALTHY,
                                                         GPU[3]: HEALTHY}
            stream.cancel()
        wait_until(lambda: kubelet.devices.get("nvidia.com/gpu", {}).get(GPU[0]) == UNHEALTHY,
                   what="the kubelet's list to show GPU 0 unhealthy")


def test_an_xid_on_a_mig_gpu_makes_its_instances_unhealthy(short_tmp, plugin_dir, kubelet):
    state = mig_node(short_tmp)
    with NodeDevicePlugins(state, plugin_dir, poll_s=0.02):
        migs = wait_until(lambda: kubelet.devices.get("nvidia.com/mig-3g.40gb"), what="the MIG list")
        assert set(migs.values()) == {HEALTHY}
        inject_xid(state, "GPU-00000000-0000-0000-0000-000000000000", 48)   # double-bit ECC on the cut GPU
        wait_until(lambda: set(kubelet.devices["nvidia.com/mig-3g.40gb"].values()) == {UNHEALTHY},
                   what="both MIG devices unhealthy at the kubelet", explain=lambda: kubelet.devices)
        assert kubelet.devices["nvidia.com/gpu"] == {WHOLE: HEALTHY}


def test_the_preferred_allocation_keeps_a_pair_inside_one_nvlink_domain(plugin_dir, plugins):
    channel, plugin = stub(plugin_dir, "nvidia-gpu.sock")

    def preferred(available, size, must=()):
        request = api_pb2.PreferredAllocationRequest(container_requests=[api_pb2.ContainerPreferredAllocationRequest(
            available_deviceIDs=available, must_include_deviceIDs=list(must), allocation_size=size)])
        [answer] = plugin.GetPreferredAllocation(request, timeout=STREAM_S).container_responses
        return list(answer.deviceIDs)

    with channel:
        assert preferred([GPU[0], GPU[2], GPU[3]], 2) == [GPU[2], GPU[3]]        # the whole pair, not 0 and 2
        assert preferred(GPU, 2, must=[GPU[1]]) == [GPU[1], GPU[0]]            # GPU 1's partner
        assert preferred(GPU, 1) == [GPU[0]]
        with pytest.raises(grpc.RpcError) as refused:
            preferred([GPU[0]], 2)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "count: 2 devices asked, 1 available" in refused.value.details()


def test_the_process_kubelet_and_the_grpc_plugin_prefer_the_same_devices(short_tmp):
    """One function decides for both: `DevicePlugin.allocate` takes what `preferred_devices` picks."""
    state = pairs_node(short_tmp)
    box = DevicePlugin("gpu-b", state, short_tmp)
    assert box.allocate("pod-1", "engine", "nvidia.com/gpu", 1) == [GPU[0]]
    domains = box.domains
    assert box.allocate("pod-2", "engine", "nvidia.com/gpu", 2) == preferred_devices(GPU[1:], 2, domains) \
        == [GPU[2], GPU[3]]                                                   # a whole pair, not GPU 1 and 2
    with pytest.raises(ValueError, match="must_include"):
        preferred_devices(GPU, 1, domains, must_include=GPU[:2])


def test_allocate_makes_the_devices_and_the_fake_nvml_visible_as_the_toolkit_does(short_tmp, plugin_dir, plugins):
    channel, plugin = stub(plugin_dir, "nvidia-gpu.sock")
    with channel:
        request = api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(
            devicesIDs=[GPU[2], GPU[3]])])
        [answer] = plugin.Allocate(request, timeout=STREAM_S).container_responses
        with pytest.raises(grpc.RpcError) as refused:
            plugin.Allocate(api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(
                devicesIDs=["GPU-nope"])]), timeout=STREAM_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details() == "invalid allocation request for 'nvidia.com/gpu': unknown device: GPU-nope"
    envs = dict(answer.envs)
    assert envs == {"NVIDIA_VISIBLE_DEVICES": f"{GPU[2]},{GPU[3]}", "FLEET_FAKE_NVML": f"{STATE_MOUNT}/state.json",
                    "PYTHONPATH": DRIVER_MOUNT}
    mounts = {m.container_path: (m.host_path, m.read_only) for m in answer.mounts}
    assert mounts == {STATE_MOUNT: (str((short_tmp / "nvidia").resolve()), True),
                      DRIVER_MOUNT: (str(DRIVER_DIR), True)}
    assert (Path(mounts[DRIVER_MOUNT][0]) / "pynvml.py").is_file()
    # What a process of that container reads through the injected pynvml: the two GPUs, renumbered.
    host = {k: v.replace(STATE_MOUNT, mounts[STATE_MOUNT][0]) for k, v in envs.items()}
    nvml = FileNvml(host)
    nvml.nvmlInit()
    assert nvml.nvmlDeviceGetCount() == 2
    assert [nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)] == [GPU[2], GPU[3]]


def test_the_plugins_register_again_when_the_kubelet_restarts(plugin_dir, kubelet, plugins):
    assert len(kubelet.requests) == 1 and plugins.registrations == 1
    before = wait_until(lambda: kubelet.lists, what="the first kubelet's list")
    kubelet.restart()                                # our socket deleted, a new kubelet.sock
    wait_until(lambda: plugins.registrations == 2, what="a second registration", explain=lambda: plugins.errors)
    assert [r.resource_name for r in kubelet.requests] == ["nvidia.com/gpu", "nvidia.com/gpu"]
    assert (plugin_dir / "nvidia-gpu.sock").is_socket()
    wait_until(lambda: kubelet.lists > before, what="the new kubelet's list")
    assert set(kubelet.devices["nvidia.com/gpu"]) == set(GPU)


def test_plugins_started_before_the_kubelet_register_when_it_comes(short_tmp, plugin_dir):
    with NodeDevicePlugins(pairs_node(short_tmp), plugin_dir, poll_s=0.02) as plugins:
        assert plugins.registrations == 0 and (plugin_dir / "nvidia-gpu.sock").is_socket()
        late = FakeKubelet(plugin_dir)
        try:
            late.start()                             # removes our socket, as a starting kubelet does
            wait_until(lambda: plugins.registrations == 1 and late.devices.get("nvidia.com/gpu"),
                       what="registration with the late kubelet", explain=lambda: plugins.errors)
        finally:
            late.stop()


def test_a_refused_registration_fails_the_start_and_leaves_no_socket(short_tmp, plugin_dir):
    refusing = FakeKubelet(plugin_dir, refuse="Unsupported version v1beta1").start()
    try:
        with pytest.raises(RegistrationError, match="nvidia.com/gpu: the kubelet at .* refused Register: "
                                                    "UNKNOWN: Unsupported version v1beta1"):
            serve_device_plugins(pairs_node(short_tmp), plugin_dir)
        assert sorted(p.name for p in plugin_dir.iterdir()) == [KUBELET_SOCKET]
    finally:
        refusing.stop()


def test_stop_ends_open_streams(plugin_dir, plugins):
    channel, plugin = stub(plugin_dir, "nvidia-gpu.sock")
    with channel:
        stream = plugin.ListAndWatch(api_pb2.Empty(), timeout=STREAM_S)
        next(stream)
        plugins.stop()
        with pytest.raises((grpc.RpcError, StopIteration)) as ended:
            next(stream)
        if isinstance(ended.value, grpc.RpcError):
            assert ended.value.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    assert not (plugin_dir / "nvidia-gpu.sock").exists()
    plugins.stop()                                   # twice is fine


def test_bad_input_is_refused_naming_the_field(short_tmp, plugin_dir):
    empty = write_state(short_tmp / "cpu.json", {"driver_version": "580.159.04", "devices": []})
    with pytest.raises(ValueError, match="state_path: .* has no GPU or MIG device"):
        NodeDevicePlugins(empty, plugin_dir)
    with pytest.raises(ValueError, match="plugin_dir: the socket path .* is longer than"):
        NodeDevicePlugins(pairs_node(short_tmp), short_tmp / ("x" * 120))
