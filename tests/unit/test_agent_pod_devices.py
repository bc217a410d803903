"""Which pod holds which GPU, asked of the kubelet's PodResources API (fleet/agent/pod_devices.py)
over a real unix socket in tmp_path, served by the kubelet stand-in's gRPC server
(fleet/testing/k8s/podresources.py) from the device plugin stand-in's allocations
(fleet/testing/k8s/deviceplugin.py): whole GPUs and MIG devices read, other resources dropped,
a missing socket read as no allocation, a dead or hanging server as the last good answer; the
relay file a root container keeps for the agent (``fleet pod-devices``, `RelayFileReader`)."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import stat
import tempfile
import threading
from pathlib import Path

import pytest

from fleet.agent.pod_devices import (
    PodDevicesReader, PodResourcesError, RelayFileReader, is_nvidia_resource, list_pod_devices, nvidia_allocations,
    parse_relay_file, write_relay_file,
)
from fleet.agent.podresources_api import api_pb2
from fleet.testing.fake_nvml import device, mig_h100, write_state
from fleet.testing.k8s.deviceplugin import DevicePlugin
from fleet.testing.k8s.podconfig import BoxNode
from fleet.testing.k8s.podresources import SOCKET, PodResourcesServer, list_response, serve_pod_resources
from tests.support.fakes import FakeClock

WHOLE = "GPU-00000001-0000-0000-0000-000000000000"


@pytest.fixture
def short_tmp():
    """A directory with a short path (a unix socket's path has at most 107 bytes; tmp_path's
    names run long)."""
    where = Path(tempfile.mkdtemp(prefix="podres-"))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture
def node(short_tmp) -> BoxNode:
    """A node of one H100 cut into two 3g.40gb instances and one whole H100."""
    snapshot = mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)]])
    snapshot["devices"].append(device(1, uuid=WHOLE))
    state = write_state(short_tmp / "state.json", snapshot)
    return BoxNode("gpu-a", short_tmp / "root", state, DevicePlugin("gpu-a", state, short_tmp / "root"))


@pytest.fixture
def served(node):
    server = serve_pod_resources(node)
    yield server
    server.stop()


def test_the_client_reads_whole_gpus_and_mig_devices_by_namespace_and_name(node, served):
    assert list_pod_devices(served.socket, timeout_s=10.0) == {}
    node.plugin.allocate("uid-1", "engine", "nvidia.com/gpu", 1, pod=("fleet", "r-1"))
    node.plugin.allocate("uid-2", "engine", "nvidia.com/mig-3g.40gb", 1, pod=("fleet", "r-2"))
    node.plugin.allocate("uid-2", "sidecar", "nvidia.com/mig-3g.40gb", 1, pod=("fleet", "r-2"))
    assert list_pod_devices(served.socket, timeout_s=10.0) == {
        ("fleet", "r-1"): (WHOLE,), ("fleet", "r-2"): ("MIG-0-0", "MIG-0-1")}
    node.plugin.release("uid-1")
    assert list(list_pod_devices(served.socket, timeout_s=10.0)) == [("fleet", "r-2")]
    assert served.calls == 3


def test_the_socket_and_its_directory_are_made_as_the_kubelet_makes_them(node, served):
    assert served.socket == node.root / SOCKET
    assert stat.S_ISSOCK(served.socket.stat().st_mode) and stat.S_IMODE(served.socket.stat().st_mode) == 0o755
    assert stat.S_IMODE(served.socket.parent.stat().st_mode) == 0o750
    served.stop()
    assert not served.socket.exists()


def test_resources_other_than_nvidia_gpus_and_mig_devices_are_dropped(node):
    node.plugin.allocate("uid-1", "engine", "nvidia.com/gpu", 1, pod=("fleet", "r-1"))
    node.plugin.allocations[("uid-3", "fpga")] = ("example.com/fpga", ["f0"])
    node.plugin.pods["uid-3"] = ("other", "f")
    answer = list_response(node.plugin)
    answer.pod_resources.append(api_pb2.PodResources(namespace="x", name="y", containers=[
        api_pb2.ContainerResources(name="c", devices=[api_pb2.ContainerDevices(resource_name="nvidia.com/gpux",
                                                                               device_ids=["z"])])]))
    assert [p.name for p in answer.pod_resources] == ["r-1", "f", "y"]      # the kubelet lists them all
    assert nvidia_allocations(answer) == {("fleet", "r-1"): (WHOLE,)}
    assert [is_nvidia_resource(r) for r in ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared",
                                            "amd.com/gpu")] == [True, True, False, False]


def test_a_missing_socket_is_no_allocation_with_its_reason_logged_once(tmp_path, caplog):
    reader = PodDevicesReader(tmp_path / "pod-resources" / "kubelet.sock", timeout_s=1.0)
    with caplog.at_level(logging.WARNING, "fleet.node_agent"):
        assert reader.read() == {} and reader.read() == {}
    assert not reader.stale and "no kubelet PodResources socket" in reader.reason
    assert len([r for r in caplog.records if "PodResources" in r.getMessage()]) == 1
    with pytest.raises(FileNotFoundError, match="kubelet.sock"):
        list_pod_devices(tmp_path / "pod-resources" / "kubelet.sock")


def test_a_dead_socket_keeps_the_last_good_answer(node, served):
    node.plugin.allocate("uid-1", "engine", "nvidia.com/gpu", 1, pod=("fleet", "r-1"))
    reader = PodDevicesReader(served.socket, timeout_s=5.0)
    good = reader.read()
    assert good == {("fleet", "r-1"): (WHOLE,)} and reader.reason is None and not reader.stale
    served.stop()
    dead = socket.socket(socket.AF_UNIX)      # a socket file nobody listens on: the kubelet stopped
    dead.bind(str(served.socket))
    dead.close()
    assert reader.read() == good and reader.stale and "UNAVAILABLE" in reader.reason
    served.start()
    assert reader.read() == good and reader.reason is None and not reader.stale


class _Hanging(PodResourcesServer):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.release = threading.Event()

    def List(self, request, context):   # noqa: N802
        self.release.wait(30.0)
        return super().List(request, context)


def test_a_server_that_hangs_is_cut_at_the_deadline(node, short_tmp):
    server = _Hanging(node.plugin, short_tmp / "kubelet.sock").start()
    try:
        with pytest.raises(PodResourcesError, match="DEADLINE_EXCEEDED"):
            list_pod_devices(server.socket, timeout_s=0.3)
        reader = PodDevicesReader(server.socket, timeout_s=0.3)
        assert reader.read() == {} and reader.stale and "DEADLINE_EXCEEDED" in reader.reason
    finally:
        server.release.set()
        server.stop()


def test_a_path_too_long_for_a_unix_socket_is_refused_naming_it(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "kubelet.sock"
    deep.parent.mkdir(parents=True)
    deep.touch()
    with pytest.raises(PodResourcesError, match="longer than a unix socket's path"):
        list_pod_devices(deep)


def test_a_node_without_a_device_plugin_serves_nothing(tmp_path):
    with pytest.raises(ValueError, match="cpu-a: no device plugin"):
        serve_pod_resources(BoxNode("cpu-a", tmp_path))


def test_the_relay_hands_the_answer_to_the_agent_through_a_file(node, served, short_tmp):
    from typer.testing import CliRunner

    from fleet.cli import app

    node.plugin.allocate("uid-1", "engine", "nvidia.com/gpu", 1, pod=("fleet", "r-1"))
    out = short_tmp / "pod-devices.json"
    clock = FakeClock(1_764_000_000.0)
    agent_side = RelayFileReader(out, clock, max_age_s=90.0)
    assert agent_side.read() == {} and agent_side.stale and "no answer" in agent_side.reason
    result = CliRunner().invoke(app, ["pod-devices", "--once", "--out", str(out),
                                      "--pod-resources-socket", str(served.socket)])
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(out.stat().st_mode) == 0o644
    asked_s = json.loads(out.read_text())["askedS"]
    clock.advance(asked_s + 1.0 - clock())
    assert agent_side.read() == {("fleet", "r-1"): (WHOLE,)} and not agent_side.stale and agent_side.reason is None
    clock.advance(90.0)                                        # the relay stopped: its answer kept, stale
    assert agent_side.read() == {("fleet", "r-1"): (WHOLE,)} and agent_side.stale and "91 s old" in agent_side.reason
    out.write_text('{"askedS": 1, "pods": [{"name": "x"}]}')
    assert agent_side.read() == {("fleet", "r-1"): (WHOLE,)} and agent_side.stale and "KeyError" in agent_side.reason


def test_the_relay_file_says_what_the_kubelet_did_not_answer(node, short_tmp):
    reader = PodDevicesReader(short_tmp / "none.sock")
    reader.read()
    write_relay_file(short_tmp / "f.json", reader, 100.0)
    allocations, asked_s, stale, reason = parse_relay_file((short_tmp / "f.json").read_text(), "f.json")
    assert (allocations, asked_s, stale) == ({}, 100.0, False) and "no kubelet PodResources socket" in reason
    with pytest.raises(ValueError, match="f.json: not a pod-devices relay file"):
        parse_relay_file("[]", "f.json")
