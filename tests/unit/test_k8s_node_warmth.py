"""Node warmth on Kubernetes: what makes a node warm for a deployment, and how placement uses it
(fleet/inventory/gfd.py: ``Node.status.images``; fleet/k8s/node_facts.py: the node agent's
cached-sources annotation; the node images `fleet.k8s.backend` keeps per node version).

A real weight cache filled from the local hub stand-in (fleet/testing/hub_server.py) publishes
its sources through `NodeFactsPublisher` on the in-repo fake of the cluster wrapper
(tests/support/fake_kube.py); the raw client is made to fail. The image pre-pull itself is
tests/unit/test_k8s_prepull.py's."""

from __future__ import annotations

from collections import Counter

import pytest

from fleet.inventory import Inventory
from fleet.inventory.gfd import image_aliases, node_from_k8s, node_images
from fleet.k8s.backend import KubernetesBackend
from fleet.k8s.client import NODES
from fleet.k8s.node_facts import CACHED_ANNOTATION as ANNOTATION, NodeFacts, NodeFactsPublisher, cached_value
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.placement import PlacementRequest, get_strategy
from fleet.spec import InferenceDeployment, parse_document
from fleet.testing.k8s.nodes import node
from tests.support.fake_kube import FakeKube
from tests.support.fakes import FakeClock

NS = "fleet"
IMAGE = "registry.example.com/fleet/engine:1"
SOURCE = "hf://org/llama-8b"


def _vllm(source: str, resources: dict | None = None) -> InferenceDeployment:
    """A vLLM deployment named ``chat`` serving ``source`` from IMAGE (one CPU core unless
    ``resources``)."""
    spec = {"model": {"name": "m", "source": source}, "engine": {"kind": "vllm", "image": IMAGE},
            "resources": resources or {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 2},
            "warmup": {"requests": [{"kind": "completion", "prompt": "hi", "maxTokens": 2}]}}  # fmt: skip
    return parse_document({"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
                           "metadata": {"name": "chat"}, "spec": spec})  # fmt: skip


def test_node_images_and_the_agent_annotation_make_a_warm_node():
    obj = node("a", images=["vllm/vllm-openai:v0.11.0", "ubuntu"], annotations={ANNOTATION: f"{SOURCE},https://m/x.json"})
    cached = node_from_k8s(obj).cached
    assert {"docker.io/vllm/vllm-openai:v0.11.0", "vllm/vllm-openai:v0.11.0", "ubuntu", "ubuntu:latest",
            SOURCE, "https://m/x.json"} <= cached  # fmt: skip
    assert "vllm/vllm-openai:v0.12.0" not in cached
    assert image_aliases("nvcr.io/nvidia/x@sha256:ab") == {"nvcr.io/nvidia/x@sha256:ab"}


def test_placement_prefers_the_node_holding_the_image_and_the_weights():
    dep = _vllm(SOURCE, resources={"accelerator": "gpu", "tensorParallelSize": 1})
    warm = node("b", cpu=8, gpus=8, images=[IMAGE], annotations={ANNOTATION: SOURCE})
    image_only = node("a", cpu=8, gpus=8, images=[IMAGE])
    weights_only = node("c", cpu=8, gpus=8, annotations={ANNOTATION: SOURCE})
    inventory = Inventory(tuple(node_from_k8s(n) for n in (image_only, warm, weights_only)))
    request = PlacementRequest.for_deployment(dep, 1)
    assert [n.name for n in inventory.nodes if request.is_warm(n)] == ["b"]
    plan = get_strategy().place_replicas(request, inventory, Counter())
    assert plan.placements[0].nodes == ("b",)


@pytest.fixture()
def filled_cache(tmp_path, monkeypatch):
    """A real weight cache holding ``hf://org/llama-8b`` fetched from the local hub server."""
    from fleet.agent.cache import WeightCache
    from fleet.agent.transfer import RetryPolicy
    from fleet.testing.hub_server import HubRepo, HubServer

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    static = tmp_path / "static"
    static.mkdir()
    files = {"config.json": b'{"architectures": ["LlamaForCausalLM"]}', "model.safetensors": b"w" * 100_000}
    with HubServer({"org/llama-8b": HubRepo(files)}, static_root=static) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        cache = WeightCache(tmp_path / "cache", retry=RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0),
                            reserve_bytes=0)  # fmt: skip
        cache.ensure(SOURCE)
        yield cache


def _publish_cache(publisher: NodeFactsPublisher, cache) -> bool:
    return publisher.publish_sync(NodeFacts(None, cached_value(cache.cached_sources()), None))


def test_the_agent_annotation_round_trips_into_node_inventory(filled_cache):
    kube = FakeKube()
    kube.store.create(NODES, None, node("cpu-b", images=[IMAGE]))
    annotator = NodeFactsPublisher(kube, "cpu-b")
    _publish_cache(annotator, filled_cache)   # the agent's thread: no running event loop
    obj = kube.store.get(NODES, None, "cpu-b")
    assert obj["metadata"]["annotations"][ANNOTATION] == f"{SOURCE}@main"   # the cache's canonical form
    inv = node_from_k8s(obj)
    assert f"{SOURCE}@main" in inv.cached and IMAGE in inv.cached
    for source in (SOURCE, f"{SOURCE}@main"):   # as a deployment may write it
        dep = _vllm(source)
        assert PlacementRequest.for_deployment(dep, 1).is_warm(inv)
    other = _vllm("hf://org/other")
    assert not PlacementRequest.for_deployment(other, 1).is_warm(inv)
    _publish_cache(annotator, filled_cache)   # unchanged: no write
    assert annotator.patches == 1 and kube.calls["patch"] == 1
    filled_cache.remove(filled_cache.entries()[0].key)   # evicted: the annotation goes
    _publish_cache(annotator, filled_cache)
    assert ANNOTATION not in (kube.store.get(NODES, None, "cpu-b")["metadata"].get("annotations") or {})


def test_a_failed_annotation_is_logged_and_retried(filled_cache):
    kube = FakeKube()
    kube.store.create(NODES, None, node("cpu-b"))
    annotator = NodeFactsPublisher(kube, "cpu-b")
    kube.fail_next["patch"] = RuntimeError("connection refused")
    assert not _publish_cache(annotator, filled_cache)   # logged, not raised
    assert ANNOTATION not in (kube.store.get(NODES, None, "cpu-b")["metadata"].get("annotations") or {})
    _publish_cache(annotator, filled_cache)   # retried at the next step
    assert kube.store.get(NODES, None, "cpu-b")["metadata"]["annotations"][ANNOTATION] == f"{SOURCE}@main"


def test_the_annotation_value():
    assert cached_value(["b", "a", "a", "https://h/a,b.json"]) == "a,b"   # a source with a comma cannot be listed


def test_the_node_agent_calls_on_step_with_its_status(tmp_path):
    from fleet.agent.cache import WeightCache
    from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy
    from fleet.agent.runner import NodeAgent

    seen = []
    clock = FakeClock(0.0)
    agent = NodeAgent("cpu-b", None, QuarantinePolicy(QuarantineConfig(), clock), clock,
                      cache=WeightCache(tmp_path), on_step=seen.append)  # fmt: skip
    agent.step()
    assert seen and seen[-1]["node"] == "cpu-b" and seen[-1]["cache"] == []


def test_node_agent_annotate_node_without_a_cluster_says_so(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from fleet.cli import app

    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    r = CliRunner().invoke(app, ["node-agent", "--annotate-node", "--once", "--root", str(tmp_path / "cache"),
                                 "--node-name", "n1", "--metrics-port", "0"])  # fmt: skip
    assert r.exit_code == 2, r.output
    assert "--annotate-node: no cluster configuration" in r.output


async def test_node_images_are_parsed_once_per_node_version(monkeypatch):
    """`inventory` and `observe` both read the nodes every tick: a node's image list is parsed
    again only when its resourceVersion changed, and a pulled image is then seen."""
    import fleet.k8s.backend as backend_module

    parsed = Counter()

    def counting(obj):
        parsed[obj["metadata"]["name"]] += 1
        return node_images(obj)

    monkeypatch.setattr(backend_module, "node_images", counting)
    kube = FakeKube()
    kube.store.create(NODES, None, node("cpu-a"))
    backend = KubernetesBackend(kube, NS, "fleet-1", settings=EnginePodSettings(default_image=IMAGE))
    for _ in range(3):
        await backend.inventory()
        await backend.observe()
    assert parsed["cpu-a"] == 1 and backend._images["cpu-a"] == frozenset()
    obj = kube.store.get(NODES, None, "cpu-a")
    obj["status"]["images"] = [{"names": [IMAGE], "sizeBytes": 1}]
    kube.store.replace(NODES, None, "cpu-a", obj)                  # a new resourceVersion
    await backend.observe()
    assert parsed["cpu-a"] == 2 and IMAGE in backend._images["cpu-a"]
