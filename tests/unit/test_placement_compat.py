"""Driver/CUDA compatibility (fleet/placement/compat.py, fleet/engines/cuda.py) and placement's node
filter: known images' CUDA, NVIDIA's backward and minor version compatibility rules, nodes
skipped with the reason in the plan and in `fleet plan`, the driver from NVML (the real H100
reading), GFD labels, inventory files and the node agent."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleet.agent.nvml_health import NvmlHealthReader
from fleet.cli import app
from fleet.engines.cuda import image_cuda, parse_cuda_version
from fleet.inventory.file import InventoryError, parse_inventory
from fleet.inventory.model import NodeInventory
from fleet.inventory.gfd import cuda_driver_version, driver_version, node_from_k8s
from fleet.inventory.nvml import node_from_nvml
from fleet.k8s.client import NODES
from fleet.k8s.node_facts import (CUDA_DRIVER_VERSION_LABEL, DRIVER_VERSION_LABEL, NodeFacts, NodeFactsPublisher,
                                  node_facts, node_facts_patch)  # fmt: skip
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from fleet.placement.compat import CudaNeed, driver_cuda, incompatibility, node_reason
from fleet.placement.candidates import eligible_nodes
from fleet.spec import parse_document
from fleet.testing.fake_nvml import FakePynvml, nvswitch_8gpu, real_h100_snapshot
from fleet.testing.k8s.nodes import node as k8s_node
from tests.support.fake_kube import FakeKube
from tests.support.inventories import H100, cluster, node

REAL = node_from_nvml(real_h100_snapshot(), "h100-vm")   # driver 580.159.04, nvmlSystemGetCudaDriverVersion 13000
runner = CliRunner()


# ----- versions and images ---------------------------------------------------------------------

@pytest.mark.parametrize("value, version", [("12.8", (12, 8)), (" 13.0 ", (13, 0)), (13000, (13, 0)),
                                            (12080, (12, 8)), (12020, (12, 2)), ((12, 9), (12, 9))])
def test_cuda_versions_parse_from_text_nvml_integers_and_tuples(value, version):
    assert parse_cuda_version(value) == version


@pytest.mark.parametrize("value", ["12", "12.8.1", "cuda12.8", "", 12, True, -1, 1.5])
def test_a_bad_cuda_version_is_refused_saying_what_it_is(value):
    with pytest.raises(ValueError, match="is not a CUDA version"):
        parse_cuda_version(value)


@pytest.mark.parametrize("image, cuda", [
    ("vllm/vllm-openai:v0.11.0", (12, 8)),             # examples/gpu-tp2.yaml's image
    ("vllm/vllm-openai:v0.9.0", (12, 8)),
    ("vllm/vllm-openai:v0.8.5", (12, 4)),
    ("vllm/vllm-openai:v0.4.3", (12, 4)),
    ("vllm/vllm-openai:v0.4.2", (12, 1)),
    ("vllm/vllm-openai:v0.12.0", (12, 9)),
    ("vllm/vllm-openai:v0.20.2", (13, 0)),             # the unsuffixed tag is cu130 from v0.20
    ("docker.io/vllm/vllm-openai:v0.20.2-cu129", (12, 9)),
    ("vllm/vllm-openai:latest-cu130", (13, 0)),
    ("vllm/vllm-openai:v0.22.0-cu129-ubuntu2404", (12, 9)),
    ("registry.example.com/team/engine:2.1-cu118", (11, 8)),
    ("nvidia/cuda:12.4.1-runtime-ubuntu22.04", (12, 4)),
    ("vllm/vllm-openai:latest", None),                 # a moving tag: the spec says it
    ("vllm/vllm-openai@sha256:" + "a" * 64, None),
    ("vllm/vllm-openai:v0.3.3", None),
    ("registry.example.com/team/engine:v1", None),
    ("localhost:5000/vllm/vllm-openai", None),
    (None, None),
])
def test_known_engine_images_map_to_the_cuda_they_were_built_with(image, cuda):
    assert image_cuda(image) == cuda


# ----- the rules ---------------------------------------------------------------------------------

@pytest.mark.parametrize("driver, cuda, supports", [
    ("580.159.04", (13, 0), (13, 0)),    # NVML's own reading wins
    ("580.159.04", None, (13, 0)),       # derived from the release notes' table
    ("535.104.05", None, (12, 2)),
    ("550.54.14", None, (12, 4)),
    ("550.54.13", None, (12, 3)),
    ("470.82.01", None, (11, 4)),
    ("440.33", None, None),              # before CUDA 11: not judged
    (None, None, None),
    ("garbage", None, None),
])
def test_a_drivers_cuda_is_nvmls_or_derived_from_its_version(driver, cuda, supports):
    assert driver_cuda(driver, cuda) == supports


def test_the_real_h100_runs_cuda_12_and_13_images():
    assert (REAL.driver_version, REAL.cuda_driver_version) == ("580.159.04", (13, 0))
    for version in ((12, 4), (12, 8), (13, 0)):
        assert node_reason(REAL, CudaNeed(version)) is None
    # CUDA 13.1 on R580: minor version compatibility, unless the engine is held to backward compatibility
    assert node_reason(REAL, CudaNeed((13, 1))) is None
    assert node_reason(REAL, CudaNeed((13, 1), "engine.cudaVersion", minor_version_ok=False)) == (
        "driver 580.159.04 supports CUDA up to 13.0, the engine needs CUDA 13.1 (engine.cudaVersion) "
        "(engine.cudaCompatibility: backward)")


def test_minor_version_compatibility_holds_within_a_major_from_its_minimum_driver():
    need = CudaNeed((12, 8), "image vllm/vllm-openai:v0.11.0")
    assert incompatibility(need, "535.104.05", (12, 2)) is None          # R535 >= 525.60.13
    assert incompatibility(need, "525.60.13", None) is None
    assert incompatibility(need, "520.61.05", None) == (
        "driver 520.61.05 supports CUDA up to 11.8, the engine needs CUDA 12.8 (image vllm/vllm-openai:v0.11.0): "
        "CUDA 12.x needs driver >= 525.60.13")


def test_a_new_major_needs_its_own_drivers_branch():
    need = CudaNeed((13, 0), "image vllm/vllm-openai:v0.20.2")
    assert incompatibility(need, "575.57.08", (12, 9)) == (
        "driver 575.57.08 supports CUDA up to 12.9, the engine needs CUDA 13.0 (image vllm/vllm-openai:v0.20.2): "
        "CUDA 13.x needs driver >= 580.65.06")
    assert incompatibility(need, "580.65.06", None) is None


def test_backward_compatibility_alone_when_the_spec_says_so():
    need = CudaNeed((12, 8), "engine.cudaVersion", minor_version_ok=False)
    assert "engine.cudaCompatibility: backward" in incompatibility(need, "535.104.05", (12, 2))
    assert incompatibility(need, "570.124.06", (12, 8)) is None
    assert incompatibility(need, "580.159.04", (13, 0)) is None          # backward compatibility


def test_an_unknown_driver_or_a_node_without_gpus_is_not_judged():
    need = CudaNeed((13, 0))
    assert incompatibility(need, None, None) is None
    assert node_reason(node("no-driver"), need) is None
    assert node_reason(NodeInventory("cpu-only", cpu_cores=(0, 1), driver_version="440.33"), need) is None


# ----- placement skips the nodes and says why ------------------------------------------------------

OLD = dict(driver_version="535.104.05", cuda_driver_version=(12, 2))
NEW = dict(driver_version="580.159.04", cuda_driver_version=(13, 0))


def _deployment(image="vllm/vllm-openai:v0.20.2", replicas=2, **engine):
    return parse_document({
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "chat"},
        "spec": {"model": {"name": "m", "source": "hf://org/m"}, "engine": {"image": image, **engine},
                 "resources": {"gpuProduct": H100, "tensorParallelSize": 4},
                 "replicas": {"min": replicas, "max": replicas}}})  # fmt: skip


def test_placement_skips_nodes_whose_driver_cannot_run_the_engine_and_says_why():
    inv = cluster(node("old-0", **OLD), node("old-1", **OLD), node("new-0", **NEW), node("unknown-0"))
    request = PlacementRequest.for_deployment(_deployment(), 4)
    assert request.cuda == CudaNeed((13, 0), "image vllm/vllm-openai:v0.20.2", True)
    plan = get_strategy().place_replicas(request, inv, Counter())
    assert sorted(n for p in plan.placements for n in p.nodes) == ["new-0", "new-0", "unknown-0", "unknown-0"]
    reason = ("driver 535.104.05 supports CUDA up to 12.2, the engine needs CUDA 13.0 "
              "(image vllm/vllm-openai:v0.20.2): CUDA 13.x needs driver >= 580.65.06")
    assert [(c.reason, c.nodes) for c in plan.skipped] == [(reason, ("old-0", "old-1"))]
    more = get_strategy().place_replicas(PlacementRequest.for_deployment(_deployment(), 1), inv,
                                         Counter(d for p in plan.placements for d in p.devices))
    assert not more.complete and f"2 nodes: {reason} [old-0, old-1]" in more.explain()


def test_the_same_image_on_cuda_12_runs_on_the_old_driver():
    inv = cluster(node("old-0", **OLD))
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(_deployment("vllm/vllm-openai:v0.11.0"), 2),
                                         inv, Counter())
    assert plan.complete and not plan.skipped
    strict = _deployment("vllm/vllm-openai:v0.11.0", cudaCompatibility="backward")
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(strict, 1), inv, Counter())
    assert not plan.complete and "engine.cudaCompatibility: backward" in plan.explain()


def test_engine_cuda_version_overrides_the_image_and_the_simulator_needs_none():
    override = _deployment("registry.example.com/team/engine:v1", cudaVersion="13.0")
    assert PlacementRequest.for_deployment(override, 1).cuda == CudaNeed((13, 0), "engine.cudaVersion", True)
    assert PlacementRequest.for_deployment(_deployment("registry.example.com/team/engine:v1"), 1).cuda is None
    sim = _deployment(None, kind="sim")
    assert PlacementRequest.for_deployment(sim, 1).cuda is None


def test_the_eligible_view_is_kept_per_inventory_so_slot_tables_are_reused():
    inv = cluster(node("old-0", **OLD), node("new-0", **NEW))
    request = PlacementRequest(ReplicaShape(gpu_product=H100), cuda=CudaNeed((13, 0)))
    view, skipped = eligible_nodes(request, inv)
    assert [n.name for n in view.nodes] == ["new-0"] and skipped[0].nodes == ("old-0",)
    assert eligible_nodes(request, inv)[0] is view                              # same object: tables reused
    assert eligible_nodes(PlacementRequest(ReplicaShape(gpu_product=H100), cuda=CudaNeed((12, 8))), inv)[0] is inv
    assert eligible_nodes(PlacementRequest(ReplicaShape(gpu_product=H100)), inv)[0] is inv


def test_fleet_plan_says_which_nodes_it_skipped_and_why(tmp_path: Path):
    spec = tmp_path / "chat.yaml"
    spec.write_text(json.dumps({
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "chat"},
        "spec": {"model": {"name": "m", "source": "hf://org/m"}, "engine": {"image": "vllm/vllm-openai:v0.20.2"},
                 "resources": {"gpuProduct": H100}, "replicas": {"min": 1, "max": 1}}}))
    inventory = tmp_path / "inv.yaml"
    inventory.write_text(json.dumps({"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "Inventory",
                                     "metadata": {"name": "x"}, "nodes": [
        {"name": "old", "gpuCount": 8, "gpuProduct": H100, "gpuMemoryMib": 81559, "nvswitch": True,
         "driverVersion": "535.104.05"},
        {"name": "new", "gpuCount": 8, "gpuProduct": H100, "gpuMemoryMib": 81559, "nvswitch": True,
         "driverVersion": "580.159.04", "cudaDriverVersion": "13.0"}]}))  # fmt: skip
    result = runner.invoke(app, ["plan", str(spec), "--inventory", str(inventory)])
    assert result.exit_code == 0, result.output
    assert "engine needs CUDA 13.0 (image vllm/vllm-openai:v0.20.2)" in result.output
    assert "skipped 1 node: driver 535.104.05 supports CUDA up to 12.2" in result.output
    assert "replica 0: new" in result.output
    data = json.loads(runner.invoke(app, ["plan", str(spec), "--inventory", str(inventory), "--json"]).output)[0]
    assert data["cuda"] == {"version": "13.0", "source": "image vllm/vllm-openai:v0.20.2",
                            "minorVersionCompatibility": True}
    assert data["skipped"][0]["nodes"] == ["old"]


# ----- where the driver comes from -------------------------------------------------------------------

def test_nvml_discovery_reads_the_driver_and_its_cuda_and_tolerates_their_absence():
    snap = nvswitch_8gpu()
    assert node_from_nvml(snap, "n").cuda_driver_version == (13, 0)
    del snap["cuda_driver_version"]
    snap["driver_version"] = {"error": "Not Supported"}
    n = node_from_nvml(snap, "n")
    assert (n.driver_version, n.cuda_driver_version) == (None, None)
    assert "driver 580.159.04 (CUDA 13.0)" in REAL.describe()


def test_gfd_labels_give_the_driver_current_then_deprecated_spelling_then_the_agents():
    current = {"nvidia.com/cuda.driver-version.full": "580.95.05", "nvidia.com/cuda.runtime-version.major": "13",
               "nvidia.com/cuda.runtime-version.minor": "0", "nvidia.com/cuda.driver.major": "1"}
    assert (driver_version(current), cuda_driver_version(current)) == ("580.95.05", (13, 0))
    old = {"nvidia.com/cuda.driver.major": "535", "nvidia.com/cuda.driver.minor": "104",
           "nvidia.com/cuda.driver.rev": "05", "nvidia.com/cuda.runtime.major": "12",
           "nvidia.com/cuda.runtime.minor": "2"}
    assert (driver_version(old), cuda_driver_version(old)) == ("535.104.05", (12, 2))
    agent = {DRIVER_VERSION_LABEL: "570.124.06", CUDA_DRIVER_VERSION_LABEL: "12.8"}
    assert (driver_version(agent), cuda_driver_version(agent)) == ("570.124.06", (12, 8))
    bad = {DRIVER_VERSION_LABEL: "new", CUDA_DRIVER_VERSION_LABEL: "twelve"}
    assert (driver_version(bad), cuda_driver_version(bad)) == (None, None)
    n = node_from_k8s(k8s_node("gpu-a", gpus=8, labels=old))
    assert (n.driver_version, n.cuda_driver_version) == ("535.104.05", (12, 2))


def test_the_node_agent_publishes_the_driver_once_and_the_operator_reads_it():
    fake = FakePynvml(real_h100_snapshot())
    reader = NvmlHealthReader(fake)
    reader.open()
    assert (reader.driver_version, reader.cuda_driver_version) == ("580.159.04", (13, 0))
    reader.close()
    facts = node_facts({}, [], {}, [], None, reader.driver_version, reader.cuda_driver_version)
    assert node_facts_patch(facts)["metadata"]["labels"] == {DRIVER_VERSION_LABEL: "580.159.04",
                                                              CUDA_DRIVER_VERSION_LABEL: "13.0"}
    assert node_facts_patch(facts, facts) is None
    assert node_facts_patch(NodeFacts(None, "", None)) is not None and DRIVER_VERSION_LABEL not in str(
        node_facts_patch(NodeFacts(None, "", None)))                      # unknown: the label is left alone
    kube = FakeKube()
    kube.store.create(NODES, None, k8s_node("gpu-a", gpus=1))
    assert NodeFactsPublisher(kube, "gpu-a").publish_sync(facts)
    n = node_from_k8s(kube.store.get(NODES, None, "gpu-a"))
    assert (n.driver_version, n.cuda_driver_version) == ("580.159.04", (13, 0))


def test_a_reader_without_cuda_version_support_leaves_it_unknown():
    snap = real_h100_snapshot()
    del snap["cuda_driver_version"]
    reader = NvmlHealthReader(FakePynvml(snap))
    reader.open()
    assert (reader.driver_version, reader.cuda_driver_version) == ("580.159.04", None)
    reader.close()


def _inventory_doc(**fields):
    return {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "Inventory", "metadata": {"name": "x"},
            "nodes": [{"name": "a", "gpuCount": 1, "gpuProduct": H100, "gpuMemoryMib": 81559, **fields}]}


def test_inventory_files_carry_the_driver_and_refuse_bad_versions_naming_the_field():
    loaded = parse_inventory(_inventory_doc(driverVersion="580.159.04", cudaDriverVersion=13.0))
    assert (loaded.inventory.nodes[0].driver_version, loaded.inventory.nodes[0].cuda_driver_version) == (
        "580.159.04", (13, 0))
    with pytest.raises(InventoryError, match=r"nodes\[0\] \(a\)\.driverVersion: .*'580' is not an NVIDIA driver version"):
        parse_inventory(_inventory_doc(driverVersion="580"))
    with pytest.raises(InventoryError, match=r"nodes\[0\] \(a\)\.cudaDriverVersion: .*'13' is not a CUDA version"):
        parse_inventory(_inventory_doc(cudaDriverVersion="13"))


def test_the_ordered_products_example_falls_back_to_h100_for_cuda_13_and_keeps_a100_for_cuda_12():
    root = Path(__file__).resolve().parents[2]
    args = ["plan", str(root / "examples" / "ordered-products.yaml"),
            "--inventory", str(root / "examples" / "inventories" / "small-mixed.yaml"), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    cu13, cu12 = json.loads(result.output)
    assert cu13["product"] == H100 and {r["reason"].split(" supports")[0] for r in cu13["skipped"]} == {
        "driver 535.104.05", "driver 570.124.06"}
    assert cu12["product"] == "NVIDIA A100-SXM4-80GB" and cu12["skipped"] == []
