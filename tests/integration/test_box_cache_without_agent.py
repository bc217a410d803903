"""Integration: an engine pod that reads the node weight cache, on a node where no node agent runs
(outside `agent.nodeSelector`), on the cluster in a box's kubelet (fleet/testing/k8s/podrunner.py:
the pod spec as the operator makes it, containers as their user in their own mount namespace,
hostPath ``DirectoryOrCreate`` made root-owned 0755 as the kubelet makes it).

The pod never waits in FailedMount: the kubelet creates the cache directory, the ``weights`` init
container (UID 10001) cannot write there and exits 1 with the permission error, and the pod
fails (``restartPolicy: Never``) with that reason, which the operator reads back
(`fleet.k8s.pod_facts`), so the replica is replaced. With the cache's hostPath of type
``Directory`` the pod would stay in ContainerCreating for ever and this test would time out.

Needs root (mount namespaces, running containers as their user) and Linux; skips otherwise.
"""

from __future__ import annotations

import stat

import pytest

from fleet.k8s.client import NODES, PODS
from fleet.k8s.pod_facts import pod_facts
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import pod_manifest
from fleet.testing.k8s.kubelet import ImagePuller
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.podconfig import BoxNode
from fleet.testing.k8s.kubelet_api import StoreKubeletApi
from fleet.testing.k8s.podrunner import BoxKubelet
from fleet.testing.k8s.store import ObjectStore
from fleet.testing.k8s.workloads import schedule
from tests.integration.test_cluster_box import _can_run_containers
from tests.support.waits import async_wait_until
from tests.unit.test_k8s_backend import _dep, _want

pytestmark = [pytest.mark.timeout(180)]
IMAGE = "ghcr.io/inference-fleet/fleet:0.1.0"
CACHE = "/var/lib/fleet/cache"


async def test_an_engine_pod_on_a_node_without_the_agent_fails_its_pull_instead_of_hanging(tmp_path):
    why_not = _can_run_containers()
    if why_not:
        pytest.skip(why_not)
    store = ObjectStore()
    store.create(NODES, None, node("cpu-1", cpu=8, images=[IMAGE]))
    root = tmp_path / "nodes" / "cpu-1"
    root.mkdir(parents=True)
    kubelet = BoxKubelet(StoreKubeletApi(store), {"cpu-1": BoxNode("cpu-1", root)}, tmp_path, token_for=lambda ns, sa: "",
                         ca_pem=b"", api_port=1, puller=ImagePuller())  # fmt: skip
    settings = EnginePodSettings(default_image=IMAGE, weight_cache_path=CACHE, fleet_image=IMAGE)
    want = _want(_dep(model={"name": "tiny", "source": "hf://org/tiny@v2"}), node_name="cpu-1")
    pod = pod_manifest(want, fleet_id="f", owner=None, settings=settings)
    assert {"name": "weight-cache", "hostPath": {"path": CACHE, "type": "DirectoryOrCreate"}} in pod["spec"]["volumes"]
    kubelet.start()
    try:
        store.create(PODS, "fleet", pod)
        name = pod["metadata"]["name"]
        assert schedule(store) == {("fleet", name): "cpu-1"}   # the scheduler stand-in binds it (node affinity)

        def current() -> dict:
            return store.get(PODS, "fleet", name)

        await async_wait_until(lambda: (current().get("status") or {}).get("phase") == "Failed", 90, interval_s=0.2,
                               what="the engine pod Failed (not stuck mounting the cache)",
                               explain=lambda: str(current().get("status")))  # fmt: skip
    finally:
        await kubelet.stop()
    facts = pod_facts(current())
    assert facts.exited and not facts.weights_present
    assert facts.exit_reason.startswith("the weights init container exited 1"), facts.exit_reason
    # the pull's own words (a real kubelet makes its last log lines the termination message:
    # FallbackToLogsOnError; the box's does not)
    [log] = (tmp_path / "pods").glob(f"*{name}*/weights.log")
    assert f"PermissionError: [Errno 13] Permission denied: '{CACHE}/" in log.read_text(), log.read_text()[-2000:]
    made = root / CACHE.lstrip("/")
    mode = made.stat()
    assert (mode.st_uid, stat.S_IMODE(mode.st_mode)) == (0, 0o755)   # as the kubelet makes it: root-owned
