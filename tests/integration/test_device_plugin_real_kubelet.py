"""Integration: the device-plugin stand-in (fleet/testing/k8s/deviceplugin_grpc.py) registered with
a REAL kubelet, Kubernetes 1.20.2's own, on a real node (fleet/testing/k8s/realnode.py: the kubelet
over containerd and runc, joined to the real control plane of fleet/testing/k8s/kube.py).

Real here: the kubelet's device manager (registration, ListAndWatch, the Node's capacity and
allocatable, GetPreferredAllocation and Allocate at admission, its checkpoint), its PodResources
API (what Fleet's node agent asks, fleet/agent/pod_devices.py), the scheduler placing on
``nvidia.com/gpu``, containerd and runc running the pods with the plugin's envs and mounts.
Stand-ins: the devices (a fake NVML state file of four H100s in two NVLink pairs and one cut into
two 3g.40gb MIG instances) and the image
(busybox, built here). Skips, saying why, where the control plane or the node cannot run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.agent.pod_devices import list_pod_devices
from fleet.k8s.client import NODES, PODS, KubeClient, NotFound
from fleet.testing.fake_nvml import device, inject_xid, nvlink_pairs_4gpu, write_state
from fleet.testing.k8s.deviceplugin_grpc import NodeDevicePlugins, serve_device_plugins
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.realnode_images import BUSYBOX_IMAGE, node_images
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.real_kube import real_node
from tests.support.waits import wait_until


pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 600)

NODE = "gpu-real-1"
NS = "default"
SNAPSHOT = nvlink_pairs_4gpu()
GPU = [d["uuid"] for d in SNAPSHOT["devices"]]          # NVLink pairs: GPU[0]-GPU[1], GPU[2]-GPU[3]
SNAPSHOT["devices"].append(device(4, uuid="GPU-00000004-0000-0000-0000-000000000000", mig_instances=[
    {"uuid": f"MIG-4-{j}", "name": "NVIDIA H100 80GB HBM3 MIG 3g.40gb", "gi_id": j + 1, "start": start}
    for j, start in enumerate((0, 4))]))                 # a fifth H100, cut into two 3g.40gb instances
MIG = "nvidia.com/mig-3g.40gb"
PAIRS = [{GPU[0], GPU[1]}, {GPU[2], GPU[3]}]


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(NODE,))


@pytest.fixture(scope="module")
def node(plane: RealControlPlane, tmp_path_factory: pytest.TempPathFactory):
    with real_node(plane, NODE, tmp_path_factory.mktemp("node")) as real:
        real.import_image(node_images()["busybox"])
        yield real


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_state(tmp_path_factory.mktemp("nvml") / "state.json", SNAPSHOT)


@pytest.fixture(scope="module")
def plugins(node, state: Path) -> Iterator[NodeDevicePlugins]:
    served = serve_device_plugins(state, node.device_plugin_dir, node=NODE)
    yield served
    served.stop()


@pytest.fixture(scope="module")
def kube(plane: RealControlPlane) -> Iterator[KubeClient]:
    client = plane.client()
    yield client
    client.close()


def _gpus(kube: KubeClient, field: str, resource: str = "nvidia.com/gpu") -> str | None:
    return kube.request("GET", NODES.path(None, NODE))["status"].get(field, {}).get(resource)


def _pod(name: str, gpus: int) -> dict:
    show = ("echo NVIDIA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES; echo FLEET_FAKE_NVML=$FLEET_FAKE_NVML; "
            "echo PYTHONPATH=$PYTHONPATH; ls $PYTHONPATH; grep -c '\"uuid\"' $FLEET_FAKE_NVML; "
            "touch /run/fleet-fake-nvml/x || echo read-only; exec sleep 3600")  # fmt: skip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"terminationGracePeriodSeconds": 1, "containers": [{
                "name": "engine", "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                "command": ["/bin/sh", "-c", show],
                "resources": {"requests": {"cpu": "10m"}, "limits": {"memory": "32Mi", "nvidia.com/gpu": gpus}}}]}}


def _running(kube: KubeClient, name: str) -> dict | None:
    pod = kube.request("GET", PODS.path(NS, name))
    return pod if pod["status"].get("phase") == "Running" else None


def test_the_node_advertises_the_plugins_gpus(node, plugins, kube):
    """Real: the kubelet takes both registrations, follows ListAndWatch and reports four
    ``nvidia.com/gpu`` and two ``nvidia.com/mig-3g.40gb`` in the Node's capacity and allocatable
    (its status loop: about 10 s)."""
    assert plugins.registrations == 1 and plugins.errors == []
    wait_until(lambda: _gpus(kube, "allocatable") == "4" and _gpus(kube, "allocatable", MIG) == "2", timeout_s=60,
               interval_s=0.5, what="nvidia.com/gpu: 4 and 2 MIG devices allocatable", explain=node.explain)
    assert _gpus(kube, "capacity") == "4" and _gpus(kube, "capacity", MIG) == "2"


def test_a_pair_lands_on_one_nvlink_pair_with_the_fake_nvml_mounted(node, plugins, kube):
    """Real: with one GPU taken, the kubelet asks GetPreferredAllocation for two and gets the
    whole free NVLink pair (never one GPU of each); Allocate's envs and read-only mounts reach the
    container; PodResources reports each pod's GPUs as the plugin set them."""
    wait_until(lambda: _gpus(kube, "allocatable") == "4", timeout_s=60, interval_s=0.5, what="the GPUs advertised")
    kube.request("POST", PODS.path(NS), body=_pod("one", 1))
    wait_until(lambda: _running(kube, "one"), timeout_s=120, interval_s=0.5, what="pod one Running",
               explain=node.explain)  # fmt: skip
    kube.request("POST", PODS.path(NS), body=_pod("pair", 2))
    wait_until(lambda: _running(kube, "pair"), timeout_s=120, interval_s=0.5, what="pod pair Running",
               explain=node.explain)  # fmt: skip
    held = list_pod_devices(node.pod_resources_socket)
    one, pair = set(held[(NS, "one")]), set(held[(NS, "pair")])
    assert len(one) == 1 and pair in PAIRS and not one & pair, held
    log = wait_until(lambda: (text := asyncio.run(kube.read_log(NS, "pair"))) and "read-only" in text and text,
                     timeout_s=30, interval_s=0.5, what="the pair pod's output")  # fmt: skip
    lines = log.splitlines()
    [visible] = [line.split("=", 1)[1] for line in lines if line.startswith("NVIDIA_VISIBLE_DEVICES=")]
    assert set(visible.split(",")) == pair, log
    assert "FLEET_FAKE_NVML=/run/fleet-fake-nvml/state.json" in lines and "pynvml.py" in lines, log
    assert "7" in lines, log                          # the node's state file: five GPUs, two MIG devices


def test_an_xid_takes_the_gpu_out_of_allocatable(node, plugins, kube):
    """Real: Xid 79 on a GPU in use makes the plugin list it Unhealthy; the kubelet keeps it in
    capacity and drops it from allocatable."""
    wait_until(lambda: _gpus(kube, "allocatable") == "4", timeout_s=60, interval_s=0.5, what="the GPUs advertised")
    inject_xid(plugins.state_path, GPU[1], 79)
    wait_until(lambda: _gpus(kube, "allocatable") == "3", timeout_s=60, interval_s=0.5,
               what="nvidia.com/gpu: 3 allocatable after the Xid", explain=node.explain)  # fmt: skip
    assert _gpus(kube, "capacity") == "4"


def _gone(kube: KubeClient, name: str) -> bool:
    try:
        kube.request("GET", PODS.path(NS, name))
    except NotFound:
        return True
    return False


def test_pods_go_and_the_plugins_stop_cleanly(node, plugins, kube):
    """The kubelet stops the pods; the plugins stop and leave no socket of theirs behind."""
    for name in ("one", "pair"):
        if not _gone(kube, name):
            kube.request("DELETE", PODS.path(NS, name))
    wait_until(lambda: _gone(kube, "one") and _gone(kube, "pair"), timeout_s=90, interval_s=0.5,
               what="the pods gone", explain=node.explain)  # fmt: skip
    plugins.stop()
    assert not any(p.name.startswith("nvidia-") for p in node.device_plugin_dir.iterdir())
