"""Engine pods read the node weight cache and request CPU and memory (fleet/k8s/pod_weights.py,
fleet/k8s/pod_resources.py): the `weights` init container and its volumes, the command it runs (run here in-process against the
local hub stand-in: the linked path resolves to readable files inside the mounted cache root,
and the entry is pinned for the pod), `hf://org/name@rev` as `--revision` without a cache,
the resource formula, QoS never BestEffort, and the chart-shaped settings."""

from __future__ import annotations

import json
import os
from pathlib import Path

import kubernetes_validate
import pytest
from typer.testing import CliRunner

from fleet.agent.cache import WeightCache
from fleet.cli import app
from fleet.controller.backend import LaunchError
from fleet.k8s.pod_facts import pod_facts
from fleet.k8s.pod_resources import device_memory_gib, engine_resources
from fleet.k8s.pod_settings import EnginePodSettings, EngineResources
from fleet.k8s.pod_weights import MODEL_LINK
from fleet.k8s.pods import pod_group, pod_manifest
from fleet.placement import ReplicaPlacement
from fleet.placement.shapes import Assignment
from fleet.controller.backend import ReplicaWant
from tests.unit.test_cli_agent import FILES, hub  # noqa: F401 - the local hub stand-in fixture
from tests.unit.test_k8s_backend import _dep, _want

CACHE = "/var/lib/fleet/cache"
SETTINGS = EnginePodSettings(default_image="fleet:1", weight_cache_path=CACHE, fleet_image="fleet:1")


def _gpu(source="hf://org/tiny@v2", kind="vllm", tp=1, **resources):
    return _dep(model={"name": "tiny", "source": source}, engine={"kind": kind, "image": "vllm:1"},
                resources={"accelerator": "gpu", "tensorParallelSize": tp, **resources})


def _qos(pod: dict) -> str:
    """The pod's QoS class as the kubelet derives it (kubernetes.io/docs/tasks/configure-pod-container/quality-service-pod)."""
    containers = pod["spec"]["containers"] + pod["spec"].get("initContainers", [])
    res = [c.get("resources") or {} for c in containers]
    if not any(r.get("requests", {}).get(k) or r.get("limits", {}).get(k) for r in res for k in ("cpu", "memory")):
        return "BestEffort"
    if all(r.get("limits", {}).get(k) and r["limits"][k] == r.get("requests", {}).get(k, r["limits"][k])
           for r in res for k in ("cpu", "memory")):
        return "Guaranteed"
    return "Burstable"


@pytest.mark.parametrize("source", ["hf://org/tiny@v2", "https://models.example/tiny/", "http://h/m/fleet-manifest.json"])
def test_remote_sources_come_from_the_node_cache_through_an_init_container(source):
    pod = pod_manifest(_want(_gpu(source)), fleet_id="f", owner=None, settings=SETTINGS)
    spec = pod["spec"]
    [init] = spec["initContainers"]
    engine = spec["containers"][0]
    assert init["name"] == "weights" and init["image"] == "fleet:1"
    assert init["command"] == ["fleet", "cache", "pull", source, "--root", CACHE, "--link", MODEL_LINK,
                               "--holder", "$(POD_UID)"]
    assert {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}} in init["env"]
    assert init["securityContext"]["runAsUser"] == 10001 and init["securityContext"]["runAsNonRoot"] is True
    # DirectoryOrCreate: on a node without the agent the pod fails its pull (root-owned directory)
    # instead of waiting in FailedMount for ever
    assert {"name": "weight-cache", "hostPath": {"path": CACHE, "type": "DirectoryOrCreate"}} in spec["volumes"]
    assert any(v["name"] == "model" and "emptyDir" in v for v in spec["volumes"])
    # the whole cache root, read-only, at the same path: the entry's relative symlinks into ../../blobs resolve
    assert {"name": "weight-cache", "mountPath": CACHE, "readOnly": True} in engine["volumeMounts"]
    assert {"name": "weight-cache", "mountPath": CACHE} in init["volumeMounts"]
    cmd = engine["command"]
    assert cmd[:3] == ["vllm", "serve", MODEL_LINK] and "--revision" not in cmd
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    for version in ("1.30.0", "1.37.0"):
        kubernetes_validate.validate(pod, version, strict=True)


def test_without_a_cache_hf_revision_is_passed_as_revision_not_in_the_repo_id():
    pod = pod_manifest(_want(_gpu("hf://org/tiny@3f2c9a1")), fleet_id="f", owner=None, settings=EnginePodSettings())
    cmd = pod["spec"]["containers"][0]["command"]
    assert cmd[:3] == ["vllm", "serve", "org/tiny"]
    assert cmd[cmd.index("--revision") + 1] == "3f2c9a1" and "initContainers" not in pod["spec"]
    assert cmd[cmd.index("--served-model-name") + 1] == "tiny"
    plain = pod_manifest(_want(_gpu("hf://org/tiny")), fleet_id="f", owner=None, settings=EnginePodSettings())
    assert "--revision" not in plain["spec"]["containers"][0]["command"]


def test_sources_the_pod_cannot_reach_are_refused_with_the_reason():
    with pytest.raises(LaunchError, match="node weight cache"):
        pod_manifest(_want(_gpu("https://h/m/")), fleet_id="f", owner=None, settings=EnginePodSettings())
    with pytest.raises(LaunchError, match="cannot read it"):   # the cache has no S3 source yet
        pod_manifest(_want(_gpu("s3://bucket/m")), fleet_id="f", owner=None, settings=SETTINGS)
    with pytest.raises(LaunchError, match="fleetImage"):
        pod_manifest(_want(_gpu()), fleet_id="f", owner=None,
                     settings=EnginePodSettings(weight_cache_path=CACHE))


def test_the_simulator_reads_the_cache_too_and_sim_profiles_need_none():
    ld = _dep(model={"name": "tiny", "source": "hf://org/tiny@v2"})
    pod = pod_manifest(_want(ld), fleet_id="f", owner=None, settings=SETTINGS)
    assert pod["spec"]["initContainers"][0]["name"] == "weights"
    assert pod["spec"]["containers"][0]["command"][3:5] == ["--model", MODEL_LINK]
    pod = pod_manifest(_want(_dep()), fleet_id="f", owner=None, settings=SETTINGS)   # sim://
    assert "initContainers" not in pod["spec"]


def test_gang_members_each_fill_their_nodes_cache():
    ld = _gpu(tp=16)
    members = tuple(Assignment(n, tuple(f"{n}/gpu{i}" for i in range(8)), {}, "gpu:0-7") for n in ("a", "b"))
    want = ReplicaWant("tiny-0", ld.deployment, ReplicaPlacement(members, "NVIDIA-H100-80GB-HBM3"), ld.serving_hash,
                       ld.base_dir)
    pods = pod_group(want, fleet_id="f", owner=None, settings=SETTINGS)
    assert [p["spec"]["initContainers"][0]["name"] for p in pods] == ["weights", "weights"]
    for p in pods:
        req = p["spec"]["containers"][0]["resources"]["requests"]
        assert req["nvidia.com/gpu"] == "8" and req["cpu"] == "18" and req["memory"] == "92Gi"


def test_the_init_command_fills_the_cache_links_a_readable_model_and_pins_it(hub, tmp_path):  # noqa: F811
    root = tmp_path / "cache"
    root.mkdir()
    settings = EnginePodSettings(weight_cache_path=str(root), fleet_image="fleet:1")
    pod = pod_manifest(_want(_gpu("hf://org/tiny")), fleet_id="f", owner=None, settings=settings)
    argv = pod["spec"]["initContainers"][0]["command"][1:]
    link = tmp_path / "model" / "current"
    link.parent.mkdir()
    argv = [str(link) if a == MODEL_LINK else "pod-uid-1" if a == "$(POD_UID)" else a for a in argv]
    runner = CliRunner()
    for _ in range(2):   # a second pod on the node: no second download, the link is replaced
        r = runner.invoke(app, argv)
        assert r.exit_code == 0, r.output
    assert link.is_symlink() and Path(os.readlink(link)).is_absolute()
    target = Path(os.readlink(link))
    assert root in target.parents   # inside the mounted cache root
    for name, content in FILES.items():
        assert (link / name).read_bytes() == content
        inner = os.readlink(link / name)
        assert not os.path.isabs(inner) and inner.startswith("../../blobs/")
    [entry] = WeightCache(root).entries()
    assert entry.pinned_by == ("pod-uid-1",)
    assert len(hub.log.file_gets("model.safetensors")) == 1   # one download per node


# ----- resources ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tp,resources,product,cpu,memory", [
    (1, {}, "NVIDIA-H100-80GB-HBM3", "4", "15Gi"),          # 4 + (4 + 2 + 5)
    (2, {}, "NVIDIA-H100-80GB-HBM3", "6", "26Gi"),
    (8, {}, "NVIDIA-H100-80GB-HBM3", "18", "92Gi"),
    (1, {"migProfile": "1g.10gb"}, None, "4", "15Gi"),      # min(5, 0.9 x 10) = 5
    (1, {"migProfile": "1g.5gb"}, None, "4", "14848Mi"),    # min(5, 4.5): 4 + 4 + 2 + 4.5 GiB
])  # fmt: skip
def test_gpu_requests_follow_the_formula(tp, resources, product, cpu, memory):
    ld = _gpu(tp=tp, **resources)
    devices = ("a/gpu0",) if tp == 1 else tuple(f"a/gpu{i}" for i in range(tp))
    want = ReplicaWant("r-0", ld.deployment, ReplicaPlacement((Assignment("a", devices, {}, "gpu"),), product),
                       ld.serving_hash, ld.base_dir)
    res = engine_resources(want, EnginePodSettings())
    assert res["requests"]["cpu"] == cpu and res["requests"]["memory"] == memory
    assert "cpu" not in res["limits"] and "memory" not in res["limits"]   # Burstable: no CPU/memory limit


def test_swap_space_and_kv_cache_are_read_from_the_spec():
    ld = _dep(model={"name": "m", "source": "/m"}, engine={"kind": "vllm", "image": "v", "args": ["--swap-space", "16"]},
              resources={"accelerator": "gpu"})
    assert engine_resources(_want(ld), EnginePodSettings())["requests"]["memory"] == "27Gi"   # 4 + 16 + 2 + 5
    cpu = _dep(model={"name": "m", "source": "/m"}, engine={"kind": "vllm", "image": "v",
                                                             "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
               resources={"accelerator": "cpu", "cpuCores": 4})  # fmt: skip
    assert engine_resources(_want(cpu), EnginePodSettings())["requests"] == {"cpu": "4", "memory": "9Gi"}   # 4 + 1 + 4


def test_pods_are_never_best_effort_and_guaranteed_on_request():
    for ld in (_gpu(), _dep(), _gpu(tp=2), _dep(model={"name": "m", "source": "/m"}, engine={"kind": "vllm", "image": "v"},
                                                   resources={"accelerator": "cpu", "cpuCores": 2})):
        for settings in (EnginePodSettings(default_image="fleet:1"), SETTINGS):
            assert _qos(pod_manifest(_want(ld), fleet_id="f", owner=None, settings=settings)) == "Burstable"
    strict = EnginePodSettings(weight_cache_path=CACHE, fleet_image="fleet:1", resources=EngineResources(guaranteed=True))
    pod = pod_manifest(_want(_gpu(tp=2)), fleet_id="f", owner=None, settings=strict)
    assert _qos(pod) == "Guaranteed"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    kubernetes_validate.validate(pod, "1.37.0", strict=True)


def test_device_memory_from_the_mig_profile_or_the_product():
    assert device_memory_gib("3g.40gb", None) == 40
    assert device_memory_gib(None, "NVIDIA-H100-80GB-HBM3") == 80
    assert device_memory_gib(None, "NVIDIA A100-SXM4-40GB") == 40
    assert device_memory_gib(None, None) is None


def test_settings_from_the_charts_json_name_bad_keys():
    s = EnginePodSettings.from_json(json.dumps({
        "weightCache": {"hostPath": "/var/lib/fleet/cache/"}, "fleetImage": "reg/fleet:1",
        "resources": {"baseCpu": 1, "cpuPerGpu": 4, "guaranteed": True, "weightsMemory": "2Gi"}}))
    assert s.weight_cache_path == "/var/lib/fleet/cache" and s.fleet_image == "reg/fleet:1"
    assert s.resources.cpu_per_gpu == 4.0 and s.resources.guaranteed and s.resources.weights_memory == "2Gi"
    assert EnginePodSettings.from_json('{"weightCache": {"hostPath": ""}}').weight_cache_path == ""
    for bad, key in (({"weightCache": {"hostPath": "rel"}}, "weightCache.hostPath"),
                     ({"resources": {"cpuPerGpu": -1}}, "resources.cpuPerGpu"),
                     ({"resources": {"cpuPerGPU": 1}}, "resources.cpuPerGPU")):  # fmt: skip
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            EnginePodSettings.from_json(json.dumps(bad))


def test_facts_wait_for_the_weights_init_container_and_report_its_failure():
    pod = pod_manifest(_want(_gpu()), fleet_id="f", owner=None, settings=SETTINGS)
    pod["status"] = {"phase": "Pending", "initContainerStatuses": [{"name": "weights", "state": {"running": {}}}],
                     "containerStatuses": [{"name": "engine", "state": {"waiting": {"reason": "PodInitializing"}}}]}
    f = pod_facts(pod)
    assert not f.weights_present and not f.exited and "node cache" in f.detail["cache"]
    pod["status"]["initContainerStatuses"][0]["state"] = {"terminated": {"exitCode": 0}}
    assert pod_facts(pod).weights_present
    pod["status"] = {"phase": "Failed", "initContainerStatuses": [{"name": "weights", "state": {"terminated": {
        "exitCode": 1, "reason": "Error", "message": "hf://org/tiny@v2: revision 'v2' not found"}}}]}
    f = pod_facts(pod)
    assert f.exited and f.exit_code == 1 and "weights init container" in f.exit_reason and "not found" in f.exit_reason


def test_published_sources_are_redacted_and_placement_still_finds_them_warm():
    from fleet.inventory.model import NodeInventory
    from fleet.placement.shapes import PlacementRequest, ReplicaShape
    from fleet.sources import redact_source

    signed = "https://u:p@h.example/m/fleet-manifest.json?X-Amz-Signature=abc#f"
    assert redact_source(signed) == "https://h.example/m/fleet-manifest.json"
    assert redact_source("hf://gpt2@main") == "hf://gpt2@main" and redact_source("/models/x") == "/models/x"
    assert redact_source("s3://key:secret@bucket/path?x=1") == "s3://bucket/path"
    ld = _gpu(signed)
    request = PlacementRequest(ReplicaShape.of(ld.deployment), model_source=signed, image=None)
    assert request.warmth(NodeInventory("a", cached=frozenset({redact_source(signed)}))) == 3


@pytest.mark.parametrize("kind", ["vllm", "sim"])
def test_engines_publish_kv_events_on_declared_ports_and_facts_give_the_pod_ip(kind):
    pod = pod_manifest(_want(_gpu(kind=kind)), fleet_id="f", owner=None, settings=SETTINGS)
    engine = pod["spec"]["containers"][0]
    config = json.loads(engine["command"][engine["command"].index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": ""}   # wildcards: vLLM binds only those
    assert {"name": "kv-events", "containerPort": 5557, "protocol": "TCP"} in engine["ports"]
    assert {"name": "kv-replay", "containerPort": 5558, "protocol": "TCP"} in engine["ports"]
    kubernetes_validate.validate(pod, "1.37.0", strict=True)
    pod["status"] = {"phase": "Running", "podIP": "10.1.2.3",
                     "containerStatuses": [{"name": "engine", "imageID": "x", "state": {"running": {}}}]}
    assert pod_facts(pod).kv_events == {"publisher": "tcp://10.1.2.3:5557", "replay": "tcp://10.1.2.3:5558",
                                        "topic": ""}
    pod["status"]["podIP"] = "fd00::7"
    assert pod_facts(pod).kv_events["publisher"] == "tcp://[fd00::7]:5557"


def test_kv_events_can_be_switched_off_moved_or_left_to_the_engine_args():
    off = EnginePodSettings.from_json(json.dumps({"kvEvents": {"enabled": False}}), default_image="fleet:1")
    pod = pod_manifest(_want(_gpu()), fleet_id="f", owner=None, settings=off)
    assert "--kv-events-config" not in pod["spec"]["containers"][0]["command"]
    pod["status"] = {"phase": "Running", "podIP": "10.1.2.3",
                     "containerStatuses": [{"name": "engine", "imageID": "x", "state": {"running": {}}}]}
    assert pod_facts(pod).kv_events is None
    moved = EnginePodSettings.from_json(json.dumps({"kvEvents": {"port": 6000, "replayPort": 6001}}), "fleet:1")
    ports = pod_manifest(_want(_gpu()), fleet_id="f", owner=None, settings=moved)["spec"]["containers"][0]["ports"]
    assert [p["containerPort"] for p in ports] == [8000, 6000, 6001]
    own = _dep(model={"name": "tiny", "source": "hf://org/tiny"}, engine={
        "kind": "vllm", "image": "vllm:1", "args": ["--kv-events-config", '{"enable_kv_cache_events": false}']},
        resources={"accelerator": "gpu", "tensorParallelSize": 1})  # fmt: skip
    command = pod_manifest(_want(own), fleet_id="f", owner=None, settings=SETTINGS)["spec"]["containers"][0]["command"]
    assert command.count("--kv-events-config") == 1 and command[-1] == '{"enable_kv_cache_events": false}'
    # Another spelling vLLM's parser takes is the args' own config too; a data-parallel engine
    # publishes on ports offset per rank (rank 1 would bind rank 0's replay port): no Fleet config.
    for args in (["--kv_events_config.buffer_steps", "50000"], ["--data-parallel-size", "2"], ["-dp=4"]):
        dep = _dep(model={"name": "tiny", "source": "hf://org/tiny"}, engine={"kind": "vllm", "image": "vllm:1",
                   "args": args}, resources={"accelerator": "gpu", "tensorParallelSize": 1})  # fmt: skip
        pod = pod_manifest(_want(dep), fleet_id="f", owner=None, settings=SETTINGS)
        engine = pod["spec"]["containers"][0]
        assert "--kv-events-config" not in engine["command"] and [p["containerPort"] for p in engine["ports"]] == [8000]
        pod["status"] = {"phase": "Running", "podIP": "10.1.2.3",
                         "containerStatuses": [{"name": "engine", "imageID": "x", "state": {"running": {}}}]}
        assert pod_facts(pod).kv_events is None
    for bad, key in (({"kvEvents": {"port": 8000}}, "kvEvents.port"), ({"kvEvents": {"replayPort": 0}}, "replayPort"),
                     ({"kvEvents": {"port": 5558}}, "must differ"), ({"kvEvents": []}, "kvEvents")):  # fmt: skip
        with pytest.raises(ValueError, match=key):
            EnginePodSettings.from_json(json.dumps(bad))


@pytest.mark.parametrize("kind", ["vllm", "sim"])
def test_engines_report_their_prefix_cache_hit_in_usage_unless_the_args_already_ask(kind):
    # --enable-prompt-tokens-details: the router counts the engine's hit beside its prediction.
    command = pod_manifest(_want(_gpu(kind=kind)), fleet_id="f", owner=None, settings=SETTINGS)["spec"]["containers"][0]["command"]
    assert command.count("--enable-prompt-tokens-details") == 1
    own = _dep(model={"name": "tiny", "source": "hf://org/tiny"}, engine={
        "kind": kind, "image": "vllm:1", "args": ["--enable-prompt-tokens-details"]},
        resources={"accelerator": "gpu", "tensorParallelSize": 1})  # fmt: skip
    command = pod_manifest(_want(own), fleet_id="f", owner=None, settings=SETTINGS)["spec"]["containers"][0]["command"]
    assert command.count("--enable-prompt-tokens-details") == 1 and command[-1] == "--enable-prompt-tokens-details"
