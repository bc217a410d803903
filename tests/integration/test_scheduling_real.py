"""Integration: engine pods as Fleet renders them (fleet/k8s/pods.py `pod_manifest`,
fleet/k8s/prepull.py `pull_pod_manifest`) placed by the REAL kube-scheduler of Kubernetes 1.20.2
(fleet/testing/k8s/kube.py), and the scheduler's refusal read back by Fleet
(fleet/k8s/pod_facts.py `pod_facts`, `pod_unschedulable`).

Real: the API server (admission, defaulting of the pod Fleet renders), the scheduler's binding
of a pod pinned by required node affinity on ``metadata.name``, its resource arithmetic over
``nvidia.com/gpu`` (what a pod Fleet did not make holds is subtracted) and the words of its
``PodScheduled`` condition. Stand-ins: the nodes are HOLLOW (fleet/testing/k8s/hollow.py: Node
objects with the capacity a device plugin would report, kept Ready by a heartbeat; no kubelet,
so a bound pod stays Pending). One control plane for the module.

Skips, saying why, when the control plane cannot be built or started here
(tests/support/real_kube.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fleet.controller.backend import ReplicaWant
from fleet.k8s.client import NODES, PODS, ApiError, KubeClient
from fleet.k8s.pod_facts import pod_facts, pod_node, pod_unschedulable
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import pod_manifest
from fleet.k8s.prepull import pull_pod_manifest
from fleet.placement import ReplicaPlacement
from fleet.placement.shapes import Assignment
from fleet.spec import LoadedDeployment, parse_document
from fleet.testing.k8s.hollow import HollowNodes
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.resources import SERVICE_ACCOUNTS
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)   # run alone, the first test may build (minutes)

CPU_NODE, GPU_NODE = "sched-cpu", "sched-gpu"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
SETTINGS = EnginePodSettings(default_image="registry.invalid/engine:1",
                             tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
NS = "sched"


def _in_own_loop(coro):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(CPU_NODE, GPU_NODE))


@pytest.fixture(scope="module")
def cluster(control_plane: RealControlPlane) -> Iterator[RealControlPlane]:
    """A CPU node and a GPU node (``nvidia.com/gpu: 8``, the GPU taint), Ready and schedulable,
    and namespace ``sched`` with its default ServiceAccount's token (admission wants it)."""
    wanted = {CPU_NODE: node(CPU_NODE, cpu=16), GPU_NODE: node(GPU_NODE, cpu=64, gpus=8, taints=[GPU_TAINT])}

    async def ready() -> None:
        kube = control_plane.client()
        try:
            async def schedulable() -> bool:
                nodes = [await kube.get(NODES, None, n) for n in wanted]
                return all(not [t for t in n["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
                           for n in nodes)  # fmt: skip

            await async_wait_until(schedulable, timeout_s=90, interval_s=0.5, explain=control_plane.explain,
                                   what="the node lifecycle controller to lift the not-ready taints")  # fmt: skip
            await kube.create(control_plane.resource("v1", "Namespace"), None,
                              {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})  # fmt: skip

            async def token() -> bool:
                try:
                    return bool((await kube.get(SERVICE_ACCOUNTS, NS, "default")).get("secrets"))
                except ApiError:
                    return False

            await async_wait_until(token, timeout_s=60, interval_s=0.2, explain=control_plane.explain,
                                   what=f"the default ServiceAccount's token in {NS}")  # fmt: skip
        finally:
            kube.close()

    with HollowNodes(control_plane, wanted, interval_s=5.0):
        _in_own_loop(ready())
        yield control_plane


@pytest.fixture
async def kube(cluster: RealControlPlane) -> AsyncIterator[KubeClient]:
    client = cluster.client()
    yield client
    client.close()


def _engine_pod(rid: str, tp: int) -> dict:
    """Fleet's own pod for a TP=``tp`` vLLM replica that placement put on the GPU node."""
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "chat"},
           "spec": {"model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                    "engine": {"kind": "vllm", "image": "registry.invalid/vllm:1"},
                    "resources": {"accelerator": "gpu", "tensorParallelSize": tp}}}  # fmt: skip
    ld = LoadedDeployment(parse_document(doc), Path("/deploy/chat.yaml"), 0)
    devices = tuple(f"{GPU_NODE}/gpu{i}" for i in range(tp))
    placement = ReplicaPlacement((Assignment(GPU_NODE, devices, {}, f"gpu:0-{tp - 1}"),))
    want = ReplicaWant(rid, ld.deployment, placement, ld.serving_hash, ld.base_dir)
    return pod_manifest(want, fleet_id="fleet", owner=None, settings=SETTINGS)


def _foreign_pod(name: str, gpus: int) -> dict:
    """A pod Fleet did not make, asking for ``gpus`` GPUs (anywhere they are)."""
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "automountServiceAccountToken": False, "tolerations": [{**GPU_TAINT, "operator": "Equal"}],
        "containers": [{"name": "other", "image": "registry.invalid/other:1",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}  # fmt: skip


async def _bound(kube: KubeClient, plane: RealControlPlane, name: str) -> str:
    async def node_name() -> str | None:
        return (await kube.get(PODS, NS, name))["spec"].get("nodeName")

    return await async_wait_until(node_name, timeout_s=60, interval_s=0.2, explain=plane.explain,
                                  what=f"the scheduler to bind pod {name}")  # fmt: skip


async def _gone(kube: KubeClient, *names: str) -> None:
    for name in names:   # no kubelet confirms a graceful delete: grace 0 removes the object at once
        try:
            await kube.delete(PODS, NS, name, grace_period_s=0)
        except ApiError:
            pass


async def test_the_scheduler_binds_fleets_pinned_pods_to_the_chosen_node(cluster, kube):
    """Real: the engine pod Fleet renders (no ``nodeName``; required node affinity on the GPU
    node's name; ``nvidia.com/gpu: 2``; the GPU taint tolerated) passes admission and the
    scheduler binds it to exactly that node, with ``PodScheduled`` True; the pre-pull pod for
    the CPU node lands on the CPU node."""
    pod = _engine_pod("chat-0", 2)
    assert "nodeName" not in pod["spec"]
    pull = pull_pod_manifest(CPU_NODE, "registry.invalid/vllm:1", fleet_id="fleet", settings=SETTINGS)
    try:
        created = await kube.create(PODS, NS, pod)
        assert pod_node(created) == GPU_NODE                       # known before it is bound
        await kube.create(PODS, NS, pull)
        assert await _bound(kube, cluster, "chat-0") == GPU_NODE
        assert await _bound(kube, cluster, pull["metadata"]["name"]) == CPU_NODE
        seen = await kube.get(PODS, NS, "chat-0")
        scheduled = [c for c in seen["status"].get("conditions") or [] if c["type"] == "PodScheduled"]
        assert scheduled and scheduled[0]["status"] == "True", seen["status"]
        assert pod_facts(seen).node == GPU_NODE and pod_unschedulable(seen) is None
    finally:
        await _gone(kube, "chat-0", pull["metadata"]["name"])


async def test_gpus_a_foreign_pod_holds_leave_fleets_pod_pending_and_fleet_reads_why(cluster, kube):
    """Real: a pod Fleet did not make is bound to the GPU node holding 7 of its 8 GPUs; Fleet's
    pod asking for 2 there stays Pending, ``PodScheduled`` False, reason Unschedulable, the
    scheduler's message naming ``Insufficient nvidia.com/gpu``; `pod_facts` reports that message
    and the node the pod is pinned to."""
    try:
        await kube.create(PODS, NS, _foreign_pod("other-7", 7))
        assert await _bound(kube, cluster, "other-7") == GPU_NODE
        await kube.create(PODS, NS, _engine_pod("chat-1", 2))

        async def refused() -> str | None:
            return pod_unschedulable(await kube.get(PODS, NS, "chat-1"))

        message = await async_wait_until(refused, timeout_s=60, interval_s=0.2, explain=cluster.explain,
                                         what="the scheduler to refuse chat-1")  # fmt: skip
        pod = await kube.get(PODS, NS, "chat-1")
        condition = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
        assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
        assert message.startswith("0/2 nodes are available:") and "Insufficient nvidia.com/gpu" in message, message
        assert not pod["spec"].get("nodeName") and pod["status"]["phase"] == "Pending"
        facts = pod_facts(pod)
        assert facts.unschedulable == message and facts.node == GPU_NODE and not facts.exited
        print(f"the real scheduler said: {message}")
    finally:
        await _gone(kube, "chat-1", "other-7")
