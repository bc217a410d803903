"""The Kubernetes backend (fleet/k8s/backend.py, fleet/k8s/pods.py, fleet/k8s/pod_facts.py):
pods built from replicas (GPU and MIG requests, node binding, labels, owner references, probes), inventory from Node
objects and GFD labels, and the real `Controller` running replicas as pods on the in-repo fake
of the cluster wrapper (tests/support/fake_kube.py): start, warm, pool, scale down with a drain, a deleted
or evicted pod replaced, pods adopted by a new controller. The raw client is made to fail."""

from __future__ import annotations

import asyncio
from pathlib import Path

import kubernetes_validate
import pytest

from fleet.controller.backend import LaunchError, ReplicaWant
from fleet.controller.reconcile import Controller, ControllerSettings
from fleet.k8s.backend import KubernetesBackend, node_usable
from fleet.k8s.client import INFERENCE_DEPLOYMENTS, NODES, PODS
from fleet.k8s.pod_facts import pod_facts, pod_node
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import (ANNOTATION_NODE, ANNOTATION_PLACEMENT, LABEL_DEPLOYMENT, LABEL_REPLICA, LABEL_SPEC_HASH,
                            node_affinity, pod_manifest)
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.placement import ReplicaPlacement
from fleet.placement.shapes import Assignment
from fleet.spec import LoadedDeployment, parse_document
from tests.support.controller import ControllerHarness
from tests.support.fakes import FakeClock, FakePoolSink
from tests.support.fake_kube import FakeKube
from fleet.testing.k8s.kubelet import evict_pod, finish_deletions, image_pull_backoff, run_pod, terminate_pod
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.workloads import schedule

NS = "fleet"


def _dep(name="chat", **spec_over) -> LoadedDeployment:
    spec = {"model": {"name": f"{name}-model", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"},
            "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 2, "max": 4},
            "warmup": {"requests": [{"kind": "completion", "prompt": "hi", "maxTokens": 2}]}}
    for key, value in spec_over.items():
        spec[key] = value
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": name}, "spec": spec}
    return LoadedDeployment(parse_document(doc), Path("/deploy") / f"{name}.yaml", 0)


def _want(ld: LoadedDeployment, node_name="gpu-a", rid="chat-0", env=None) -> ReplicaWant:
    placement = ReplicaPlacement((Assignment(node_name, ("gpu-a/gpu0",), env or {}, "gpu:0"),))
    return ReplicaWant(rid, ld.deployment, placement, ld.serving_hash, ld.base_dir)


OWNER = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
         "metadata": {"name": "chat", "uid": "u-1"}}


# ----- pods --------------------------------------------------------------------------------------


def test_gpu_pod_requests_tp_gpus_on_the_placed_node():
    ld = _dep(model={"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
              engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0", "args": ["--max-model-len", "8192"]},
              resources={"accelerator": "gpu", "tensorParallelSize": 2})
    pod = pod_manifest(_want(ld, env={"CUDA_VISIBLE_DEVICES": "GPU-1,GPU-2"}), fleet_id="fleet", owner=OWNER,
                       settings=EnginePodSettings(shm_size="8Gi"))
    spec = pod["spec"]
    c = spec["containers"][0]
    assert "nodeName" not in spec and spec["restartPolicy"] == "Never"      # the scheduler binds it ...
    assert spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-a"]}]}]}
    assert pod["metadata"]["annotations"][ANNOTATION_NODE] == "gpu-a" and pod_node(pod) == "gpu-a"   # ... there
    assert c["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    assert c["command"][:3] == ["vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct"]
    assert c["command"][c["command"].index("--tensor-parallel-size") + 1] == "2"
    assert c["command"][-2:] == ["--max-model-len", "8192"]
    assert "CUDA_VISIBLE_DEVICES" not in {e["name"] for e in c["env"]}   # the device plugin assigns GPUs
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 900
    meta = pod["metadata"]
    assert meta["labels"][LABEL_DEPLOYMENT] == "chat" and meta["labels"][LABEL_REPLICA] == "chat-0"
    assert meta["labels"][LABEL_SPEC_HASH] == ld.serving_hash
    assert meta["labels"]["fleet.inference.dev/revision"] == "v1"
    assert meta["ownerReferences"] == [{**{k: OWNER[k] for k in ("apiVersion", "kind")}, "name": "chat",
                                        "uid": "u-1", "controller": True, "blockOwnerDeletion": True}]
    assert ReplicaPlacement.from_dict(__import__("json").loads(meta["annotations"][ANNOTATION_PLACEMENT])).nodes == (
        "gpu-a",)
    for version in ("1.30.0", "1.37.0"):
        kubernetes_validate.validate(pod, version, strict=True)


@pytest.mark.parametrize("strategy,key", [("mixed", "nvidia.com/mig-3g.40gb"), ("single", "nvidia.com/gpu")])
def test_mig_pod_requests_one_instance(strategy, key):
    ld = _dep(engine={"kind": "vllm", "image": "vllm/vllm-openai:v0.11.0"},
              model={"name": "q", "source": "/models/qwen"}, resources={"accelerator": "gpu", "migProfile": "3g.40gb"})
    pod = pod_manifest(_want(ld), fleet_id="f", owner=None, settings=EnginePodSettings(mig_strategy=strategy))
    c = pod["spec"]["containers"][0]
    assert c["resources"]["limits"] == {key: "1"}
    # a local path is mounted read-only from the node
    assert pod["spec"]["volumes"] == [{"name": "weights", "hostPath": {"path": "/models/qwen", "type": "Directory"}}]
    assert c["volumeMounts"] == [{"name": "weights", "mountPath": "/models/qwen", "readOnly": True}]
    kubernetes_validate.validate(pod, "1.37.0", strict=True)


def test_cpu_sim_pod_and_settings_pass_through():
    settings = EnginePodSettings.from_json(
        '{"runtimeClassName": "nvidia", "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}], '
        '"extraEnv": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}}], '
        '"imagePullSecrets": [{"name": "reg"}], "terminationGracePeriodSeconds": 300}', default_image="fleet:1")
    pod = pod_manifest(_want(_dep()), fleet_id="f", owner=None, settings=settings)
    spec = pod["spec"]
    c = spec["containers"][0]
    assert c["image"] == "fleet:1"
    assert c["command"][:5] == ["python", "-m", "fleet.enginesim", "--model", "sim://h100-llama-8b"]
    assert c["resources"] == {"requests": {"cpu": "1", "memory": "256Mi"}}   # the simulator loads no weights
    assert spec["runtimeClassName"] == "nvidia" and spec["terminationGracePeriodSeconds"] == 300
    assert spec["imagePullSecrets"] == [{"name": "reg"}]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "t"}}} in c["env"]
    kubernetes_validate.validate(pod, "1.30.0", strict=True)


def test_bad_engine_pod_settings_name_the_key():
    with pytest.raises(ValueError, match="migStrategy"):
        EnginePodSettings.from_json('{"migStrategy": "half"}')


@pytest.mark.parametrize("source,match", [("models/qwen", "relative path"), ("s3://b/m", "weight cache")])
def test_weights_a_pod_cannot_reach_fail_the_launch(source, match):
    ld = _dep(engine={"kind": "vllm", "image": "i"}, model={"name": "q", "source": source})
    with pytest.raises(LaunchError, match=match):
        pod_manifest(_want(ld), fleet_id="f", owner=None, settings=EnginePodSettings())


def test_no_image_and_gangs_fail_the_launch():
    with pytest.raises(LaunchError, match="engine image"):
        pod_manifest(_want(_dep()), fleet_id="f", owner=None, settings=EnginePodSettings())
    ld = _dep()
    gang = ReplicaPlacement((Assignment("a", ("a/gpu0",), {}, "g"), Assignment("b", ("b/gpu0",), {}, "g")))
    with pytest.raises(LaunchError, match="multi-node"):
        pod_manifest(ReplicaWant("chat-0", ld.deployment, gang, ld.serving_hash, ld.base_dir), fleet_id="f",
                     owner=None, settings=EnginePodSettings(default_image="i"))


def test_pod_facts_follow_the_pod():
    pod = pod_manifest(_want(_dep()), fleet_id="f", owner=None, settings=EnginePodSettings(default_image="i"))
    pod["status"] = {"phase": "Pending"}
    f = pod_facts(pod)
    assert (f.replica_id, f.running, f.exited, f.image_present, f.endpoint) == ("chat-0", False, False, False, None)
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.7", "containerStatuses": [
        {"name": "engine", "imageID": "sha256:1", "state": {"running": {}}}]}
    f = pod_facts(pod)
    assert f.running and f.image_present and f.endpoint == "http://10.0.0.7:8000" and f.node == "gpu-a"
    pod["status"] = {"phase": "Failed", "reason": "Evicted", "message": "low on memory"}
    f = pod_facts(pod)
    assert f.exited and not f.running and f.exit_reason == "pod failed: Evicted: low on memory"
    pod["status"] = {"phase": "Pending", "containerStatuses": [{"name": "engine", "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": "no such image"}}}]}
    f = pod_facts(pod)
    assert f.exited and f.problem == "ImagePullBackOff: no such image"


# ----- inventory -----------------------------------------------------------------------------------


def test_inventory_from_nodes_and_gfd_labels():
    kube = FakeKube()
    for n in (node("gpu-a", gpus=8), node("mig-a", gpus=1, mig={"3g.40gb": 2}), node("cpu-a"),
              node("sick", gpus=8, ready=False), node("cordoned", gpus=8, unschedulable=True),
              node("tainted", gpus=8, taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}])):
        kube.store.create(NODES, None, n)
    backend = KubernetesBackend(kube, NS, "fleet")
    inv = asyncio.run(backend.inventory())
    assert [n.name for n in inv.nodes] == ["cpu-a", "gpu-a", "mig-a"]
    gpu = next(n for n in inv.nodes if n.name == "gpu-a")
    assert len(gpu.gpus) == 8 and gpu.nvlink_domains == (tuple(range(8)),)
    mig = next(n for n in inv.nodes if n.name == "mig-a")
    assert sorted(m.profile for g in mig.gpus for m in g.mig_instances) == ["3g.40gb", "3g.40gb"]
    assert backend.unusable_nodes == {"cordoned": "cordoned", "sick": "not Ready",
                                      "tainted": "taint nvidia.com/gpu=:NoSchedule not tolerated"}
    tolerant = EnginePodSettings(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    assert node_usable(node("t", taints=[{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]), tolerant) is None
    assert "engine node selector" in node_usable(node("x"), EnginePodSettings(node_selector={"pool": "gpu"}))


def test_with_the_node_cache_a_node_without_the_agent_takes_no_replica():
    """The weight cache lives where the node agent runs (its gpu-health annotation says it runs,
    GPUs or not): elsewhere the cache directory is not the engine pods' and the pod would fail."""
    cached = EnginePodSettings(weight_cache_path="/var/lib/fleet/cache")
    agentless = node("cpu-b")
    with_agent = node("cpu-a", annotations={"fleet.inference.dev/gpu-health": '{"quarantined": []}'})
    assert "no Fleet node agent" in node_usable(agentless, cached)
    assert node_usable(with_agent, cached) is None
    assert node_usable(agentless, EnginePodSettings()) is None   # no cache: vLLM fetches its weights itself


# ----- the real controller on the fake cluster -------------------------------------------------------


class EndpointEngines:
    """Engine HTTP by endpoint (every pod listens on port 8000 of its own IP)."""

    def __init__(self) -> None:
        self.healthy: set[str] = set()
        self.posts: list[str] = []
        self.metrics_text: str | None = None     # every healthy engine's /metrics

    async def health(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        return endpoint in self.healthy

    async def post(self, endpoint: str, path: str, body: dict, timeout_s: float) -> int:
        self.posts.append(endpoint)
        return 1

    async def metrics(self, endpoint: str, timeout_s: float = 2.0) -> str:
        from warmup.client import EngineRequestError

        if self.metrics_text is None or endpoint not in self.healthy:
            raise EngineRequestError("GET /metrics: ConnectError")
        return self.metrics_text


class Cluster(ControllerHarness):
    def __init__(self, *deps: LoadedDeployment, kube: FakeKube | None = None, nodes=None) -> None:
        self.kube = kube or FakeKube()
        self.store = self.kube.store
        if not self.store.list(NODES, None, None)[0]:
            for n in nodes or (node("cpu-a", cpu=4, images=["fleet:1"]), node("cpu-b", cpu=4, images=["fleet:1"])):
                self.store.create(NODES, None, n)
        self.owners = {}
        for ld in deps:
            if (PODS.plural, NS, ld.deployment.name) not in self.store.objects:
                try:
                    obj = self.store.get(INFERENCE_DEPLOYMENTS, NS, ld.deployment.name)
                except Exception:  # noqa: BLE001
                    obj = self.store.create(INFERENCE_DEPLOYMENTS, NS, {"metadata": {"name": ld.deployment.name},
                                                                       "spec": ld.deployment.spec.to_document()})
                self.owners[ld.deployment.name] = obj
        self.clock = FakeClock()
        self.engines = EndpointEngines()
        self.pools = FakePoolSink()
        self.backend = KubernetesBackend(self.kube, NS, "fleet", settings=EnginePodSettings(default_image="fleet:1"),
                                         owner_of=self.owners.get)
        self.c = Controller(list(deps), backend=self.backend, engine_api=self.engines, pool_sink=self.pools,
                            clock=self.clock, sleep=self.clock.sleep,
                            settings=ControllerSettings(stop_grace_s=30, backoff_base_s=5))
        self.next_ip = 10

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in self.store.list(PODS, NS, None)[0]}

    def kubelet_runs_everything(self) -> None:
        """The scheduler stand-in binds pending pods; they start: a pod IP each, and their
        engines answer /health."""
        schedule(self.store)
        for name, pod in self.pods().items():
            if (pod.get("status") or {}).get("phase") in (None, "Pending"):
                ip = f"10.0.0.{self.next_ip}"
                self.next_ip += 1
                run_pod(self.store, NS, name, ip)
                self.engines.healthy.add(f"http://{ip}:8000")

    def status(self) -> dict[str, S]:
        return {rid: r.status for rid, r in self.c.replicas.items()}

    def pool(self, model="chat-model") -> list[str]:
        return sorted(e.id for e in self.pools.pools.get(model, []) if not e.draining)


async def _ready_cluster(*deps) -> Cluster:
    cl = Cluster(*deps)
    await cl.c.start(None)
    await cl.tick()
    cl.kubelet_runs_everything()
    await cl.tick(n=3)
    return cl


async def test_replicas_run_as_pods_warm_and_join_the_pool():
    cl = Cluster(_dep())
    await cl.c.start(None)
    await cl.tick()
    pods = cl.pods()
    assert sorted(pods) == ["chat-0", "chat-1"]
    assert {pod_node(p) for p in pods.values()} <= {"cpu-a", "cpu-b"}
    assert not any(p["spec"].get("nodeName") for p in pods.values())   # the scheduler has not run yet
    assert all(p["metadata"]["ownerReferences"][0]["uid"] == cl.owners["chat"]["metadata"]["uid"]
               for p in pods.values())
    assert set(cl.status().values()) == {S.CACHING}     # the nodes list the image; no container yet
    assert cl.pool() == []
    cl.kubelet_runs_everything()
    await cl.tick(n=3)
    assert set(cl.status().values()) == {S.READY}, cl.status()
    assert cl.pool() == ["chat-0", "chat-1"]
    eps = sorted(e.url for e in cl.pools.pools["chat-model"])
    assert eps == ["http://10.0.0.10:8000", "http://10.0.0.11:8000"]
    assert len(cl.engines.posts) == 2        # the warm-up gate ran before the pool saw them
    assert cl.kube.calls["create"] == 2      # nothing created twice across ticks


async def test_scale_down_drains_then_deletes_the_pod_gracefully():
    cl = await _ready_cluster(_dep(replicas={"min": 1, "max": 4, "initial": 2}))
    cl.c.set_desired("chat", 1)
    cl.pools.in_flight_by_id = {"chat-1": 1}
    await cl.tick()
    assert cl.status()["chat-1"] is S.DRAINING and cl.pool() == ["chat-0"]
    assert "deletionTimestamp" not in cl.pods()["chat-1"]["metadata"]   # in-flight request: not yet
    cl.pools.in_flight_by_id = {}
    await cl.tick()
    assert cl.pods()["chat-1"]["metadata"].get("deletionTimestamp")    # graceful delete: SIGTERM
    assert finish_deletions(cl.store, NS) == ["chat-1"]
    await cl.tick()
    assert cl.status()["chat-1"] is S.TERMINATED
    assert sorted(cl.pods()) == ["chat-0"]


@pytest.mark.parametrize("how", ["deleted", "evicted", "crashed"])
async def test_a_lost_pod_is_replaced(how):
    cl = await _ready_cluster(_dep())
    if how == "deleted":
        cl.store.delete(PODS, NS, "chat-0", grace_period_s=0)
    elif how == "evicted":
        evict_pod(cl.store, NS, "chat-0")
    else:
        terminate_pod(cl.store, NS, "chat-0", 137, reason="OOMKilled")
    await cl.tick()
    r = cl.c.replicas["chat-0"]
    assert r.status is S.FAILED_CRASHED
    assert {"deleted": "pod was deleted", "evicted": "Evicted", "crashed": "exit code 137"}[how] in r.failure.reason
    assert cl.pool() == ["chat-1"]
    await cl.tick(seconds=6)     # backoff 5 s, then a replacement pod
    assert "chat-2" in cl.pods()
    assert "chat-0" not in cl.pods()      # a finished pod's object is deleted once seen
    cl.kubelet_runs_everything()
    await cl.tick(n=3)
    assert cl.pool() == ["chat-1", "chat-2"]


async def test_image_pull_backoff_fails_the_start():
    cl = Cluster(_dep())
    await cl.c.start(None)
    await cl.tick()
    image_pull_backoff(cl.store, NS, "chat-0")
    await cl.tick()
    r = cl.c.replicas["chat-0"]
    assert r.status is S.FAILED_START and "ImagePullBackOff" in r.failure.reason


async def test_a_new_controller_adopts_running_pods():
    cl = await _ready_cluster(_dep())
    snapshot = cl.c.snapshot()
    creates = cl.kube.calls["create"]
    # a new operator process: new backend, new controller, same cluster
    cl2 = Cluster(_dep(), kube=cl.kube)
    await cl2.c.start(snapshot)
    cl2.engines.healthy = cl.engines.healthy
    await cl2.tick(n=2)
    assert cl2.status() == {"chat-0": S.READY, "chat-1": S.READY}
    assert all(r.adopted_at_s is not None for r in cl2.c.replicas.values())
    assert cl.kube.calls["create"] == creates and "delete" not in cl.kube.calls
    assert cl2.pool() == ["chat-0", "chat-1"]


async def test_a_changed_spec_replaces_pods_after_the_new_ones_warm():
    cl = await _ready_cluster(_dep())
    changed = _dep(engine={"kind": "sim", "args": ["--seed", "2"]})
    cl2 = Cluster(changed, kube=cl.kube)
    cl2.engines.healthy = cl.engines.healthy
    cl2.next_ip = 20
    await cl2.c.start(cl.c.snapshot())
    await cl2.tick()
    assert {cl2.c.replicas[r].status for r in ("chat-0", "chat-1")} == {S.DRAINING}
    cl2.kubelet_runs_everything()
    await cl2.tick(n=3)
    pods = cl2.pods()
    new = sorted(n for n, p in pods.items() if p["metadata"]["labels"][LABEL_SPEC_HASH] == changed.serving_hash)
    assert new == ["chat-2", "chat-3"]
    assert all(pods[n]["metadata"].get("deletionTimestamp") for n in ("chat-0", "chat-1"))


async def test_a_refused_pod_create_fails_the_start_with_the_reason():
    from fleet.k8s.client import ApiError

    cl = Cluster(_dep(replicas={"min": 1, "max": 1}))
    cl.kube.fail_next["create"] = ApiError(422, "Invalid", 'Pod "chat-0" is invalid: spec.containers[0].image')
    await cl.c.start(None)
    await cl.tick(n=2)
    r = cl.c.replicas["chat-0"]
    assert r.status is S.FAILED_START
    assert "the API server refused pod chat-0: 422 Invalid" in r.failure.reason
    await cl.backend.drain_creates()
    await cl.tick(n=2, seconds=6)      # replaced after the backoff
    assert "chat-1" in cl.pods()


async def test_a_lost_node_replaces_its_replicas_elsewhere():
    cl = await _ready_cluster(_dep())
    lost = pod_node(cl.pods()["chat-0"])
    cl.store.finish_delete(NODES, None, lost)       # the node object goes (the node was removed or died)
    await cl.tick()
    r = cl.c.replicas["chat-0"]
    assert r.status is S.FAILED_CRASHED and f"node {lost} was lost" in r.failure.reason
    await cl.tick(seconds=11)       # backoff after up to two failures in a row (5 s, 10 s)
    new = [p for n, p in cl.pods().items() if n not in ("chat-0", "chat-1")]
    assert new and all(pod_node(p) != lost for p in new)


def test_an_unbound_pod_is_on_the_node_it_is_pinned_to_and_says_why_the_scheduler_refuses_it():
    pod = pod_manifest(_want(_dep(), node_name="gpu-b"), fleet_id="fleet", owner=OWNER, settings=EnginePodSettings(
        default_image="fleet:1"))
    f = pod_facts(pod)
    assert f.node == "gpu-b" and f.detail["node"] == "gpu-b" and f.unschedulable is None
    message = "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's node affinity."
    pod["status"] = {"phase": "Pending", "conditions": [
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message}]}
    f = pod_facts(pod)
    assert f.unschedulable == message and message in f.detail["scheduling"] and not f.exited
    pod["spec"]["nodeName"] = "gpu-c"          # bound (a node name wins over the pin)
    assert pod_facts(pod).node == "gpu-c" and pod_facts(pod).unschedulable is None


FOREIGN = {"metadata": {"name": "someone-elses"}, "spec": {"nodeName": "cpu-a", "containers": [
    {"name": "c", "image": "x", "resources": {"requests": {"cpu": "4"}}}]}}


async def test_a_pod_the_scheduler_refuses_is_reported_then_replaced_off_that_node():
    nodes = (node("cpu-a", cpu=4, images=["fleet:1"]), node("cpu-b", cpu=4, images=["fleet:1"]))
    cl = Cluster(_dep(replicas={"min": 1, "max": 1}), nodes=nodes)
    cl.store.create(PODS, NS, FOREIGN)          # a pod Fleet did not make holds every core of cpu-a
    await cl.c.start(None)
    await cl.tick()
    assert pod_node(cl.pods()["chat-0"]) == "cpu-a"          # placement sees 4 free cores there
    schedule(cl.store)
    pod = cl.pods()["chat-0"]
    assert "nodeName" not in pod["spec"]
    message = "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) didn't match Pod's node affinity."
    await cl.tick()
    r = cl.c.replicas["chat-0"]
    assert r.unschedulable == message and message in r.detail["scheduling"] and not r.status.failed()
    from fleet.k8s.status import deployment_status

    degraded = {c["type"]: c for c in deployment_status(cl.c, "chat", 1, None, 0.0)["conditions"]}["Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "Unschedulable") and message in degraded["message"]
    timeout_s = cl.c.deployments["chat"].loaded.deployment.spec.engine.startup_timeout_seconds
    await cl.tick(seconds=timeout_s + 1)       # the start deadline of a replica that does not start
    r = cl.c.replicas["chat-0"]
    assert r.status is S.FAILED_START and "the scheduler could not place it on node cpu-a" in r.failure.reason
    assert message in r.failure.reason
    await cl.tick(n=2, seconds=6)               # the backoff, then a replacement
    assert "chat-0" not in cl.pods() and pod_node(cl.pods()["chat-1"]) == "cpu-b"   # not the refused node
    cl.kubelet_runs_everything()
    await cl.tick(n=3)
    assert cl.status()["chat-1"] is S.READY and cl.pods()["chat-1"]["spec"]["nodeName"] == "cpu-b"


# ----- multi-node replicas (gangs) ------------------------------------------------------------------


def _gang_dep():
    return _dep(model={"name": "big", "source": "hf://org/big"}, engine={"kind": "vllm", "image": "vllm:1"},
                resources={"accelerator": "gpu", "tensorParallelSize": 16})


def _gang_want(ld, rid="chat-0"):
    placement = ReplicaPlacement(tuple(Assignment(n, tuple(f"{n}/gpu{i}" for i in range(8)), {}, "gpu:0-7")
                                       for n in ("gpu-a", "gpu-b")))  # fmt: skip
    return ReplicaWant(rid, ld.deployment, placement, ld.serving_hash, ld.base_dir)


def test_a_gang_is_a_leader_pod_and_worker_pods_over_ray():
    from fleet.k8s.pods import LABEL_GANG_ROLE, pod_group

    pods = pod_group(_gang_want(_gang_dep()), fleet_id="f", owner=OWNER, settings=EnginePodSettings())
    leader, worker = pods
    assert [p["metadata"]["name"] for p in pods] == ["chat-0", "chat-0-w1"]
    assert [pod_node(p) for p in pods] == ["gpu-a", "gpu-b"]     # each member pinned to its own node
    assert [p["spec"]["affinity"] for p in pods] == [node_affinity("gpu-a"), node_affinity("gpu-b")]
    assert not any("nodeName" in p["spec"] for p in pods)
    assert [p["metadata"]["labels"][LABEL_GANG_ROLE] for p in pods] == ["leader", "worker"]
    assert all(p["metadata"]["labels"][LABEL_REPLICA] == "chat-0" for p in pods)
    lc, wc = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert lc["resources"]["limits"] == wc["resources"]["limits"] == {"nvidia.com/gpu": "8"}
    script = lc["command"][2]
    assert script.startswith("ray start --head --port=6379 && ")
    assert "--tensor-parallel-size 8 --pipeline-parallel-size 2 --distributed-executor-backend ray" in script
    assert "vllm serve org/big" in script
    assert (leader["spec"]["hostname"], leader["spec"]["subdomain"]) == ("chat-0", "fleet-gangs")
    assert "ray start --address=chat-0.fleet-gangs:6379 --block" in wc["command"][2]
    assert "readinessProbe" not in wc and "readinessProbe" in lc     # only the leader serves
    for pod in pods:
        kubernetes_validate.validate(pod, "1.37.0", strict=True)


def test_the_simulator_has_no_gangs():
    ld = _dep(engine={"kind": "sim"}, resources={"accelerator": "gpu", "tensorParallelSize": 16})
    from fleet.k8s.pods import pod_group

    with pytest.raises(LaunchError, match="no multi-node mode"):
        pod_group(_gang_want(ld), fleet_id="f", owner=None, settings=EnginePodSettings())


async def test_gang_pods_are_created_all_or_nothing_and_observed_as_one_replica():
    from fleet.k8s.client import ApiError

    kube = FakeKube()
    for n in ("gpu-a", "gpu-b"):
        kube.store.create(NODES, None, node(n, gpus=8))
    backend = KubernetesBackend(kube, NS, "fleet", settings=EnginePodSettings(pre_pull=False))   # pre-pull: elsewhere
    ld = _gang_dep()
    await backend.ensure(_gang_want(ld))
    await backend.drain_creates()
    assert sorted(p["metadata"]["name"] for p in kube.store.list(PODS, NS, None)[0]) == ["chat-0", "chat-0-w1"]
    facts = await backend.observe()
    assert list(facts) == ["chat-0"] and not facts["chat-0"].running and not facts["chat-0"].exited
    run_pod(kube.store, NS, "chat-0", "10.0.0.1")
    assert not (await backend.observe())["chat-0"].running      # the worker does not run yet
    run_pod(kube.store, NS, "chat-0-w1", "10.0.0.2")
    f = (await backend.observe())["chat-0"]
    assert f.running and f.endpoint == "http://10.0.0.1:8000" and f.detail["members"] == "2"
    terminate_pod(kube.store, NS, "chat-0-w1", 1)                  # a worker dies: the replica has exited
    f = (await backend.observe())["chat-0"]
    assert f.exited and "gang member 1 exited" in f.exit_reason
    await backend.forget("chat-0")
    assert kube.store.list(PODS, NS, None)[0] == [] or all(
        p["metadata"].get("deletionTimestamp") for p in kube.store.list(PODS, NS, None)[0])
    # all or nothing: the worker is refused, the leader already created is deleted again
    calls = {"n": 0}
    real_create = kube.store.create

    def refuse_second(res, ns, body):
        calls["n"] += 1
        if res is PODS and calls["n"] == 2:
            raise ApiError(403, "Forbidden", "exceeded quota: requests.nvidia.com/gpu")
        return real_create(res, ns, body)

    kube.store.create = refuse_second
    await backend.ensure(_gang_want(ld, rid="chat-1"))
    await backend.drain_creates()
    names = [p["metadata"]["name"] for p in kube.store.list(PODS, NS, None)[0]
             if not p["metadata"].get("deletionTimestamp")]
    assert not any(n.startswith("chat-1") for n in names)
    f = (await backend.observe())["chat-1"]
    assert f.exited and "exceeded quota" in f.exit_reason and "gang of 2: none kept" in f.exit_reason
