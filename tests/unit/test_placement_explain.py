"""Explanations by node class (fleet.placement.explain)."""

from __future__ import annotations

from collections import Counter

from fleet.inventory.model import NodeInventory
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from tests.support.inventories import A100_80, H100, L40S, busy, cluster, node


def place(inv, shape, count=1, in_use=None):
    return get_strategy().place_replicas(PlacementRequest(shape, count=count), inv, in_use or Counter())


def test_reasons_are_grouped_by_node_class_largest_first():
    a100s = [node(f"a100-{i}", product=A100_80) for i in range(12)]
    h100s = [node(f"h100-{i}") for i in range(3)]
    held = sum((busy(n, 0, 1, 2, 3, 4, 5) for n in h100s), Counter())
    plan = place(cluster(*a100s, *h100s), ReplicaShape(gpu_product=H100, tensor_parallel_size=4), in_use=held)
    assert [(len(c.nodes), c.reason) for c in plan.reasons] == [
        (12, "other GPU product (NVIDIA A100-SXM4-80GB)"),
        (3, "at most 2 free GPUs in one NVLink domain, need 4"),
    ]
    assert plan.explain() == (
        "cannot place 1 of 1 replica (4 whole GPUs of NVIDIA H100 80GB HBM3 in one NVLink domain): "
        "12 nodes: other GPU product (NVIDIA A100-SXM4-80GB) [a100-0, a100-1, a100-2, ...]; "
        "3 nodes: at most 2 free GPUs in one NVLink domain, need 4 [h100-0, h100-1, h100-2]"
    )


def test_every_kind_of_reason():
    inv = cluster(
        NodeInventory("cpu-only", cpu_cores=(0, 1)),
        node("mig", n=2, mig={0: [("1g.10gb", s) for s in range(7)], 1: [("7g.80gb", 0)]}),
        node("pcie", n=4, topology="pcie"),
        node("unknown", n=4, topology="nvswitch").__class__(
            "unknown", node("u", n=4).gpus, nvlink_domains=None),
        node("small", n=2),
    )
    plan = place(inv, ReplicaShape(gpu_product=H100, tensor_parallel_size=4))
    reasons = {c.nodes[0]: c.reason for c in plan.reasons}
    assert reasons == {
        "cpu-only": "no GPU",
        "mig": "GPUs in MIG mode (the replica needs whole GPUs)",
        "pcie": "at most 1 GPU in one NVLink domain, need 4",
        "unknown": "at most 1 GPU in one NVLink domain, need 4 (NVLink topology not reported)",
        "small": "at most 2 GPUs in one NVLink domain, need 4",
    }


def test_mig_reasons():
    inv = cluster(
        node("whole", n=2),
        node("other-geometry", n=1, mig={0: [("1g.10gb", s) for s in range(7)]}),
        node("taken", n=1, mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]}),
        node("l40s", n=2, product=L40S),
    )
    held = Counter({"MIG-taken-0-0": 1, "MIG-taken-0-1": 1})
    plan = place(inv, ReplicaShape(gpu_product=H100, mig_profile="3g.40gb"), in_use=held)
    reasons = {c.nodes[0]: c.reason for c in plan.reasons}
    assert reasons == {
        "whole": "MIG mode off",
        "other-geometry": "no 3g.40gb instance (MIG instances: 7x 1g.10gb)",
        "taken": "every 3g.40gb instance in use",
        "l40s": "other GPU product (NVIDIA L40S)",
    }


def test_without_a_product_each_node_is_judged_on_its_own_gpus():
    inv = cluster(node("h", n=2), node("a", n=2, product=A100_80, topology="pcie"))
    plan = place(inv, ReplicaShape(tensor_parallel_size=4))
    assert plan.product is None
    reasons = {c.nodes[0]: c.reason for c in plan.reasons}
    assert reasons == {"h": "at most 2 GPUs in one NVLink domain, need 4",
                       "a": "at most 1 GPU in one NVLink domain, need 4"}


def test_an_empty_inventory_says_so():
    plan = place(cluster(), ReplicaShape(tensor_parallel_size=1))
    assert "the inventory has no nodes" in plan.explain()


def test_fits_at_all_answers_for_an_empty_cluster_state():
    strategy = get_strategy()
    inv = cluster(node("a", n=8, topology="quads"))
    assert strategy.fits_at_all(ReplicaShape(tensor_parallel_size=4), inv) is None
    unfit = strategy.fits_at_all(ReplicaShape(tensor_parallel_size=8, gpu_product=H100), inv)
    assert "at most 4 GPUs in one NVLink domain, need 8" in unfit.reason
    # Wider than any node: a gang, which one node without a block cannot form.
    unfit = strategy.fits_at_all(ReplicaShape(tensor_parallel_size=16, gpu_product=H100), inv)
    assert "no NVLink fabric or network block (a gang of 4 nodes needs one)" in unfit.reason
