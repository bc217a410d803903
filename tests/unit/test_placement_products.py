"""Ordered GPU products: ``spec.resources.gpuProduct`` may list acceptable products in order of
preference; every replica of one revision runs on one of them (fleet/spec.py ResourcesSpec,
fleet/placement/shapes.py ReplicaShape, fleet/placement/candidates.py choose_product), and the
Kubernetes engine pod selects the chosen product (fleet/k8s/pods.py product_selector)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from fleet.controller.backend import ReplicaWant
from fleet.k8s.crd import spec_schema
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import pod_manifest
from fleet.placement import PlacementRequest, ReplicaPlacement, ReplicaShape, get_strategy
from fleet.placement.shapes import Assignment
from fleet.spec import LoadedDeployment, SpecError, parse_document
from tests.support.inventories import A100_80, H100, L40S, busy, cluster, node

GFD_H100 = "NVIDIA-H100-80GB-HBM3"


def _doc(resources: dict, **engine) -> dict:
    return {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "chat"},
            "spec": {"model": {"name": "m", "source": "hf://org/m"},
                     "engine": {"image": "vllm/vllm-openai:v0.11.0", **engine},
                     "resources": resources, "replicas": {"min": 1, "max": 8}}}


def _dep(resources: dict, **engine):
    return parse_document(_doc(resources, **engine))


# ----- the spec --------------------------------------------------------------------------------------

def test_gpu_product_is_a_name_or_an_ordered_list():
    assert _dep({"gpuProduct": H100}).spec.resources.gpu_products == (H100,)
    assert _dep({"gpuProduct": [H100, A100_80]}).spec.resources.gpu_products == (H100, A100_80)
    assert _dep({}).spec.resources.gpu_products == ()


@pytest.mark.parametrize("value, message", [
    ([], "gpuProduct: an empty list; name at least one product"),
    ([H100, GFD_H100], f"gpuProduct: '{GFD_H100}' at \\[1\\] is the same product as \\[0\\]"),
    ([H100, " "], "gpuProduct: an empty product name at \\[1\\]"),
    (7, "gpuProduct"),
])
def test_a_bad_product_list_is_refused_naming_the_field(value, message):
    with pytest.raises(SpecError, match=message):
        _dep({"gpuProduct": value})


def test_a_cpu_deployment_still_refuses_a_product_list():
    with pytest.raises(SpecError, match="gpuProduct: is a GPU setting"):
        _dep({"accelerator": "cpu", "gpuProduct": [H100]})


def test_the_list_round_trips_through_yaml_and_keeps_the_serving_hash_of_a_single_name(tmp_path: Path):
    dep = _dep({"gpuProduct": [H100, A100_80], "tensorParallelSize": 2})
    again = parse_document(yaml.safe_load(yaml.safe_dump(dep.model_dump(mode="json", by_alias=True))))
    assert again == dep
    # A single name dumps as before (no rollout of existing replicas on upgrade); the CUDA fields
    # placement checks drivers against change nothing served.
    one = LoadedDeployment(_dep({"gpuProduct": H100}), tmp_path / "a.yaml", 0)
    cuda = LoadedDeployment(_dep({"gpuProduct": H100}, cudaVersion="12.9", cudaCompatibility="backward"),
                            tmp_path / "a.yaml", 0)
    assert one.serving_hash == cuda.serving_hash
    assert one.deployment.spec.resources.model_dump(mode="json")["gpu_product"] == H100


def test_the_crd_keeps_a_name_or_a_list_and_leaves_the_check_to_the_operator():
    node = spec_schema()["properties"]["spec"]["properties"]["resources"]["properties"]["gpuProduct"]
    assert node["x-kubernetes-preserve-unknown-fields"] is True and "type" not in node
    assert "order of preference" in node["description"]


# ----- the shape ---------------------------------------------------------------------------------------

def test_the_shape_carries_the_tuple_and_the_single_name():
    assert ReplicaShape(gpu_product=H100).gpu_products == (H100,)
    assert ReplicaShape(gpu_products=(H100,)).gpu_product == H100
    two = ReplicaShape.of(_dep({"gpuProduct": [H100, A100_80]}))
    assert (two.gpu_product, two.gpu_products) == (None, (H100, A100_80))
    assert two.describe() == f"1 whole GPU of one of {H100}, {A100_80}"
    with pytest.raises(ValueError, match="disagrees"):
        ReplicaShape(gpu_product=H100, gpu_products=(A100_80,))


# ----- the choice ----------------------------------------------------------------------------------

TP4 = {"gpuProduct": [H100, A100_80], "tensorParallelSize": 4}


def _place(resources, inv, count, held=None, existing=()):
    request = PlacementRequest.for_deployment(_dep(resources), count, existing)
    return get_strategy().place_replicas(request, inv, held or Counter())


def test_the_first_listed_product_that_hosts_the_whole_batch_wins():
    inv = cluster(node("a100-0", product=A100_80), node("h100-0"), node("h100-1"))
    plan = _place(TP4, inv, 4)
    assert plan.complete and plan.product == H100
    assert {n for p in plan.placements for n in p.nodes} == {"h100-0", "h100-1"}


def test_a_later_product_when_the_first_cannot_host_the_batch():
    h100 = node("h100-0")
    inv = cluster(h100, node("a100-0", product=A100_80), node("a100-1", product=A100_80))
    plan = _place(TP4, inv, 3, held=busy(h100, 0, 1, 2, 3))   # one TP=4 left on H100, four on A100
    assert plan.complete and plan.product == A100_80
    assert all(p.product == A100_80 for p in plan.placements)  # one product per revision


def test_the_one_hosting_most_when_none_hosts_all_ties_by_list_order():
    h100, a100 = node("h100-0"), node("a100-0", product=A100_80)
    plan = _place(TP4, cluster(h100, a100), 3)                  # each hosts two
    assert plan.product == H100 and len(plan.placements) == 2
    plan = _place({**TP4, "gpuProduct": [A100_80, H100]}, cluster(h100, a100), 3)
    assert plan.product == A100_80


def test_existing_replicas_fix_the_product_even_when_a_preferred_one_is_free():
    inv = cluster(node("h100-0"), node("a100-0", product=A100_80))
    existing = ReplicaPlacement((Assignment("a100-0", tuple(f"GPU-a100-0-{i}" for i in range(4))),), A100_80)
    plan = _place(TP4, inv, 1, held=Counter(existing.devices), existing=(existing,))
    assert plan.complete and plan.product == A100_80 and plan.placements[0].nodes == ("a100-0",)


def test_when_no_listed_product_can_host_one_the_first_is_explained():
    inv = cluster(node("l40s-0", n=4, product=L40S, topology="pcie"))
    plan = _place(TP4, inv, 1)
    assert not plan.complete and plan.product == H100
    assert "1 node: other GPU product (NVIDIA L40S)" in plan.explain()


def test_a_product_is_spelled_as_the_inventory_spells_it():
    gfd = cluster(node("h100-0", product=GFD_H100))              # a Kubernetes inventory: GFD's label
    assert _place({"gpuProduct": H100, "tensorParallelSize": 2}, gfd, 1).product == GFD_H100
    assert _place({**TP4, "gpuProduct": [A100_80, H100]}, gfd, 1).product == GFD_H100


# ----- the engine pod selects it ---------------------------------------------------------------------

def _want(resources: dict, product: str | None, tmp_path: Path) -> ReplicaWant:
    ld = LoadedDeployment(_dep(resources), tmp_path / "chat.yaml", 0)
    placement = ReplicaPlacement((Assignment("gpu-a", ("gpu-a/gpu0",), {}, "gpu:0"),), product)
    return ReplicaWant("chat-0", ld.deployment, placement, ld.serving_hash, ld.base_dir)


def test_the_engine_pod_selects_the_revisions_product(tmp_path: Path):
    want = _want(TP4, GFD_H100, tmp_path)
    pod = pod_manifest(want, fleet_id="f", owner=None, settings=EnginePodSettings(node_selector={"pool": "gpu"}))
    assert pod["spec"]["nodeSelector"] == {"pool": "gpu", "nvidia.com/gpu.product": GFD_H100}
    # NVML's spelling is no label value; MIG pods are left alone (GFD's single strategy relabels them)
    assert "nodeSelector" not in pod_manifest(_want(TP4, H100, tmp_path), fleet_id="f", owner=None, settings=EnginePodSettings())["spec"]
    mig = _want({"gpuProduct": GFD_H100, "migProfile": "3g.40gb"}, GFD_H100, tmp_path)
    assert "nodeSelector" not in pod_manifest(mig, fleet_id="f", owner=None, settings=EnginePodSettings())["spec"]
    mine = EnginePodSettings(node_selector={"nvidia.com/gpu.product": "X"})
    assert pod_manifest(want, fleet_id="f", owner=None, settings=mine)["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "X"}


def test_a_listed_product_too_small_for_the_model_is_passed_over_for_the_next():
    import json

    from fleet.models import EngineMemorySettings, MemoryNeed, facts_from_config

    config = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs"
                         / "llama-3.1-70b-instruct.json").read_text())
    need = MemoryNeed(facts_from_config(config), EngineMemorySettings(max_model_len=8192), 4)
    inv = cluster(node("l40s-0", n=4, product=L40S, memory_mib=46068),
                  node("l4-0", n=4, product="NVIDIA L4", memory_mib=23034))
    shape = ReplicaShape(gpu_products=("NVIDIA L4", L40S), tensor_parallel_size=4)
    # Llama 3.1 70B at TP=4 needs ~33 GiB of weights a GPU: the preferred L4 (22.5 GiB) cannot hold it.
    plan = get_strategy().place_replicas(PlacementRequest(shape, memory=need), inv, Counter())
    assert plan.complete and plan.product == L40S
    assert get_strategy().place_replicas(PlacementRequest(shape), inv, Counter()).product == "NVIDIA L4"
    small = ReplicaShape(gpu_products=("NVIDIA L4",), tensor_parallel_size=4)
    plan = get_strategy().place_replicas(PlacementRequest(small, memory=need), inv, Counter())
    assert plan.product is None and "model does not fit NVIDIA L4" in plan.explain()
