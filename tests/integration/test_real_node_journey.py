"""Integration: Fleet's own pods as containers of its image on a REAL node
(fleet/testing/k8s/realnode.py: Kubernetes 1.20.2's kubelet over containerd 1.6 and runc, the CNI
bridge, kube-proxy) joined to the real control plane (fleet/testing/k8s/kube.py).

The journey, each step timed (printed as ``[  12.3 s] step``; run with ``-s``): Fleet's image
(fleet/testing/k8s/images.py, from its cache or built) imported into the node's containerd under
the chart's name -> ``helm install`` of charts/fleet (the real helm) for one CPU node: the
operator, two router pods and the node agent as containers of that image -> the agent publishes
its facts on the Node, its ``pod-devices`` container having read the REAL kubelet's PodResources
socket -> a simulated engine deployment (``sim://``) Ready, OpenAI completions answered through
the router's Service (its ClusterIP, through kube-proxy, from the host) -> ``kill -9`` of a router
container under load: the kubelet restarts it (restartCount 1), no request lost that had not
reached the killed router; ``kill -9`` of the engine container: the operator replaces its pod
(``restartPolicy: Never``) -> delete, ``helm uninstall``: every pod deleted, no
container running, the node stopped clean.

The pods reach the API server through its ``kubernetes`` Service: `ApiServerRoute`
(fleet/testing/k8s/apiroute.py) says why that needs a relay here. Skips, saying why, when the
control plane, the node, the image or helm cannot be had here. One control plane and one node for
the module; the tests run in order, each on the state the one before left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fleet.agent.pod_devices import list_pod_devices
from fleet.k8s.client import INFERENCE_DEPLOYMENTS, NODES, PODS, KubeClient, NotFound, Resource
from fleet.testing.fake_nvml import inject_xid, nvlink_pairs_4gpu, write_state
from fleet.testing.k8s.apiroute import ApiServerRoute
from fleet.testing.k8s.buildcache import Unavailable
from fleet.testing.k8s.deviceplugin_grpc import NodeDevicePlugins, serve_device_plugins
from fleet.testing.k8s.images import FLEET_TAG, built, fleet_image
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.realnode import RealNode
from fleet.testing.k8s.realnode_images import PAUSE_IMAGE
from tests.support.helm import CHART, helm_binary
from tests.support.journey import Load
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.real_kube import real_node
from tests.support.waits import async_wait_until, wait_until

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)

NODE = "real-1"
NS = "fleet"
MODEL = "tiny-sim"
GPU_MODEL = "gpu-sim"
SNAPSHOT = nvlink_pairs_4gpu()   # four H100s, NVLink pairs 0-1 and 2-3
GFD_LABELS = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
              "nvidia.com/gpu.count": "4", "nvidia.com/gpu.memory": "81559", "nvidia.com/mig.strategy": "none"}
"""What NVIDIA GPU Feature Discovery labels the node with (not run here: the test puts them)."""
SERVICES = Resource("", "v1", "services", "Service")
GPU_HEALTH = "fleet.inference.dev/gpu-health"
STEPS: list[tuple[str, float]] = []


def mark(what: str, since: float) -> None:
    """Print and keep one step's seconds (from ``since``, a `time.monotonic` reading)."""
    STEPS.append((what, time.monotonic() - since))
    print(f"[{time.monotonic() - since:6.1f} s] {what}", flush=True)


@pytest.fixture(scope="module")
def plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(NODE,))


@pytest.fixture(scope="module")
def kube(plane: RealControlPlane) -> Iterator[KubeClient]:
    client = plane.client()
    yield client
    client.close()


@pytest.fixture(scope="module")
def image():
    """Fleet's image for this tree's inputs (built here when the cache lacks it)."""
    if os.environ.get("FLEET_IMAGE") == "skip":
        pytest.skip("FLEET_IMAGE=skip: Fleet's image is switched off")
    if (said := os.environ.get("FLEET_IMAGE_UNAVAILABLE")) and built() is None:
        pytest.skip(f"no Fleet image here (tests/run.sh's build step: {said})")
    try:
        return fleet_image()
    except Unavailable as err:
        pytest.skip(f"no Fleet image here: {err}")


@pytest.fixture(scope="module")
def helm() -> str:
    binary = helm_binary()
    if not binary:
        pytest.skip("helm not found: run `bash .ci/helm.sh` (tests/run.sh does)")
    return binary


@pytest.fixture(scope="module")
def nvml_state(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The node's fake NVML state file, in a directory the agent's user (uid 10001) may read."""
    directory = tmp_path_factory.mktemp("nvml")
    directory.chmod(0o755)
    return write_state(directory / "state.json", SNAPSHOT)


@pytest.fixture(scope="module")
def node(plane: RealControlPlane, kube: KubeClient, image, helm, nvml_state: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealNode]:  # fmt: skip
    with real_node(plane, NODE, tmp_path_factory.mktemp("node"), nvml_state=nvml_state) as real, \
            ApiServerRoute(plane.url, real.node_ip, kube):
        kube.request("PATCH", NODES.path(None, NODE), body={"metadata": {"labels": GFD_LABELS}},
                     content_type="application/merge-patch+json")  # fmt: skip
        print(f"\nreal node up: {real.timings_s}", flush=True)
        yield real


@pytest.fixture(scope="module", autouse=True)
def plugins(node: RealNode, nvml_state: Path) -> Iterator[NodeDevicePlugins]:
    """The node's device plugin (``nvidia.com/gpu`` from the state file), registered with its
    kubelet once the node is up; stopped before the node (`test_delete_and_uninstall_leave_nothing`)."""
    served = serve_device_plugins(nvml_state, node.device_plugin_dir, node=NODE)
    yield served
    served.stop()


def _values(node: RealNode) -> dict:
    """The chart's values for one 2-core CPU node (the requests fit its 2 CPUs with a 1-core
    engine), the agent on it with its cache and the kubelet's PodResources socket where this
    node keeps them, every image the imported one (``Never`` pulled: no registry here)."""
    small = {"requests": {"cpu": "50m", "memory": "128Mi"}, "limits": {"memory": "1Gi"}}
    return {
        "image": {"pullPolicy": "Never"},
        "operator": {"tickSeconds": 0.5, "resources": small},
        "router": {"replicas": 2, "resources": small},
        "agent": {"nodeSelector": None, "tolerations": [{"operator": "Exists"}],
                  "hostCachePath": str(node.workdir / "fleet-cache"),
                  "podResourcesSocket": str(node.pod_resources_socket), "podDevicesIntervalSeconds": 2},
        "engine": {"defaultImage": FLEET_TAG, "prePull": {"enabled": False}, "shmSize": "",
                   "terminationGracePeriodSeconds": 5},
    }  # fmt: skip


def _helm(helm: str, plane: RealControlPlane, *args: str) -> str:
    done = subprocess.run([helm, *args, "--kubeconfig", str(plane.kubeconfig())], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0, f"helm {' '.join(args[:2])} failed: {done.stderr.strip()}"
    return done.stdout


def _pods(kube: KubeClient, selector: str | None = None) -> list[dict]:
    query = [("labelSelector", selector)] if selector else None
    return kube.request("GET", PODS.path(NS), query=query)["items"]


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])  # fmt: skip


def _status(pod: dict, container: str) -> dict:
    return next(c for c in pod["status"]["containerStatuses"] if c["name"] == container)


def _why(kube: KubeClient, node: RealNode) -> str:
    """For a failure message: each pod's containers and states, the pods' log tails, the node's."""
    lines = []
    for p in _pods(kube):
        statuses = (p.get("status") or {}).get("containerStatuses") or []
        cs = [(c["name"], c["state"], c.get("restartCount")) for c in statuses]
        lines.append(f"{p['metadata']['name']}: {(p.get('status') or {}).get('phase')} {cs}")
    for log in sorted((node.workdir / "host" / "var/log/pods").glob(f"{NS}_*/*/*.log")):
        lines.append(f"--- {log.parent.parent.name}/{log.parent.name}\n{log.read_text(errors='replace')[-1500:]}")
    return "\n".join(lines) + "\n" + node.explain(800)


def _cluster_ip(kube: KubeClient) -> str:
    return kube.request("GET", SERVICES.path(NS, "fleet-router"))["spec"]["clusterIP"]


def _complete(url: str, model: str = MODEL) -> dict:
    req = urllib.request.Request(f"{url}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
                                 data=json.dumps({"model": model, "prompt": "hello", "max_tokens": 2}).encode())
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_fleet_image_imported_into_the_node(node, image):
    """Fleet's image (its OCI archive from fleet/testing/k8s/images.py's cache) imported into the
    node's containerd under the chart's name, beside the pause image containerd sandboxes with."""
    since = time.monotonic()
    assert FLEET_TAG in node.import_image(image.oci_archive)
    listed = node.ctr("images", "ls", "-q")
    assert FLEET_TAG in listed and PAUSE_IMAGE in listed, listed
    mark(f"Fleet's image imported ({image.info.get('compressed_bytes', 0) / 1e6:.0f} MB compressed)", since)


def test_helm_install_runs_operator_routers_and_agent_on_the_node(node, kube, plane, helm, tmp_path_factory):
    """The real helm installs the chart; the scheduler binds the operator, two router pods, the
    endpoint picker and the agent to the real node; containerd and runc run them from Fleet's image, the kubelet's
    probes pass and every pod is Ready. A router's process, as the chart's securityContext says:
    uid 10001, no capability, the runtime's seccomp filter, a read-only root file system."""
    since = time.monotonic()
    values = tmp_path_factory.mktemp("values") / "values.yaml"
    values.write_text(yaml.safe_dump(_values(node)))
    _helm(helm, plane, "install", "fleet", str(CHART), "-n", NS, "--create-namespace", "-f", str(values))
    mark("helm install", since)

    def all_ready() -> bool:
        pods = _pods(kube)
        components = sorted(p["metadata"]["labels"].get("app.kubernetes.io/component", "") for p in pods if _ready(p))
        return components == ["agent", "operator", "picker", "router", "router"]

    wait_until(all_ready, timeout_s=150, interval_s=0.5, what="the operator, 2 routers, the picker and the agent Ready",
               explain=lambda: _why(kube, node))  # fmt: skip
    for p in _pods(kube):
        assert p["spec"]["nodeName"] == NODE
        assert all(c["image"].endswith(FLEET_TAG) for c in p["status"]["containerStatuses"]), p["status"]
    router = _pods(kube, "app.kubernetes.io/component=router")[0]
    pid = node.task_pid(_status(router, "router")["containerID"])
    proc = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":\t" in line)
    # the image's user, no capability, the runtime's seccomp filter, a read-only root file system
    assert (proc["Uid"].split()[0], int(proc["CapEff"], 16), proc["Seccomp"].strip()) == ("10001", 0, "2"), proc
    root_mount = next(line.split() for line in Path(f"/proc/{pid}/mounts").read_text().splitlines()
                      if line.split()[1] == "/")  # fmt: skip
    assert "ro" in root_mount[3].split(","), root_mount
    mark("operator, 2 router pods, the picker and the agent Ready on the real node", since)


def _published(kube: KubeClient) -> dict | None:
    """The agent's ``fleet.inference.dev/gpu-health`` annotation on the Node, decoded."""
    value = (kube.request("GET", NODES.path(None, NODE))["metadata"].get("annotations") or {}).get(GPU_HEALTH)
    return json.loads(value) if value else None


def test_agent_publishes_facts_read_from_the_real_kubelet(node, kube):
    """The agent (a container of the image, uid 10001) publishes its node facts on the Node, read
    through the fake NVML driver the runtime's stand-in mounted (the image carries nothing of
    fleet/testing): health checks on, the NVLink pairs as Fleet's label; its ``pod-devices``
    container (root, no capability) asked the REAL kubelet's PodResources socket and relayed a
    fresh answer (no reason, not stale) to the agent's file."""
    since = time.monotonic()

    def published() -> dict | None:
        facts = _published(kube)
        return facts if facts and facts["healthChecks"] else None

    facts = wait_until(published, timeout_s=60, interval_s=0.5, what=f"the agent's {GPU_HEALTH} on the Node",
                       explain=lambda: f"{_published(kube)}\n{_why(kube, node)}")  # fmt: skip
    assert facts["allocations"] == {} and facts["quarantined"] == [], facts
    labels = kube.request("GET", NODES.path(None, NODE))["metadata"]["labels"]
    assert labels.get("fleet.inference.dev/nvlink-domains") == "0-1_2-3", labels
    (agent,) = _pods(kube, "app.kubernetes.io/component=agent")
    cid = _status(agent, "pod-devices")["containerID"].removeprefix("containerd://")

    def relayed() -> dict | None:
        """The relay file in the container's memory-backed emptyDir, seen through its process's
        root (the mount lives in the node's mount namespace only)."""
        pid = node.task_pid(cid)
        doc = json.loads(Path(f"/proc/{pid}/root/run/fleet/pod-devices/pod-devices.json").read_text())
        return doc if doc["reason"] is None and not doc["stale"] else None

    doc = wait_until(relayed, timeout_s=30, interval_s=1, ignoring=(OSError, KeyError, ValueError),
                     what="a fresh PodResources answer relayed by the pod-devices container",
                     explain=lambda: _why(kube, node))  # fmt: skip
    assert doc["pods"] == [] and time.time() - doc["askedS"] < 30, doc
    mark("agent facts on the Node from the fake NVML; PodResources read from the real kubelet", since)


def test_a_sim_deployment_is_served_through_the_router_service(node, kube):
    """A simulated engine (``sim://``, one CPU core) placed by the operator, run from the image,
    Ready; completions through the router's ClusterIP (kube-proxy) from the host are answered."""
    since = time.monotonic()
    kube.request("POST", INFERENCE_DEPLOYMENTS.path(NS), body={
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": MODEL},
        "spec": {"model": {"name": MODEL, "source": "sim://cpu-tiny-llama"},
                 "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 120},
                 "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 1},
                 "warmup": {"requests": [{"kind": "completion", "prompt": "Hello", "maxTokens": 2}]}}})  # fmt: skip
    url = f"http://{_cluster_ip(kube)}"
    answer = wait_until(lambda: _complete(url), timeout_s=150, interval_s=1, ignoring=(OSError,),
                        what=f"a completion of {MODEL} through the router Service {url}",
                        explain=lambda: _why(kube, node))  # fmt: skip
    assert answer["choices"][0]["text"], answer
    # The router may route to the engine once its warm-up passed, a probe period before the
    # kubelet marks the pod Ready.
    (engine,) = wait_until(lambda: [p for p in _pods(kube, f"fleet.inference.dev/deployment={MODEL}") if _ready(p)],
                           timeout_s=30, interval_s=0.5, what="the engine pod Ready", explain=lambda: _why(kube, node))
    assert engine["spec"]["nodeName"] == NODE
    mark("sim deployment Ready, completions answered through the router Service", since)


def _kill9(node: RealNode, kube: KubeClient, pod: dict, container: str) -> None:
    os.kill(node.task_pid(_status(pod, container)["containerID"]), signal.SIGKILL)

    def restarted() -> bool:
        now = kube.request("GET", PODS.path(NS, pod["metadata"]["name"]))
        return _ready(now) and _status(now, container).get("restartCount") == 1

    wait_until(restarted, timeout_s=90, interval_s=0.5, what=f"{pod['metadata']['name']}/{container} restarted",
               explain=lambda: _why(kube, node))  # fmt: skip
    now = kube.request("GET", PODS.path(NS, pod["metadata"]["name"]))
    assert _status(now, container)["lastState"]["terminated"]["exitCode"] == 137


def test_kill_9_under_load_is_restarted_and_loses_nothing_unstarted(node, kube):
    """``kill -9`` of a router container while completions flow through the Service: the kubelet
    restarts it (restartCount 1, exit 137) and no request fails but those in flight inside the
    killed process (a reset connection: counted apart). Then ``kill -9`` of the engine
    container: an engine pod is ``restartPolicy: Never`` (fleet/k8s/pods.py: replacing a failed
    replica is the operator's), so the operator replaces the pod and completions are answered by
    the new one; what failed in the outage of the only replica is counted and printed."""
    since = time.monotonic()
    url = f"http://{_cluster_ip(kube)}"

    async def run() -> tuple[Load, Load]:
        load = Load(lambda: [url], MODEL)
        load.start()
        await async_wait_until(lambda: load.ok >= 10, 60, interval_s=0.2, what="traffic through the Service")
        load.killed_router = url   # a reset connection now: in flight inside the killed router
        router = _pods(kube, "app.kubernetes.io/component=router")[0]
        await asyncio.to_thread(_kill9, node, kube, router, "router")
        load.killed_router = None
        ok_before = load.ok
        await async_wait_until(lambda: load.ok >= ok_before + 10, 60, interval_s=0.2, what="traffic after the kill")
        await load.stop()
        mark(f"router killed and restarted: {load.ok} ok, {len(load.lost_in_killed_router)} lost in it, "
             f"{load.refused} refused and retried", since)
        outage = Load(lambda: [url], MODEL)
        outage.start()
        await async_wait_until(lambda: outage.ok >= 5, 60, interval_s=0.2, what="traffic before the engine's kill")
        (engine,) = _pods(kube, f"fleet.inference.dev/deployment={MODEL}")
        container = engine["spec"]["containers"][0]["name"]
        os.kill(node.task_pid(_status(engine, container)["containerID"]), signal.SIGKILL)

        def replaced() -> bool:
            return [p["metadata"]["uid"] != engine["metadata"]["uid"] and _ready(p)
                    for p in _pods(kube, f"fleet.inference.dev/deployment={MODEL}")] == [True]  # fmt: skip

        await async_wait_until(lambda: asyncio.to_thread(replaced), 120, interval_s=0.5,
                               what="the killed engine's replica replaced by a Ready pod")  # fmt: skip
        ok_before = outage.ok
        await async_wait_until(lambda: outage.ok >= ok_before + 10, 60, interval_s=0.2,
                               what="completions answered by the new engine pod")  # fmt: skip
        await outage.stop()
        return load, outage

    load, outage = asyncio.run(run())
    assert not load.failed_before_streaming, load.failed_before_streaming[:10]
    assert load.ok >= 20
    failed = outage.failed_before_streaming + outage.lost_in_killed_router
    print(f"engine kill: {outage.ok} ok, {len(failed)} failed while its only replica restarted: "
          f"{sorted({f.split(': ', 1)[1][:60] for f in failed})}", flush=True)
    mark("engine killed, its replica replaced by the operator, served again", since)


def _gpu_engine(kube: KubeClient) -> dict | None:
    """The GPU deployment's one live, Ready engine pod, if that is what there is."""
    live = [p for p in _pods(kube, f"fleet.inference.dev/deployment={GPU_MODEL}")
            if not p["metadata"].get("deletionTimestamp")]  # fmt: skip
    return live[0] if len(live) == 1 and _ready(live[0]) else None


def _index(uuid: str) -> int:
    return next(d["index"] for d in SNAPSHOT["devices"] if d["uuid"] == uuid)


def test_the_agent_maps_a_gpu_pod_read_through_the_real_podresources(node, kube):
    """A GPU deployment (one whole H100): the operator places it, the real kubelet admits its pod
    against ``nvidia.com/gpu`` and the device plugin allocates one GPU; the kubelet's
    PodResources API names that GPU for the pod, and the agent publishes ``allocations`` with the
    pod's uid and that GPU's index, read through the real socket by its ``pod-devices``
    container. The engine container sees that GPU only, through the injected driver."""
    since = time.monotonic()
    kube.request("POST", INFERENCE_DEPLOYMENTS.path(NS), body={
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": GPU_MODEL},
        "spec": {"model": {"name": GPU_MODEL, "source": "sim://h100-llama-8b"},
                 "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 120},
                 "resources": {"gpuProduct": "NVIDIA H100 80GB HBM3"}, "replicas": {"min": 1, "max": 1},
                 "warmup": {"requests": [{"kind": "completion", "prompt": "Hello", "maxTokens": 2}]}}})  # fmt: skip
    engine = wait_until(lambda: _gpu_engine(kube), timeout_s=150, interval_s=0.5, what=f"the {GPU_MODEL} pod Ready",
                        explain=lambda: _why(kube, node))  # fmt: skip
    assert engine["spec"]["containers"][0]["resources"]["requests"]["nvidia.com/gpu"] == "1", engine["spec"]
    (gpu,) = list_pod_devices(node.pod_resources_socket)[(NS, engine["metadata"]["name"])]
    uid = engine["metadata"]["uid"]

    def mapped() -> dict | None:
        facts = _published(kube)
        return facts if facts and facts["allocations"].get(uid) == [_index(gpu)] else None

    facts = wait_until(mapped, timeout_s=60, interval_s=0.5, what=f"the agent's allocations naming {uid} on {gpu}",
                       explain=lambda: f"{_published(kube)}\n{_why(kube, node)}")  # fmt: skip
    assert list(facts["allocations"]) == [uid], facts
    environ = Path(f"/proc/{node.task_pid(_status(engine, engine['spec']['containers'][0]['name'])['containerID'])}"
                   "/environ").read_bytes().split(b"\0")  # fmt: skip
    assert f"NVIDIA_VISIBLE_DEVICES={gpu}".encode() in environ, environ
    answer = _complete(f"http://{_cluster_ip(kube)}", GPU_MODEL)
    assert answer["choices"][0]["text"], answer
    mark(f"GPU replica on {gpu}: the agent's allocations name its pod, read from the real PodResources", since)


def test_an_xid_quarantines_the_gpu_and_its_replica_moves(node, kube, nvml_state):
    """Xid 79 on the replica's GPU (appended to the state file): the device plugin reports the
    GPU unhealthy to the kubelet, the agent quarantines it and names the pod on it (its uid,
    from the real PodResources), the operator drains the replica and places a new one on another
    GPU, which serves."""
    since = time.monotonic()
    victim = _gpu_engine(kube)
    assert victim is not None
    (bad,) = list_pod_devices(node.pod_resources_socket)[(NS, victim["metadata"]["name"])]
    inject_xid(nvml_state, bad, 79)

    def quarantined() -> list[str] | None:
        hits = [q for q in (_published(kube) or {}).get("quarantined", []) if q["index"] == _index(bad)]
        return hits[0]["pods"] if hits else None

    named = wait_until(quarantined, timeout_s=60, interval_s=0.5, what=f"GPU {_index(bad)} quarantined",
                       explain=lambda: f"{_published(kube)}\n{_why(kube, node)}")  # fmt: skip
    assert named == [victim["metadata"]["uid"]], named
    mark(f"Xid 79 on {bad}: quarantined, its pod named", since)

    def replaced() -> dict | None:
        pod = _gpu_engine(kube)
        if pod is None or pod["metadata"]["uid"] == victim["metadata"]["uid"]:
            return None
        held = list_pod_devices(node.pod_resources_socket).get((NS, pod["metadata"]["name"]), ())
        return pod if held and bad not in held else None

    wait_until(replaced, timeout_s=180, interval_s=0.5, what=f"{GPU_MODEL} drained and replaced off {bad}",
               explain=lambda: _why(kube, node))  # fmt: skip
    answer = wait_until(lambda: _complete(f"http://{_cluster_ip(kube)}", GPU_MODEL), timeout_s=60, interval_s=1,
                        ignoring=(OSError,), what=f"{GPU_MODEL} served by its new replica")  # fmt: skip
    assert answer["choices"][0]["text"], answer
    mark("the replica on the quarantined GPU drained and replaced on another GPU, served", since)


def test_delete_and_uninstall_leave_nothing(node, kube, plane, helm, plugins):
    """The deployments deleted, ``helm uninstall``: every pod of the namespace deleted with no
    finalizer holding it and no container running in the node's containerd (kubelet 1.20 removes
    a deleted pod's object only after its container garbage collection, once a minute, has removed
    the pod's sandbox: the kubelet's pace, not Fleet's, so the test does not wait for it); then
    the node stops and nothing of it is left on the machine."""
    since = time.monotonic()
    for name in (MODEL, GPU_MODEL):
        with contextlib.suppress(NotFound):   # a run of some tests only (-k) made neither
            kube.request("DELETE", INFERENCE_DEPLOYMENTS.path(NS, name))
    wait_until(lambda: not _pods(kube, "fleet.inference.dev/deployment"), timeout_s=90, interval_s=0.5,
               what="the engine pods gone", explain=lambda: _why(kube, node))  # fmt: skip
    mark("deployments deleted: their engine pods gone", since)
    _helm(helm, plane, "uninstall", "fleet", "-n", NS)

    def all_going() -> bool:   # deleted, and nothing but the kubelet's own collection keeps them
        return all(p["metadata"].get("deletionTimestamp") and not p["metadata"].get("finalizers")
                   for p in _pods(kube))  # fmt: skip

    wait_until(all_going, timeout_s=60, interval_s=0.5, what="every pod deleted after uninstall, no finalizer",
               explain=lambda: _why(kube, node))  # fmt: skip
    wait_until(lambda: "RUNNING" not in node.ctr("tasks", "ls"), timeout_s=60, interval_s=0.5,
               what="no task running in containerd", explain=lambda: node.ctr("tasks", "ls"))  # fmt: skip
    for name in (MODEL, GPU_MODEL):
        with pytest.raises(NotFound):
            kube.request("GET", INFERENCE_DEPLOYMENTS.path(NS, name))
    mark("deleted and uninstalled: every pod deleted, no container running", since)
    plugins.stop()
    node.__exit__(None, None, None)
    assert node.leftovers() == []
    mark(f"node stopped: nothing left on the machine (seconds to stop: {node.stop_timings_s})", since)
    print("\n".join(f"{what}: {s:.1f} s" for what, s in STEPS), flush=True)
