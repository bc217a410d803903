"""Integration: a REAL node (fleet/testing/k8s/realnode.py) joined to the real Kubernetes 1.20.2
control plane (fleet/testing/k8s/kube.py): Kubernetes' own ``kubelet`` over containerd 1.6 and
runc 1.1, pods networked by the CNI bridge plugin, Services by ``kube-proxy`` (iptables).

Real here: everything in a pod's path. The scheduler binds the pod, the kubelet admits and starts
it through the CRI, containerd unpacks its image and runc runs it in its cgroups and namespaces,
the bridge plugin gives it an address, the kubelet probes it, restarts it, and serves its log to
the API server; the endpoints controller and kube-proxy make its Service answer. Stand-ins: the
images (built here: a static pause and Debian's static busybox, `node_images`; no registry is
reachable, so they are imported).

Skips, saying why, when the control plane or the node cannot run here (not root, no apt, a cgroup
controller missing: `Unavailable`). One control plane and one node for the module; the last test
stops the node and checks it left nothing on the machine.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.k8s.client import NODES, PODS, KubeClient, NotFound, Resource
from fleet.testing.k8s.buildcache import free_port
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.realnode import POD_CIDR, RealNode
from fleet.testing.k8s.realnode_images import BUSYBOX_IMAGE, node_images
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.real_kube import real_node
from tests.support.waits import wait_until

# The first test may build the control plane (minutes) when tests/run.sh has not.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 600)

NODE = "real-1"
NS = "default"
SERVICES = Resource("", "v1", "services", "Service")
WEB = "web"
HOST_PORT = free_port()   # the web pod's hostPort (the portmap plugin), free on this machine now
DEFAULT_CAPABILITIES = 0xA80425FB
"""containerd's default set (pkg/cap ``DefaultCapabilities``, Docker's): CHOWN, DAC_OVERRIDE, FSETID,
FOWNER, MKNOD, NET_RAW, SETGID, SETUID, SETFCAP, SETPCAP, NET_BIND_SERVICE, SYS_CHROOT, KILL,
AUDIT_WRITE."""


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(NODE,))


@pytest.fixture(scope="module")
def node(plane: RealControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:
    with real_node(plane, NODE, tmp_path_factory.mktemp("node")) as real:
        print(f"\nreal node up: {real.timings_s} (snapshotter {real.snapshotter}) {real.overlayfs_refused}")
        yield real


@pytest.fixture(scope="module")
def kube(plane: RealControlPlane) -> Iterator[KubeClient]:
    client = plane.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def web(node: RealNode, kube: KubeClient) -> dict:
    """A busybox ``httpd`` pod (the image imported through `RealNode.import_image`) with an
    httpGet readiness probe, placed by the scheduler, Ready; its pod object."""
    assert BUSYBOX_IMAGE in node.import_image(node_images()["busybox"])
    kube.request("POST", PODS.path(NS), body=_pod(WEB, labels={"app": WEB}, command=(
        "mkdir -p /www && echo hello from $(hostname) > /www/index.html && echo serving on 8080 && "
        "exec httpd -f -v -p 8080 -h /www"), probe=True, host_port=HOST_PORT))  # fmt: skip
    return wait_until(lambda: _ready(kube, WEB), timeout_s=120, interval_s=0.5, what="the web pod Ready",
                      explain=node.explain)  # fmt: skip


def _pod(name: str, *, command: str, labels: dict | None = None, probe: bool = False, host_port: int = 0,
         restart: str = "Always") -> dict:  # fmt: skip
    container = {"name": name, "image": BUSYBOX_IMAGE, "imagePullPolicy": "Never",
                 "command": ["/bin/sh", "-c", command],
                 "resources": {"requests": {"cpu": "50m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}}}  # fmt: skip
    if probe:
        container["ports"] = [{"containerPort": 8080, "hostPort": host_port} if host_port else {"containerPort": 8080}]
        container["readinessProbe"] = {"httpGet": {"path": "/", "port": 8080}, "periodSeconds": 1}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}},
            "spec": {"containers": [container], "restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                     "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}}


def _ready(kube: KubeClient, name: str) -> dict | None:
    pod = kube.request("GET", PODS.path(NS, name))
    conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions", [])}
    return pod if conditions.get("Ready") == "True" else None


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=3) as resp:
        return resp.read().decode()


def test_node_registers_and_is_ready_through_the_real_kubelet(node, kube):
    """Real: the kubelet registers its Node as ``system:node:NAME`` (Node authorization,
    NodeRestriction), reports containerd as its runtime and its address, and goes Ready once the
    CRI and the CNI network are ready."""
    obj = kube.request("GET", NODES.path(None, NODE))
    info = obj["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.20.2" and info["containerRuntimeVersion"].startswith("containerd://1.6"), info
    assert {"type": "InternalIP", "address": node.node_ip} in obj["status"]["addresses"]
    assert any(c["type"] == "Ready" and c["status"] == "True" for c in obj["status"]["conditions"])
    assert int(obj["status"]["allocatable"]["pods"]) > 0 and obj["metadata"]["labels"]["fleet.test/real-node"] == "true"


def test_a_pod_is_scheduled_started_networked_and_probed(node, kube, web):
    """Real: the scheduler binds the pod to the node, containerd and runc start it from the
    imported image, in its memory cgroup with the pod's limit, with the runtime's default
    capabilities and seccomp filter; the bridge plugin gives it an address in the pod CIDR, the
    kubelet's httpGet probe passes, and the test reaches ``httpd`` at the pod's IP and at the
    node's address on the pod's hostPort (the portmap plugin)."""
    assert web["spec"]["nodeName"] == NODE
    assert ipaddress.ip_address(web["status"]["podIP"]) in ipaddress.ip_network(POD_CIDR)
    status = web["status"]["containerStatuses"][0]
    assert status["containerID"].startswith("containerd://") and status["ready"], status
    pid = node.task_pid(status["containerID"])
    cid = status["containerID"].removeprefix("containerd://")
    [memory] = node.cgroup_dir("memory").rglob(cid)
    assert int((memory / "memory.limit_in_bytes").read_text()) == 64 * 2**20
    proc = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    assert (int(proc["CapEff"], 16), proc["Seccomp"].strip()) == (DEFAULT_CAPABILITIES, "2"), proc
    assert _get(f"http://{web['status']['podIP']}:8080/").strip() == f"hello from {WEB}"
    assert _get(f"http://{node.node_ip}:{HOST_PORT}/").strip() == f"hello from {WEB}"


def test_a_service_answers_through_kube_proxy_from_the_host_and_a_pod(node, kube, web):
    """Real: the endpoints controller puts the Ready pod behind the Service, kube-proxy programs
    its ClusterIP; the ClusterIP answers the host and a second pod on the node (bridge netfilter,
    forwarding)."""
    svc = kube.request("POST", SERVICES.path(NS), body={
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": WEB},
        "spec": {"selector": {"app": WEB}, "ports": [{"port": 80, "targetPort": 8080}]}})  # fmt: skip
    cluster_ip = svc["spec"]["clusterIP"]
    answer = wait_until(lambda: _get(f"http://{cluster_ip}/"), timeout_s=60, interval_s=0.5, ignoring=(OSError,),
                        what=f"the Service's ClusterIP {cluster_ip} to answer", explain=node.explain)  # fmt: skip
    assert answer.strip() == f"hello from {WEB}"
    # busybox's nc, not its wget: Debian's static busybox wget segfaults in a bare image (glibc's
    # static service lookup); a GET by hand, retried up to 10 times inside the pod.
    get = f"printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {cluster_ip} 80 | grep 'hello from'"
    kube.request("POST", PODS.path(NS), body=_pod("client", restart="Never", command=(
        f"for i in 1 2 3 4 5 6 7 8 9 10; do {get} && exit 0; sleep 1; done; exit 1")))

    def finished() -> str | None:
        phase = kube.request("GET", PODS.path(NS, "client"))["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    phase = wait_until(finished, timeout_s=90, interval_s=0.5, what="the client pod to finish", explain=node.explain)
    log = asyncio.run(kube.read_log(NS, "client"))
    assert phase == "Succeeded" and f"hello from {WEB}" in log, (phase, log)


def test_kubectl_logs_reaches_the_kubelet(node, kube, web):
    """Real: the API server reaches the kubelet at the Node's InternalIP with its client
    certificate; the kubelet (``--anonymous-auth=false``, Webhook authorization) serves the log
    containerd wrote."""
    assert "serving on 8080" in asyncio.run(kube.read_log(NS, WEB))
    port = kube.request("GET", NODES.path(None, NODE))["status"]["daemonEndpoints"]["kubeletEndpoint"]["Port"]
    with pytest.raises(urllib.error.HTTPError) as refused:   # no client certificate: the kubelet is closed
        urllib.request.urlopen(f"https://{node.node_ip}:{port}/pods", timeout=3,
                               context=ssl._create_unverified_context())  # fmt: skip
    assert refused.value.code == 401


def test_kill_9_of_the_container_is_restarted_by_the_kubelet(node, kube, web):
    """Real: ``kill -9`` of the container's process (found through containerd's task); the
    kubelet sees it exit, restarts it (restartCount 1) and it is Ready and serving again."""
    pid = node.task_pid(web["status"]["containerStatuses"][0]["containerID"])
    os.kill(pid, signal.SIGKILL)

    def restarted() -> dict | None:
        pod = _ready(kube, WEB)
        return pod if pod and pod["status"]["containerStatuses"][0]["restartCount"] == 1 else None

    pod = wait_until(restarted, timeout_s=90, interval_s=0.5, what="the web container restarted and Ready",
                     explain=node.explain)  # fmt: skip
    assert pod["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] == 137
    assert _get(f"http://{pod['status']['podIP']}:8080/").strip() == f"hello from {WEB}"


def test_delete_stops_the_containers(node, kube, web):
    """Real: deleting the pods and the Service: the kubelet stops the containers (no task left in
    containerd), then the pods are gone from the API server."""
    kube.request("DELETE", SERVICES.path(NS, WEB))
    for name in (WEB, "client"):
        kube.request("DELETE", PODS.path(NS, name))

    def gone(name: str) -> bool:
        try:
            kube.request("GET", PODS.path(NS, name))
        except NotFound:
            return True
        return False

    wait_until(lambda: gone(WEB) and gone("client"), timeout_s=90, interval_s=0.5, what="the pods gone",
               explain=node.explain)  # fmt: skip
    wait_until(lambda: "RUNNING" not in node.ctr("tasks", "ls"), timeout_s=30, interval_s=0.5,
               what="no task running in containerd", explain=lambda: node.ctr("tasks", "ls"))  # fmt: skip


def test_stopping_the_node_leaves_nothing(node):
    """The node's processes, cgroups, bridge, iptables chains, mounts, sysctls and directories
    are gone once it stops (this machine runs CI)."""
    node.__exit__(None, None, None)
    assert node.leftovers() == []
