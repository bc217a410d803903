"""Inventory from Kubernetes node objects labelled by GPU Feature Discovery (fleet.inventory.gfd)."""

from __future__ import annotations

import pytest

from fleet.inventory.gfd import LabelKeys, inventory_from_k8s, node_from_k8s, parse_nvlink_domains
from fleet.inventory.mig import MigSlot, check_geometry, mig_model_for
from fleet.inventory.model import product_key


def k8s_node(name: str, labels: dict[str, str], capacity: dict | None = None, allocatable: dict | None = None,
             annotations: dict | None = None) -> dict:
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": labels, "annotations": annotations or {}},
        "status": {"capacity": capacity or {}, "allocatable": allocatable or {}},
    }


HGX = {
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.memory": "81559",
    "nvidia.com/mig.strategy": "none",
    "topology.kubernetes.io/zone": "us-east-1a",
    "fleet.inference.dev/rack": "r12",
    "fleet.inference.dev/network-block": "b3",
    "fleet.inference.dev/nvlink-domains": "0-7",
}


def test_whole_gpus_failure_domains_and_topology_from_labels():
    node = node_from_k8s(k8s_node("gpu-1", HGX, capacity={"cpu": "96", "nvidia.com/gpu": "8"},
                                  allocatable={"nvidia.com/gpu": "8"},
                                  annotations={"fleet.inference.dev/cached": "vllm/vllm-openai:v0.11.0, hf://m/x"}))
    assert len(node.gpus) == 8
    assert {g.product_key for g in node.gpus} == {product_key("NVIDIA H100 80GB HBM3")}
    assert all(g.memory_mib == 81559 and g.health.healthy and not g.mig_enabled for g in node.gpus)
    assert len({g.uuid for g in node.gpus}) == 8
    assert (node.zone, node.rack, node.network_block) == ("us-east-1a", "r12", "b3")
    assert node.nvlink_domains == (tuple(range(8)),)
    assert len(node.cpu_cores) == 96
    assert node.cached == {"vllm/vllm-openai:v0.11.0", "hf://m/x"}


def test_without_the_topology_label_nvlink_is_unknown():
    labels = {k: v for k, v in HGX.items() if k != "fleet.inference.dev/nvlink-domains"}
    node = node_from_k8s(k8s_node("gpu-1", labels))
    assert node.nvlink_domains is None and not node.topology_known


def test_gpus_withheld_by_the_device_plugin_are_unhealthy():
    node = node_from_k8s(k8s_node("gpu-1", HGX, capacity={"nvidia.com/gpu": "8"}, allocatable={"nvidia.com/gpu": "6"}))
    sick = [g for g in node.gpus if not g.health.healthy]
    assert len(sick) == 2
    assert "device plugin" in sick[0].health.problems()[0]


def test_gpu_clique_is_the_multi_node_nvlink_fabric():
    node = node_from_k8s(k8s_node("gb200-1", {**HGX, "nvidia.com/gpu.clique": "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"}))
    assert node.nvlink_fabric == "7b968a6d-c8aa-45e1-9e07-e1e51be99c31.1"


def test_mixed_strategy_mig_counts_become_instances_in_a_valid_geometry():
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB", "nvidia.com/gpu.count": "4", "nvidia.com/gpu.memory": "40960",
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/mig-3g.20gb.count": "2", "nvidia.com/mig-2g.10gb.count": "1", "nvidia.com/mig-1g.5gb.count": "8",
        "nvidia.com/mig-3g.20gb.memory": "20096",
    }
    node = node_from_k8s(k8s_node("a100-mig", labels))
    migged = [g for g in node.gpus if g.mig_enabled]
    whole = [g for g in node.gpus if not g.mig_enabled]
    profiles = sorted(m.profile for g in migged for m in g.mig_instances)
    assert profiles == sorted(["3g.20gb"] * 2 + ["2g.10gb"] + ["1g.5gb"] * 8)
    assert len(migged) + len(whole) == 4
    model = mig_model_for("NVIDIA A100-SXM4-40GB")
    for g in migged:
        assert check_geometry(model, [MigSlot(m.profile, m.start) for m in g.mig_instances]) is None
    assert len(whole) >= 1


def test_single_strategy_describes_mig_devices_of_identical_gpus():
    labels = {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", "nvidia.com/gpu.count": "14",
        "nvidia.com/gpu.memory": "4864", "nvidia.com/mig.strategy": "single",
    }
    node = node_from_k8s(k8s_node("a100-single", labels))
    assert len(node.gpus) == 2 and all(g.mig_enabled for g in node.gpus)
    assert [len(g.mig_instances) for g in node.gpus] == [7, 7]
    assert {m.profile for g in node.gpus for m in g.mig_instances} == {"1g.5gb"}
    assert node.gpus[0].product == "NVIDIA-A100-SXM4-40GB"


@pytest.mark.parametrize("value, domains", [
    ("0-7", (tuple(range(8)),)),
    ("0-3_4-7", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("0.1_2.3", ((0, 1), (2, 3))),
    ("0.2-3_5", ((0, 2, 3), (5,))),
    ("none", ()),
    # the spelling with ';' and ',' (refused by a real API server) reads the same
    ("0-3;4-7", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("0,1;2,3", ((0, 1), (2, 3))),
])
def test_parse_nvlink_domains(value, domains):
    assert parse_nvlink_domains(value) == domains


@pytest.mark.parametrize("value", ["0-1_", "0..1", "1-0", "0-1-2", "a-b", "0 1"])
def test_parse_nvlink_domains_refuses_what_is_no_domain_list(value):
    with pytest.raises(ValueError):
        parse_nvlink_domains(value)


def test_malformed_topology_label_names_node_and_label():
    with pytest.raises(ValueError, match=r"node gpu-9 label fleet.inference.dev/nvlink-domains: bad NVLink"):
        node_from_k8s(k8s_node("gpu-9", {**HGX, "fleet.inference.dev/nvlink-domains": "all of them"}))


def test_label_keys_can_be_remapped_and_cpu_nodes_are_kept():
    keys = LabelKeys(rack="cloud.provider.com/topology-rack")
    inv = inventory_from_k8s([
        k8s_node("gpu-1", {**HGX, "cloud.provider.com/topology-rack": "rack-a"}),
        k8s_node("cpu-1", {}, capacity={"cpu": "8"}),
    ], keys)
    assert inv.node("gpu-1").rack == "rack-a"
    assert inv.node("cpu-1").gpus == () and len(inv.node("cpu-1").cpu_cores) == 8
