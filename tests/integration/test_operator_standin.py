"""Integration: the real `fleet operator` process, with the real `kubernetes` client, against the
HTTP STAND-IN for the API server and a stand-in kubelet that runs each pod as a local engine
SIMULATOR (fleet/testing/k8s/apiserver.py). Not a Kubernetes cluster: docs/kubernetes.md says what has
and has not run against a real one.

Apply an InferenceDeployment, the pods start, warm, and the router serves them; scale; an engine
dies and its replica is replaced; kill -9 the operator and start another (it waits for the Lease, then adopts: no pod restarted, no
warm-up again); delete the resource and everything goes (drained through the router first)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fleet.k8s.client import EVENTS, INFERENCE_DEPLOYMENTS, LEASES, NODES, PODS, KubeClient, NotFound
from fleet.k8s.routerpod import serve_router_pod
from fleet.testing.k8s.apiserver import APIServerStandIn, KubeletStandIn
from fleet.testing.k8s.nodes import node
from tests.support.waits import async_wait_until

REPO = Path(__file__).resolve().parents[2]
NS = "fleet"
TOKEN = "standin-admin-token"
CR = {
    "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
    "metadata": {"name": "sim-chat"},
    "spec": {"model": {"name": "llama-8b-sim", "source": "sim://h100-llama-8b"},
             "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 60},
             "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 4, "initial": 2},
             "warmup": {"requests": [{"kind": "completion", "prompt": "Hello", "maxTokens": 4}]}},
}
pytestmark = pytest.mark.timeout(240)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Waits on processes polled over HTTP: ten polls a second.
standin_wait = functools.partial(async_wait_until, interval_s=0.1)


class Operator:
    """`fleet operator` as a process of its own."""

    def __init__(self, tmp: Path, kubeconfig: Path, admin_url: str, identity: str, metrics_port: int = 0) -> None:
        self.log_path = tmp / f"operator-{identity}.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "FLEET_NAMESPACE": NS, "POD_NAME": identity,
               "FLEET_ROUTER_ADMIN_TOKEN": TOKEN, "FLEET_ROUTER_ADMIN_URL": admin_url, "FLEET_ROUTER_SELECTOR": "none",
               "FLEET_ENGINE_IMAGE": "fleet:standin", "FLEET_LOG_LEVEL": "INFO",
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fleet.cli", "operator", "--tick-s", "0.3", "--lease-duration-s", "3",
             "--metrics-port", str(metrics_port), "--resync-s", "30"],
            env=env, stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]


async def test_operator_against_the_api_server_stand_in(tmp_path):
    api = APIServerStandIn()
    await api.start()
    store = api.store
    store.create(NODES, None, node("node-a", cpu=16))
    kubelet = KubeletStandIn(store, {"node-a"}, tmp_path, env={"PYTHONPATH": str(REPO)})
    kubelet.start()
    port, admin_port = _free_port(), _free_port()
    router_stop = asyncio.Event()
    router = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, TOKEN, stop=router_stop))
    kube = KubeClient.for_host(api.url)
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    admin_url = f"http://127.0.0.1:{admin_port}"
    ops: list[Operator] = []
    http = httpx.AsyncClient(timeout=10)

    def why() -> str:
        pods = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in store.list(PODS, NS, None)[0]}
        return f"pods: {pods}\n" + "\n".join(f"--- {o.log_path.name}\n{o.log()}" for o in ops)

    async def pods() -> dict[str, dict]:
        items, _ = await kube.list(PODS, NS, "app.kubernetes.io/managed-by=fleet-operator")
        return {p["metadata"]["name"]: p for p in items}

    async def status() -> dict:
        return (await kube.get(INFERENCE_DEPLOYMENTS, NS, "sim-chat")).get("status") or {}

    async def served(n: int) -> bool:
        """The router has ``n`` READY endpoints for the model and answers a completion."""
        pools = (await http.get(f"{admin_url}/admin/v1/pools", headers={"Authorization": f"Bearer {TOKEN}"})).json()
        eps = [e for e in pools["pools"].get("llama-8b-sim", {}).get("endpoints", []) if not e.get("draining")]
        if len(eps) != n:
            return False
        r = await http.post(f"http://127.0.0.1:{port}/v1/completions",
                            json={"model": "llama-8b-sim", "prompt": "hello there", "max_tokens": 4})
        return r.status_code == 200 and r.json()["choices"][0]["text"] != ""

    try:
        await standin_wait(lambda: _ok(http, f"http://127.0.0.1:{port}/health"), 30, what="the router")
        ops.append(Operator(tmp_path, kubeconfig, admin_url, "op-a"))
        # kubectl apply: the same document `fleet up` takes
        await kube.create(INFERENCE_DEPLOYMENTS, NS, CR)
        await standin_wait(lambda: served(2), 90, what="2 replicas served through the router", explain=why)
        # the engine image was pre-pulled onto the node once, by a pod that is gone again
        assert kubelet.puller.pulls == {("node-a", "fleet:standin"): 1}
        assert any(n.startswith("prepull-node-a-") for n in kubelet.seen_pods)
        assert not [n for n in await pods() if n.startswith("prepull-")]
        st = await standin_wait(lambda: _status_with(status, 2), 30, what="status readyReplicas 2", explain=why)
        cond = {c["type"]: c["status"] for c in st["conditions"]}
        assert cond == {"Ready": "True", "Progressing": "False", "Degraded": "False"}
        assert sorted(await pods()) == ["sim-chat-0", "sim-chat-1"]

        # scale
        await kube.patch(INFERENCE_DEPLOYMENTS, NS, "sim-chat", {"spec": {"replicas": {"initial": 3}}})
        await standin_wait(lambda: served(3), 60, what="3 replicas served after scaling", explain=why)
        await standin_wait(lambda: _status_with(status, 3), 30, what="status readyReplicas 3", explain=why)

        # an engine dies (kill -9 of its process: the pod fails): replaced, served by 3 again
        kubelet.procs[(NS, "sim-chat-0")].kill()

        async def replaced() -> bool:
            names = set(await pods())
            return "sim-chat-0" not in names and "sim-chat-3" in names and await served(3)

        await standin_wait(replaced, 60, what="the failed replica replaced and served", explain=why)
        events = [e for e in store.list(EVENTS, NS, None)[0] if e["involvedObject"]["name"] == "sim-chat"]
        assert any(e["reason"] == "ReplicaFailedCrashed" and e["type"] == "Warning" for e in events)
        before = {n: p["metadata"]["uid"] for n, p in (await pods()).items()}
        started = kubelet.started

        # kill -9 the operator; another one waits for the Lease, then adopts
        os.killpg(ops[0].proc.pid, signal.SIGKILL)
        await standin_wait(lambda: _exited(ops[0]), 10, what="op-a to die")
        metrics_port = _free_port()
        ops.append(Operator(tmp_path, kubeconfig, admin_url, "op-b", metrics_port=metrics_port))

        async def b_leads() -> bool:
            lease = await kube.get(LEASES, NS, "fleet-operator")
            return lease["spec"].get("holderIdentity") == "op-b"

        await standin_wait(b_leads, 60, what="op-b to take the Lease", explain=why)
        await standin_wait(lambda: _logged(ops[1], "running 1 deployment(s); 3 running replica(s) adopted"), 30,
                           what="op-b to adopt the 3 replicas", explain=why)
        await standin_wait(lambda: served(3), 30, what="3 replicas still served under op-b", explain=why)
        assert {n: p["metadata"]["uid"] for n, p in (await pods()).items()} == before   # no pod replaced
        assert kubelet.started == started                                                # no process restarted

        # its /metrics carries the controller's series as `fleet up`'s does (the chart's dashboard reads them)
        from prometheus_client.parser import text_string_to_metric_families

        text = (await http.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
        samples = [(s.name, s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples]
        ready = sum(v for n, labels, v in samples if n == "fleet_replicas" and labels["state"] == "READY"
                    and labels["deployment"] == "sim-chat")  # fmt: skip
        assert ready == 3, text
        assert ("fleet_deployment_info", {"deployment": "sim-chat", "model": "llama-8b-sim"}, 1.0) in samples
        assert ("fleet_operator_leader", {}, 1.0) in samples

        # delete: drained through the router, pods go, the resource goes, the pool goes
        await kube.delete(INFERENCE_DEPLOYMENTS, NS, "sim-chat")

        async def all_gone() -> bool:
            try:
                await kube.get(INFERENCE_DEPLOYMENTS, NS, "sim-chat")
                return False
            except NotFound:
                pass
            models = (await http.get(f"http://127.0.0.1:{port}/v1/models")).json()["data"]
            return not await pods() and not models

        await standin_wait(all_gone, 60, what="the resource, its pods and its pool to go", explain=why)
        assert all(p.returncode is not None for p in kubelet.procs.values())
        ops[1].proc.send_signal(signal.SIGTERM)   # an orderly stop: exits 0, gives the Lease up
        await standin_wait(lambda: _exited(ops[1]), 30, what="op-b to exit on SIGTERM", explain=why)
        assert ops[1].proc.returncode == 0, ops[1].log()
        assert (await kube.get(LEASES, NS, "fleet-operator"))["spec"]["holderIdentity"] == ""
        for o in ops:
            assert "Traceback" not in o.log_path.read_text(), o.log()
    finally:
        for o in ops:
            if o.proc.poll() is None:
                os.killpg(o.proc.pid, signal.SIGKILL)
                o.proc.wait()
        await http.aclose()
        router_stop.set()
        await asyncio.wait_for(router, 20)
        await kubelet.stop()
        kube.close()
        await api.stop()


async def _ok(http: httpx.AsyncClient, url: str) -> bool:
    try:
        return (await http.get(url)).status_code == 200
    except httpx.TransportError:
        return False


async def _status_with(status, ready: int):
    st = await status()
    return st if st.get("readyReplicas") == ready and st.get("desiredReplicas") == ready else None


async def _exited(op: Operator) -> bool:
    return op.proc.poll() is not None


async def _logged(op: Operator, text: str) -> bool:
    return text in op.log()
