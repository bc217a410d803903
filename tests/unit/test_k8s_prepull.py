"""Image pre-pull on Kubernetes (fleet/k8s/prepull.py, the pre-pull in fleet/k8s/backend.py and
the operator, the engine pods' pull policy). What makes a node warm (Node.status.images, the
node agent's annotation) is tests/unit/test_k8s_node_warmth.py's.

The real `Controller` and `KubernetesBackend` run on the in-repo fake of the cluster wrapper
(tests/support/fake_kube.py); the STAND-IN kubelet's image manager (fleet/testing/k8s/kubelet.py `ImagePuller`)
pulls images into ``Node.status.images`` or fails with ErrImagePull. Clocks are fake: backoff
times are asserted, never waited for. The raw client is made to fail."""

from __future__ import annotations

import asyncio
from pathlib import Path

import kubernetes_validate
import pytest
import tenacity

from fleet.k8s.node_facts import CACHED_ANNOTATION as ANNOTATION
from fleet.controller.reconcile import Controller, ControllerSettings
from fleet.inventory.gfd import image_aliases, node_images
from fleet.k8s.backend import KubernetesBackend
from fleet.k8s.client import EVENTS, INFERENCE_DEPLOYMENTS, NODES, PODS
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.prepull import (PodPull, Pull, PrePullPolicy, is_pull_pod, pod_pull_state, pull_pod_manifest,
                               pull_pod_name)  # fmt: skip
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.spec import LoadedDeployment, SpecError, parse_document
from tests.support.controller import ControllerHarness
from tests.support.fakes import FakeClock, FakePoolSink
from tests.support.fake_kube import FakeKube
from fleet.testing.k8s.kubelet import ImagePuller, run_pod
from fleet.testing.k8s.workloads import schedule
from fleet.k8s.pod_facts import pod_node
from fleet.k8s.pods import node_affinity
from fleet.testing.k8s.nodes import node

NS = "fleet"
IMAGE = "registry.example.com/fleet/engine:1"
SOURCE = "hf://org/llama-8b"


def _dep(name="chat", **spec_over) -> LoadedDeployment:
    spec = {"model": {"name": f"{name}-model", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim", "image": IMAGE},
            "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 2},
            "warmup": {"requests": [{"kind": "completion", "prompt": "hi", "maxTokens": 2}]}}  # fmt: skip
    spec.update(spec_over)
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": name},
           "spec": spec}  # fmt: skip
    return LoadedDeployment(parse_document(doc), Path("/deploy") / f"{name}.yaml", 0)


class Engines:
    def __init__(self) -> None:
        self.healthy: set[str] = set()

    async def health(self, endpoint: str, timeout_s: float = 2.0) -> bool:
        return endpoint in self.healthy

    async def post(self, endpoint: str, path: str, body: dict, timeout_s: float) -> int:
        return 1

    async def metrics(self, endpoint: str, timeout_s: float = 2.0) -> str:
        from warmup.client import EngineRequestError

        raise EngineRequestError("GET /metrics: ConnectError")


class Env(ControllerHarness):
    """The controller and the Kubernetes backend on the fake cluster, with the stand-in kubelet's pulls."""

    def __init__(self, *deps: LoadedDeployment, nodes: list[dict], settings: EnginePodSettings | None = None,
                 puller: ImagePuller | None = None) -> None:  # fmt: skip
        self.kube = FakeKube()
        self.store = self.kube.store
        for n in nodes:
            self.store.create(NODES, None, n)
        self.owners = {ld.deployment.name: self.store.create(INFERENCE_DEPLOYMENTS, NS, {
            "metadata": {"name": ld.deployment.name}, "spec": ld.deployment.spec.to_document()}) for ld in deps}
        self.clock = FakeClock(1_800_000_000.0)
        self.engines = Engines()
        self.backend = KubernetesBackend(self.kube, NS, "fleet", owner_of=self.owners.get, clock=self.clock,
                                         settings=settings or EnginePodSettings(default_image="fleet:1"))  # fmt: skip
        self.c = Controller(list(deps), backend=self.backend, engine_api=self.engines, pool_sink=FakePoolSink(),
                            clock=self.clock, sleep=self.clock.sleep,
                            settings=ControllerSettings(stop_grace_s=30, backoff_base_s=5))  # fmt: skip
        self.puller = puller or ImagePuller()
        self.next_ip = 10

    async def reconcile(self) -> None:
        await self.c.reconcile_once()
        await self.backend.drain_creates()     # then the warm-up tasks run (`settle`)

    def kubelet(self) -> None:
        """The scheduler stand-in binds what it can, then one kubelet pass: pending pods pull
        their images; engine pods whose images are there run."""
        schedule(self.store)
        for name, pod in self.pods().items():
            if (pod.get("status") or {}).get("phase") not in (None, "Pending"):
                continue
            if self.puller.sync(self.store, NS, name) == "pulled" and not is_pull_pod(pod):
                ip = f"10.0.0.{self.next_ip}"
                self.next_ip += 1
                run_pod(self.store, NS, name, ip)
                self.engines.healthy.add(f"http://{ip}:8000")

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in self.store.list(PODS, NS, None)[0]}

    def pull_pods(self) -> dict[str, dict]:
        return {n: p for n, p in self.pods().items() if is_pull_pod(p)}

    def engine_pods(self) -> dict[str, dict]:
        return {n: p for n, p in self.pods().items() if not is_pull_pod(p)}

    def created_pods(self) -> list[str]:
        """Every pod ever created, in order (the store's ADDED events)."""
        return [obj["metadata"]["name"] for _rv, plural, type_, obj in self.store.events
                if plural == PODS.plural and type_ == "ADDED"]  # fmt: skip

    def events(self, reason: str) -> list[dict]:
        return [e for e in self.store.list(EVENTS, NS, None)[0] if e["reason"] == reason]

    def status(self) -> dict[str, S]:
        return {rid: r.status for rid, r in self.c.replicas.items()}


# ----- the pod and what it says ------------------------------------------------------------------


@pytest.mark.parametrize("kube", ["1.30.0", "1.37.0"])
def test_the_pre_pull_pod_is_a_valid_short_lived_pod_like_the_engine_pods(kube):
    tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    settings = EnginePodSettings(runtime_class_name="nvidia", tolerations=tolerations, node_selector={"pool": "gpu"},
                                 image_pull_secrets=[{"name": "regcred"}], service_account_name="engine")  # fmt: skip
    pod = pull_pod_manifest("gpu-node-a.example.com", IMAGE, fleet_id="fleet", settings=settings, attempt=2)
    kubernetes_validate.validate(pod, kube, strict=True)
    spec = pod["spec"]
    c = spec["containers"][0]
    assert "nodeName" not in spec and spec["restartPolicy"] == "Never"     # the scheduler binds it, pinned:
    assert spec["affinity"] == node_affinity("gpu-node-a.example.com")
    assert pod_node(pod) == "gpu-node-a.example.com"
    assert c["image"] == IMAGE and c["imagePullPolicy"] == "IfNotPresent" and c["command"] == ["true"]
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert spec["tolerations"] == tolerations and spec["nodeSelector"] == {"pool": "gpu"}
    assert spec["runtimeClassName"] == "nvidia" and spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["serviceAccountName"] == "engine" and spec["automountServiceAccountToken"] is False
    assert is_pull_pod(pod) and pod["metadata"]["name"].endswith("-2") and len(pod["metadata"]["name"]) <= 63
    assert pull_pod_name("n", IMAGE, 0) != pull_pod_name("n", IMAGE, 1) != pull_pod_name("m", IMAGE, 1)


def _pod(state: dict | None = None, phase: str = "Pending", image_id: str = "", **status) -> dict:
    statuses = [{"name": "pull", "image": IMAGE, "imageID": image_id, "state": state}] if state is not None else []
    return {"metadata": {"name": "p"}, "status": {"phase": phase, "containerStatuses": statuses, **status}}


@pytest.mark.parametrize("pod,want,why", [
    (_pod(), PodPull.PULLING, ""),
    (_pod({"waiting": {"reason": "ContainerCreating"}}), PodPull.PULLING, ""),
    (_pod({"waiting": {"reason": "ErrImagePull", "message": "not found"}}), PodPull.FAILED, "ErrImagePull: not found"),
    (_pod({"waiting": {"reason": "ImagePullBackOff"}}), PodPull.FAILED, "ImagePullBackOff"),
    (_pod({"waiting": {"reason": "InvalidImageName"}}), PodPull.FAILED, "InvalidImageName"),
    (_pod({"terminated": {"exitCode": 0}}, "Succeeded", "sha256:1"), PodPull.PULLED, ""),
    # an image without `true` (distroless): the container cannot start, but the image was pulled
    (_pod({"waiting": {"reason": "RunContainerError"}}), PodPull.PULLED, ""),
    (_pod({"terminated": {"exitCode": 128, "reason": "StartError"}}, "Failed", "sha256:1"), PodPull.PULLED, ""),
    (_pod(phase="Failed", reason="OutOfpods", message="Node didn't have enough resource: pods"), PodPull.FAILED,
     "pod rejected by the node: OutOfpods: Node didn't have enough resource: pods"),
])  # fmt: skip
def test_what_a_pre_pull_pod_says(pod, want, why):
    assert pod_pull_state(pod) == (want, why)


# ----- the pure policy ------------------------------------------------------------------------------


def test_failed_pulls_back_off_with_tenacity_waits_on_the_injected_clock_then_give_up():
    clock = FakeClock(100.0)
    policy = PrePullPolicy(clock, timeout_s=300, wait=tenacity.wait_exponential(multiplier=10, max=30),
                           stop=tenacity.stop_after_attempt(3))  # fmt: skip
    key = ("n1", IMAGE)
    wanted, images = {key: None}, {"n1": frozenset()}
    failed = {key: _pod({"waiting": {"reason": "ErrImagePull"}})}
    assert policy.step(wanted, images, {}).create == [key]
    expected_waits = [10, 20, 30]   # 10 * 2^(n-1), capped at 30
    for attempt, wait in enumerate(expected_waits, start=1):
        plan = policy.step(wanted, images, failed)
        rec = policy.record(*key)
        assert plan.delete == ["p"] and plan.failed == [rec] and rec.failures == attempt
        assert rec.retry_at_s == clock() + wait
        assert rec.phase is (Pull.GAVE_UP if attempt == 3 else Pull.BACKOFF)
        clock.advance(wait - 1)
        assert policy.step(wanted, images, {}).create == []      # still backing off
        clock.advance(1)
        assert policy.step(wanted, images, {}).create == [key]   # the next attempt, on time
    # a pull that never ends times out
    clock.advance(300)
    pending = {key: {**_pod(), "metadata": {"name": "p2"}}}
    plan = policy.step(wanted, images, pending)
    assert plan.delete == ["p2"] and "timed out after 300 s" in policy.record(*key).reason


def test_present_images_need_no_pull_and_the_parallelism_limit_holds():
    clock = FakeClock(0.0)
    policy = PrePullPolicy(clock)
    images = {"a": frozenset(image_aliases("docker.io/registry.example.com/x")) | node_images(node("a", images=[IMAGE])),
              "b": frozenset(), "c": frozenset(), "d": frozenset()}  # fmt: skip
    wanted = {(n, IMAGE): 2 for n in "abcd"}
    plan = policy.step(wanted, images, {})
    assert plan.create == [("b", IMAGE), ("c", IMAGE)]          # a holds it; at most 2 at once
    assert policy.step(wanted, images, {}).create == []         # b and c still pulling
    assert policy.present("a", IMAGE, images["a"]) and not policy.present("b", IMAGE, images["b"])
    wanted[("d", IMAGE)] = None                                 # a replica waits on d: no limit
    assert policy.step(wanted, images, {}).create == [("d", IMAGE)]


# ----- the backend and the controller -------------------------------------------------------------


async def test_the_image_is_pre_pulled_before_the_engine_pod_is_created():
    env = Env(_dep(), nodes=[node("cpu-a", cpu=4)])
    await env.c.start(None)
    await env.tick()
    pulls = env.pull_pods()
    assert len(pulls) == 1 and env.engine_pods() == {}
    pull = next(iter(pulls.values()))
    assert pod_node(pull) == "cpu-a" and pull["spec"]["containers"][0]["image"] == IMAGE
    assert env.status() == {"chat-0": S.PULLING}
    assert env.c.replicas["chat-0"].detail["cache"].startswith(f"pulling image {IMAGE} onto node cpu-a")
    await env.tick(seconds=5)
    assert env.engine_pods() == {} and env.status() == {"chat-0": S.PULLING}   # not before the image is there
    env.kubelet()                                                               # the pull finishes
    assert node_images(env.store.get(NODES, None, "cpu-a")) >= image_aliases(IMAGE)
    await env.tick()
    assert env.pull_pods() == {}                                                # cleaned up
    assert list(env.engine_pods()) == ["chat-0"]
    assert env.created_pods() == [pull["metadata"]["name"], "chat-0"]           # pull first, engine after
    assert env.status() == {"chat-0": S.CACHING}                                # the image is there
    env.kubelet()
    await env.tick(n=3)
    assert env.status() == {"chat-0": S.READY}
    assert env.puller.pulls == {("cpu-a", IMAGE): 1}                            # the engine pod pulled nothing


async def test_a_node_that_holds_the_image_gets_no_pre_pull_pod():
    env = Env(_dep(), nodes=[node("cpu-a", cpu=4, images=[IMAGE])])   # listed as docker.io/... by the runtime
    await env.c.start(None)
    await env.tick()
    assert env.created_pods() == ["chat-0"]
    assert env.status() == {"chat-0": S.CACHING}
    env.kubelet()
    await env.tick(n=3)
    assert env.status() == {"chat-0": S.READY} and env.puller.pulls == {}
    assert not any(n.startswith("prepull-") for n in env.created_pods())


async def test_a_failed_pull_backs_off_is_reported_with_node_and_reason_and_the_replica_fails():
    env = Env(_dep(), nodes=[node("cpu-a", cpu=4)], puller=ImagePuller(unpullable={IMAGE}))
    await env.c.start(None)
    await env.tick()
    waits = [10, 20]              # the chart's defaults: 10 s, doubling; 3 attempts
    for attempt in range(3):
        assert [p["metadata"]["name"][-2:] for p in env.pull_pods().values()] == [f"-{attempt}"]
        env.kubelet()             # ErrImagePull (then ImagePullBackOff)
        await env.tick()
        now = env.clock()
        rec = env.backend.prepuller.policy.record("cpu-a", IMAGE)
        assert rec.failures == attempt + 1 and env.pull_pods() == {}          # the failed pod is deleted
        event = env.events("ImagePullFailed")[-1]
        assert event["type"] == "Warning" and event["involvedObject"]["name"] == "chat"
        assert "node cpu-a" in event["message"] and IMAGE in event["message"] and "ImagePull" in event["message"]
        if attempt == 2:
            break
        assert rec.phase is Pull.BACKOFF and rec.retry_at_s == now + waits[attempt]
        assert env.status() == {"chat-0": S.PULLING}
        assert f"next attempt in {waits[attempt]} s" in env.c.replicas["chat-0"].detail["cache"]
        await env.tick(seconds=waits[attempt] - 1)
        assert env.pull_pods() == {}                                          # not before the backoff allows
        await env.tick()
    assert len(env.events("ImagePullFailed")) == 3
    r = env.c.replicas["chat-0"]
    assert r.status is S.FAILED_START
    assert f"image {IMAGE} could not be pulled onto node cpu-a (3 attempt(s)): ImagePullBackOff" in r.failure.reason
    assert not any(n.startswith("chat-") for n in env.created_pods())        # no engine pod was ever created
    # the replacement waits for the pull's backoff on this node: no pod before retry_at_s
    rec = env.backend.prepuller.policy.record("cpu-a", IMAGE)
    while env.clock() + 5 < rec.retry_at_s:
        await env.tick(seconds=5)
        assert env.pull_pods() == {} and env.engine_pods() == {}
    await env.tick(seconds=5)
    assert len(env.pull_pods()) == 1


async def test_a_pull_without_a_result_times_out_and_its_pod_goes():
    settings = EnginePodSettings(default_image="fleet:1", pre_pull_timeout_s=60)
    env = Env(_dep(), nodes=[node("cpu-a", cpu=4)], settings=settings)
    await env.c.start(None)
    await env.tick()
    assert len(env.pull_pods()) == 1
    await env.tick(seconds=61)
    rec = env.backend.prepuller.policy.record("cpu-a", IMAGE)
    assert rec.phase is Pull.BACKOFF and "timed out after 60 s" in rec.reason and env.pull_pods() == {}


async def test_a_replica_stopped_while_pulling_never_gets_a_pod_and_left_over_pull_pods_are_collected():
    env = Env(_dep(replicas={"min": 0, "max": 2, "initial": 1}), nodes=[node("cpu-a", cpu=4), node("cpu-b", cpu=4)])
    # pods an earlier operator left: a finished pull, and one on a node that is gone
    done = pull_pod_manifest("cpu-b", "other:1", fleet_id="fleet", settings=env.backend.settings)
    env.store.create(PODS, NS, done)
    env.store.patch_status(PODS, NS, done["metadata"]["name"], {"status": {"phase": "Succeeded"}})
    env.store.create(PODS, NS, pull_pod_manifest("gone", IMAGE, fleet_id="fleet", settings=env.backend.settings))
    await env.c.start(None)
    await env.tick()
    assert [pod_node(p) for p in env.pull_pods().values()] in (["cpu-a"], ["cpu-b"])
    env.c.set_desired("chat", 0)
    await env.tick(n=2)
    assert env.status() == {"chat-0": S.TERMINATED}
    env.kubelet()
    await env.tick()
    assert env.pods() == {}       # the pull finished and its pod went; no engine pod was created
    assert not any(n.startswith("chat-") for n in env.created_pods())


async def test_selector_wide_pre_pull_covers_matching_nodes_a_bounded_number_at_once():
    gpu = {"pool": "gpu"}
    nodes = [node(f"g{i}", labels=gpu) for i in range(3)] + [node("other"), node("g-cordoned", labels=gpu,
                                                                                 unschedulable=True)]  # fmt: skip
    ld = _dep(replicas={"min": 0, "max": 2, "initial": 0}, prePull={"nodeSelector": gpu, "maxParallel": 2})
    env = Env(ld, nodes=nodes)
    env.backend.set_pre_pull([ld.deployment])
    most = 0
    for _ in range(6):
        await env.backend.observe()
        pulling = env.pull_pods()
        most = max(most, len(pulling))
        env.kubelet()
    assert most == 2
    pulled = {n for n, _ in env.puller.pulls}
    assert pulled == {"g0", "g1", "g2"}                      # not the unlabelled or the cordoned node
    assert env.pull_pods() == {}


# ----- a warm node, the settings, the operator ------------------------------------------------------


async def test_the_backend_places_on_the_warm_node_and_creates_its_pod_at_once():
    ld = _dep(model={"name": "m", "source": SOURCE}, engine={"kind": "vllm", "image": IMAGE},
              resources={"accelerator": "gpu", "tensorParallelSize": 1})
    env = Env(ld, nodes=[node("a-cold", cpu=8, gpus=8), node("b-warm", cpu=8, gpus=8, images=[IMAGE],
                                                              annotations={ANNOTATION: SOURCE})])  # fmt: skip
    await env.c.start(None)
    await env.tick()
    assert env.created_pods() == ["chat-0"] and pod_node(env.engine_pods()["chat-0"]) == "b-warm"


def test_bad_pre_pull_settings_name_the_key():
    with pytest.raises(ValueError, match="prePull.attempts"):
        EnginePodSettings.from_json('{"prePull": {"attempts": 0}}')
    s = EnginePodSettings.from_json('{"prePull": {"enabled": false, "timeoutSeconds": 60}}')
    assert not s.pre_pull and s.pre_pull_timeout_s == 60


def test_a_bad_pre_pull_spec_is_refused_naming_the_field():
    from fleet.spec import SpecError

    with pytest.raises(SpecError, match=r"spec.prePull.maxParallel"):
        _dep(prePull={"maxParallel": 0})
    with pytest.raises(SpecError, match=r"spec.prePull.nodeSelector.bad key: is not a Kubernetes label key"):
        _dep(prePull={"nodeSelector": {"bad key": "x"}})


async def test_nothing_pulls_when_pre_pull_is_off():
    env = Env(_dep(), nodes=[node("cpu-a", cpu=4)], settings=EnginePodSettings(default_image="x", pre_pull=False))
    await env.c.start(None)
    await env.tick()
    assert env.created_pods() == ["chat-0"]
    await asyncio.sleep(0)


async def test_the_operator_pre_pulls_a_resources_image_onto_the_nodes_its_selector_names():
    import copy

    from tests.unit.test_k8s_operator import CR, Env as OperatorEnv

    env = OperatorEnv()
    for name in ("g0", "g1"):
        env.store.create(NODES, None, node(name, labels={"pool": "gpu"}))
    op = env.operator("op-a")
    puller = ImagePuller()
    try:
        cr = copy.deepcopy(CR)
        cr["spec"]["replicas"] = {"min": 0, "max": 2, "initial": 0}
        cr["spec"]["prePull"] = {"nodeSelector": {"pool": "gpu"}, "maxParallel": 1}
        env.store.create(INFERENCE_DEPLOYMENTS, NS, cr)
        await env.start_informers(op)
        pulled_at = []
        for _ in range(6):
            await env.tick(op)
            pulls = {pod_node(p) for p in env.store.list(PODS, NS, None)[0] if is_pull_pod(p)}
            schedule(env.store)
            assert len(pulls) <= 1                                  # maxParallel
            for p in env.store.list(PODS, NS, None)[0]:
                if is_pull_pod(p) and puller.sync(env.store, NS, p["metadata"]["name"]) == "pulled":
                    pulled_at.append(pod_node(p))
        assert sorted(pulled_at) == ["g0", "g1"]                   # the operator's default image, not cpu-a
        assert {n for n, image in puller.pulls} == {"g0", "g1"} and {i for _, i in puller.pulls} == {"fleet:1"}
        assert not [p for p in env.store.list(PODS, NS, None)[0] if is_pull_pod(p)]
    finally:
        await env.close()


async def test_a_replica_waiting_for_its_image_on_a_lost_node_fails_and_is_replaced_elsewhere():
    env = Env(_dep(), nodes=[node("cpu-a", cpu=4), node("cpu-b", cpu=4, images=[IMAGE])])
    # cpu-b is warm for the image only (no weights annotation): placement may pick either; force cpu-a
    env.store.patch(NODES, None, "cpu-b", {"spec": {"unschedulable": True}})
    await env.c.start(None)
    await env.tick()
    assert [pod_node(p) for p in env.pull_pods().values()] == ["cpu-a"]
    env.store.patch(NODES, None, "cpu-b", {"spec": {"unschedulable": False}})
    env.store.delete(NODES, None, "cpu-a")
    await env.tick()
    r = env.c.replicas["chat-0"]
    assert r.status is S.FAILED_START and "node cpu-a was lost" in r.failure.reason
    await env.tick(seconds=6)
    assert env.pull_pods() == {} and pod_node(env.engine_pods()["chat-1"]) == "cpu-b"


async def test_the_stand_in_kubelet_pulls_in_steps_and_fails_unpullable_images():
    kube = FakeKube()
    kube.store.create(NODES, None, node("n1"))
    puller = ImagePuller(steps=3, unpullable={"nope:1"})
    kube.store.create(PODS, NS, pull_pod_manifest("n1", IMAGE, fleet_id="fleet", settings=EnginePodSettings()))
    name = pull_pod_name("n1", IMAGE)
    assert puller.sync(kube.store, NS, name) == "unbound"        # until the scheduler binds it
    schedule(kube.store)
    assert [puller.sync(kube.store, NS, name) for _ in range(3)] == ["pulling", "pulling", "pulled"]
    assert pod_pull_state(kube.store.get(PODS, NS, name))[0] is PodPull.PULLED
    assert image_aliases(IMAGE) <= node_images(kube.store.get(NODES, None, "n1"))
    kube.store.create(PODS, NS, pull_pod_manifest("n1", "nope:1", fleet_id="fleet", settings=EnginePodSettings()))
    bad = pull_pod_name("n1", "nope:1")
    schedule(kube.store)
    assert puller.sync(kube.store, NS, bad) == "failed"
    assert pod_pull_state(kube.store.get(PODS, NS, bad))[0] is PodPull.FAILED
    assert puller.pulls == {("n1", IMAGE): 1}


async def test_a_selector_wide_pull_that_fails_is_an_event_on_its_deployment_only_for_its_nodes():
    ld = _dep(replicas={"min": 0, "max": 2, "initial": 0}, prePull={"nodeSelector": {"pool": "gpu"}})
    other = _dep("other", replicas={"min": 0, "max": 2, "initial": 0}, prePull={"nodeSelector": {"pool": "cpu"}})
    env = Env(ld, other, nodes=[node("g0", labels={"pool": "gpu"}), node("c0", labels={"pool": "cpu"}, images=[IMAGE])],
              puller=ImagePuller(unpullable={IMAGE}))  # fmt: skip
    env.backend.set_pre_pull([ld.deployment, other.deployment])
    await env.backend.observe()
    assert [pod_node(p) for p in env.pull_pods().values()] == ["g0"]
    env.kubelet()
    env.clock.advance(1)
    await env.backend.observe()
    events = env.events("ImagePullFailed")
    assert [e["involvedObject"]["name"] for e in events] == ["chat"]        # not "other": c0 holds the image
    assert "node g0" in events[0]["message"] and "ErrImagePull" in events[0]["message"]
    assert env.backend.prepuller.policy.record("g0", IMAGE).retry_at_s == env.clock() + 10


def test_a_success_resets_the_failure_count_and_an_adopted_pod_times_out_from_adoption():
    clock = FakeClock(0.0)
    policy = PrePullPolicy(clock, timeout_s=100)
    key = ("n1", IMAGE)
    wanted, images = {key: None}, {"n1": frozenset()}
    policy.step(wanted, images, {})
    policy.step(wanted, images, {key: _pod({"waiting": {"reason": "ErrImagePull"}})})
    assert policy.record(*key).failures == 1
    clock.advance(10)
    assert policy.step(wanted, images, {}).create == [key]
    policy.step(wanted, images, {key: _pod({"terminated": {"exitCode": 0}}, "Succeeded", "sha256:1")})
    rec = policy.record(*key)
    assert rec.phase is Pull.PRESENT and rec.failures == 0 and policy.present("n1", IMAGE, ())
    # a fresh policy (an operator restart) adopts a pod still pulling; its timeout starts now
    clock.advance(1000)
    fresh = PrePullPolicy(clock, timeout_s=100)
    assert fresh.step(wanted, images, {key: _pod()}).delete == []
    clock.advance(99)
    assert fresh.step(wanted, images, {key: _pod()}).delete == []
    clock.advance(1)
    assert fresh.step(wanted, images, {key: _pod()}).delete == ["p"]


# ----- the engine pods' pull policy ------------------------------------------------------------

async def test_engine_pods_run_the_pre_pulled_image_if_not_present_by_default():
    # `:latest` would default to Always at the API server: asked of the registry at every start.
    latest = "registry.example.com/fleet/engine:latest"
    env = Env(_dep(engine={"kind": "sim", "image": latest}), nodes=[node("cpu-a", cpu=4)])
    await env.c.start(None)
    await env.tick()
    env.kubelet()                      # the pre-pull
    await env.tick()
    pod = env.engine_pods()["chat-0"]
    assert pod["spec"]["containers"][0]["imagePullPolicy"] == "IfNotPresent"
    kubernetes_validate.validate(pod, "1.30", strict=True)
    env.kubelet()
    await env.tick(n=3)
    assert env.status() == {"chat-0": S.READY}
    assert env.puller.pulls == {("cpu-a", latest): 1}             # the engine pod pulled nothing more


async def test_always_pulls_at_every_pod_start_after_the_pre_pull_landed_the_image():
    env = Env(_dep(engine={"kind": "sim", "image": IMAGE, "imagePullPolicy": "Always"}), nodes=[node("cpu-a", cpu=4)])
    await env.c.start(None)
    await env.tick()
    assert len(env.pull_pods()) == 1
    env.kubelet()
    await env.tick()
    assert env.engine_pods()["chat-0"]["spec"]["containers"][0]["imagePullPolicy"] == "Always"
    env.kubelet()
    await env.tick(n=3)
    assert env.status() == {"chat-0": S.READY}
    assert env.puller.pulls == {("cpu-a", IMAGE): 2}              # the pre-pull, then the pod's own


async def test_never_pre_pulls_nothing_and_a_node_without_the_image_fails_the_replica_saying_so():
    env = Env(_dep(engine={"kind": "sim", "image": IMAGE, "imagePullPolicy": "Never"}),
              nodes=[node("cpu-a", cpu=4)])  # fmt: skip
    await env.c.start(None)
    await env.tick()
    assert env.created_pods() == ["chat-0"] and env.pull_pods() == {}
    env.kubelet()
    await env.tick()
    replica = env.c.replicas["chat-0"]
    assert replica.status is S.FAILED_START and replica.failure is not None, replica
    assert "ErrImageNeverPull" in replica.failure.reason and env.puller.pulls == {}


async def test_never_on_a_node_that_holds_the_image_starts_at_once():
    env = Env(_dep(engine={"kind": "sim", "image": IMAGE, "imagePullPolicy": "Never"}),
              nodes=[node("cpu-a", cpu=4, images=[IMAGE])])  # fmt: skip
    await env.c.start(None)
    await env.tick()
    env.kubelet()
    await env.tick(n=3)
    assert env.status() == {"chat-0": S.READY} and env.puller.pulls == {}


def test_the_pull_policy_is_outside_the_serving_hash_and_a_bad_one_names_the_field():
    base = _dep(engine={"kind": "sim", "image": IMAGE})
    for policy in ("Always", "Never", "IfNotPresent"):
        assert _dep(engine={"kind": "sim", "image": IMAGE, "imagePullPolicy": policy}).serving_hash == base.serving_hash
    with pytest.raises(SpecError, match=r"engine\.imagePullPolicy: Input should be 'IfNotPresent', 'Always' or 'Never'"):
        _dep(engine={"kind": "sim", "image": IMAGE, "imagePullPolicy": "Sometimes"})
