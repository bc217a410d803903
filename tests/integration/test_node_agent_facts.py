"""`fleet node-agent --annotate-node` as a real process on a node of the cluster in a box: NVML is
the per-node fake driver (fleet/testing/nvml_driver first on PYTHONPATH, `$FLEET_FAKE_NVML` naming
the node's state file), the API server is the stand-in (fleet/testing/k8s/apiserver.py). The
agent publishes its node facts; an Xid 79 written into the state file quarantines the GPU on a
2-GPU node (the cap does not withhold a certain fault) and the gpu-health annotation lists it with
the pod holding it, which the agent learns from the kubelet's PodResources API (the stand-in's
gRPC server on a unix socket, fleet/testing/k8s/podresources.py) and whose uid it gets from the
API server; after ``kill -9`` and a restart the quarantine is still there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fleet.k8s.client import NODES, PODS
from fleet.k8s.node_facts import GPU_HEALTH_ANNOTATION, NVLINK_DOMAINS_LABEL, parse_gpu_health
from fleet.testing.fake_nvml import pcie_4gpu
from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.deviceplugin import DevicePlugin
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.podresources import PodResourcesServer
from fleet.testing.nvml_driver import DRIVER_DIR, inject_xid, write_state
from tests.support.waits import async_wait_until

REPO = Path(__file__).resolve().parents[2]
NODE = "gpu-small"


async def test_the_agent_publishes_node_facts_and_keeps_an_xid_79_quarantine_across_kill_9(tmp_path):
    snapshot = {**pcie_4gpu(), "devices": pcie_4gpu()["devices"][:2]}    # 2 GPUs, no NVLink: the cap is 0.5 GPU
    state = write_state(tmp_path / "nvml-state.json", snapshot)
    sick = snapshot["devices"][1]["uuid"]
    api = APIServerStandIn()
    await api.start()
    api.store.create(NODES, None, node(NODE, gpus=2))   # labelled "0-1" by hand: the agent corrects it
    engine = api.store.create(PODS, "fleet", {"apiVersion": "v1", "kind": "Pod",
                                              "metadata": {"namespace": "fleet", "name": "chat-1"}})
    uid = engine["metadata"]["uid"]
    plugin = DevicePlugin(NODE, state, tmp_path)
    plugin.allocate("uid-a", "engine", "nvidia.com/gpu", 1, pod=("fleet", "gone"))   # GPU 0: a pod the API lost
    assert plugin.allocate(uid, "engine", "nvidia.com/gpu", 1, pod=("fleet", "chat-1")) == [sick]
    short = Path(tempfile.mkdtemp(prefix="podres-"))    # a unix socket's path has at most 107 bytes
    kubelet = PodResourcesServer(plugin, short / "kubelet.sock").start()
    env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"} | {
        "PYTHONPATH": f"{DRIVER_DIR}{os.pathsep}{REPO}", "FLEET_FAKE_NVML": str(state),
        "NVIDIA_VISIBLE_DEVICES": "all", "KUBECONFIG": str(api.kubeconfig(tmp_path / "kubeconfig")),
    }
    cache = tmp_path / "cache"
    args = [sys.executable, "-m", "fleet.cli", "node-agent", "--annotate-node", "--interval-s", "0.2",
            "--metrics-port", "0", "--node-name", NODE, "--root", str(cache), "--pod-resources-socket", str(kubelet.socket)]
    procs: list[subprocess.Popen] = []

    def start(n: int) -> subprocess.Popen:
        log = open(tmp_path / f"agent-{n}.log", "w")
        procs.append(subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT))
        log.close()
        return procs[-1]

    def explain() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp_path.glob("agent-*.log")))

    def node_obj() -> dict:
        return api.store.get(NODES, None, NODE)

    def health():
        value = (node_obj()["metadata"].get("annotations") or {}).get(GPU_HEALTH_ANNOTATION)
        return parse_gpu_health(value) if value else None

    try:
        agent = start(1)
        facts = await async_wait_until(health, 60, what="the gpu-health annotation", explain=explain)
        assert node_obj()["metadata"]["labels"][NVLINK_DOMAINS_LABEL] == "none"   # from NVML: no NVLink
        assert facts.health_checks and facts.quarantined == () and facts.allocations == {uid: (1,)}
        assert agent.poll() is None and kubelet.calls >= 1

        inject_xid(state, sick, 79)
        facts = await async_wait_until(lambda: (h := health()) and h.quarantined and h, 60,
                                       what="GPU 1 quarantined in the annotation", explain=explain)
        [q] = facts.quarantined
        assert (q.index, q.uuid, q.mig, q.pods) == (1, sick, None, (uid,))
        assert "Xid 79" in q.reason and "past the cap" in q.reason
        saved = json.loads((cache / ".agent" / "quarantine.json").read_text())
        assert saved["targets"][sick]["quarantined_since_s"] == q.since_s

        agent.kill()                                                   # kill -9: no goodbye
        agent.wait(30)
        api.store.patch(NODES, None, NODE, {"metadata": {"annotations": {GPU_HEALTH_ANNOTATION: None}}})
        agent = start(2)                                               # the Xid is not delivered again
        facts = await async_wait_until(health, 60, what="the annotation written again after the restart",
                                       explain=explain)
        [again] = facts.quarantined
        assert again == q and agent.poll() is None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        kubelet.stop()
        shutil.rmtree(short, ignore_errors=True)
        await api.stop()
