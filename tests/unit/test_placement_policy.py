"""Placement policy (fleet.placement): shapes, fragmentation, failure-domain spread, warm nodes,
homogeneity, a scale-up as one decision, health, and the strategy registry."""

from __future__ import annotations

from collections import Counter

import pytest

from fleet.inventory.model import GpuHealth
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy, strategy_names
from tests.support.inventories import A100_80, H100, busy, cluster, node

TP2 = ReplicaShape(gpu_product=H100, tensor_parallel_size=2)


def place(inv, shape=TP2, count=1, in_use=None, strategy="fleet", **request):
    return get_strategy(strategy).place_replicas(PlacementRequest(shape, count=count, **request), inv, in_use or Counter())


def test_tp_replica_gets_gpus_of_one_nvlink_domain_pinned_by_uuid():
    plan = place(cluster(node("a")))
    (p,) = plan.placements
    assert plan.complete and p.nodes == ("a",)
    assert p.members[0].domain == "nvlink0"
    assert p.devices == ("GPU-a-0", "GPU-a-1")
    assert p.env == {"CUDA_VISIBLE_DEVICES": "GPU-a-0,GPU-a-1"}


def test_tp_replica_never_spans_nvlink_islands():
    # Two islands of four with 3 and 2 GPUs free: a TP=4 replica fits in neither.
    n = node("q", topology="quads")
    plan = place(cluster(n), ReplicaShape(tensor_parallel_size=4), in_use=busy(n, 0, 4, 5))
    assert plan.placements == ()
    assert "at most 3 free GPUs in one NVLink domain, need 4" in plan.explain()
    # With island 4-7 free, it goes there and only there.
    plan = place(cluster(n), ReplicaShape(tensor_parallel_size=4), in_use=busy(n, 0))
    assert plan.placements[0].devices == tuple(f"GPU-q-{i}" for i in (4, 5, 6, 7))


def test_mig_replica_gets_one_instance_by_mig_uuid():
    n = node("m", n=2, mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]})
    plan = place(cluster(n), ReplicaShape(mig_profile="3g.40gb"), count=2)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in plan.placements] == ["MIG-m-0-0", "MIG-m-0-1"]
    assert plan.placements[0].members[0].label == "mig:3g.40gb@gpu0"


def test_mig_shape_with_tensor_parallelism_is_refused_with_the_reason():
    plan = place(cluster(node("m", mig={0: [("3g.40gb", 0)]})), ReplicaShape(mig_profile="3g.40gb", tensor_parallel_size=2))
    assert plan.placements == ()
    assert "tensor parallel size must be 1 on MIG" in plan.explain()
    assert "MIG slices have no NVLink" in plan.explain()


def test_fragmentation_a_partly_used_domain_is_used_before_a_free_one():
    full, partly = node("free"), node("partly")
    inv = cluster(full, partly)                  # the free node comes first in inventory order
    held = busy(partly, 0, 1, 2, 3, 4, 5)
    assert place(inv, in_use=held).placements[0].nodes == ("partly",)
    # The first-fit baseline breaks the free 8-GPU domain instead.
    assert place(inv, in_use=held, strategy="first-fit").placements[0].nodes == ("free",)


def test_fragmentation_keeps_a_large_shape_placeable():
    # Four TP=2 replicas, then one TP=8: best fit packs the TP=2s onto the partly used node.
    a, b, c = node("a"), node("b"), node("c")
    inv = cluster(a, b, c)
    held = busy(b, 0, 1, 2, 3) + busy(c, 0, 1, 2, 3, 4, 5)
    plan = place(inv, count=3, in_use=held)
    held_after = held + Counter(d for p in plan.placements for d in p.devices)
    assert sorted(p.nodes[0] for p in plan.placements) == ["b", "b", "c"]
    assert place(inv, ReplicaShape(gpu_product=H100, tensor_parallel_size=8), in_use=held_after).complete
    # First fit spends node a and leaves no free domain of 8.
    ff = place(inv, count=3, in_use=held, strategy="first-fit")
    held_ff = held + Counter(d for p in ff.placements for d in p.devices)
    assert not place(inv, ReplicaShape(gpu_product=H100, tensor_parallel_size=8), in_use=held_ff).complete


def test_replicas_spread_over_racks_and_zones():
    inv = cluster(node("r1a", zone="z1", rack="r1"), node("r1b", zone="z1", rack="r1"),
                  node("r2a", zone="z1", rack="r2"), node("r3a", zone="z2", rack="r3"))
    plan = place(inv, count=3)
    nodes = [p.nodes[0] for p in plan.placements]
    assert "r3a" in nodes                                    # both zones used
    racks = {inv.node(n).rack for n in nodes}
    assert racks == {"r1", "r2", "r3"}                       # three racks for three replicas


def test_spread_counts_the_versions_existing_replicas():
    inv = cluster(node("r1a", rack="r1"), node("r2a", rack="r2"))
    first = place(inv).placements[0]
    second = place(inv, existing=(first,), in_use=Counter(first.devices)).placements[0]
    assert {first.nodes[0], second.nodes[0]} == {"r1a", "r2a"}


def test_warm_nodes_win_over_a_better_fit():
    cold_partly, warm_free = node("cold"), node("warm")
    inv = cluster(cold_partly, warm_free)
    held = busy(cold_partly, 0, 1, 2, 3, 4, 5)
    assert place(inv, in_use=held).placements[0].nodes == ("cold",)
    assert place(inv, in_use=held, warm_nodes=frozenset({"warm"})).placements[0].nodes == ("warm",)


def test_a_node_caching_the_image_and_weights_is_warm():
    cold = node("cold")
    warm = node("warm", cached=frozenset({"vllm/vllm-openai:v0.11.0", "/models/m"}))
    half = node("half", cached=frozenset({"/models/m"}))         # weights without the image: cold
    inv = cluster(cold, half, warm)
    held = busy(cold, 0, 1, 2, 3, 4, 5) + busy(half, 0, 1, 2, 3, 4, 5)
    plan = place(inv, in_use=held, image="vllm/vllm-openai:v0.11.0", model_source="/models/m")
    assert plan.placements[0].nodes == ("warm",)


def test_warmth_is_graded_weights_and_image_then_weights_then_image_then_nothing():
    image, weights = "vllm/vllm-openai:v0.11.0", "/models/m"
    nodes = {"cold": node("cold"), "image": node("image", cached=frozenset({image})),
             "weights": node("weights", cached=frozenset({weights})),
             "both": node("both", cached=frozenset({image, weights}))}
    request = PlacementRequest(TP2, image=image, model_source=weights)
    assert {k: request.warmth(n) for k, n in nodes.items()} == {"cold": 0, "image": 1, "weights": 2, "both": 3}
    inv = cluster(*nodes.values())
    # Four TP=2 replicas, one per node's worth of room (each node has 8 GPUs, 6 of them held):
    # they fill the warmest first.
    held = sum((busy(n, 0, 1, 2, 3, 4, 5) for n in nodes.values()), Counter())
    plan = place(inv, count=4, in_use=held, image=image, model_source=weights)
    assert [p.nodes[0] for p in plan.placements] == ["both", "weights", "image", "cold"]


def test_homogeneity_the_batch_picks_one_product_that_hosts_it_all():
    h100 = node("h100", n=4)
    inv = cluster(h100, node("a100-1", n=4, product=A100_80), node("a100-2", n=4, product=A100_80))
    plan = place(inv, ReplicaShape(tensor_parallel_size=4), count=2)
    assert plan.product == A100_80
    assert sorted(p.nodes[0] for p in plan.placements) == ["a100-1", "a100-2"]
    # One replica alone fits either product: the one with more room to scale up wins.
    assert place(inv, ReplicaShape(tensor_parallel_size=4)).product == A100_80
    # With equal room, inventory order decides.
    assert place(cluster(node("h", n=4), node("a", n=4, product=A100_80)), ReplicaShape(tensor_parallel_size=4)).product == H100


def test_homogeneity_new_replicas_follow_the_existing_ones():
    h100, a100 = node("h100"), node("a100", product=A100_80)
    inv = cluster(h100, a100)
    existing = place(inv, ReplicaShape(tensor_parallel_size=4), count=1).placements
    assert existing[0].product == H100
    held = Counter(existing[0].devices) + busy(h100, 4, 5, 6, 7)
    plan = place(inv, ReplicaShape(tensor_parallel_size=4), count=1, existing=existing, in_use=held)
    assert plan.placements == () and plan.product == H100
    assert "other GPU product (NVIDIA A100-SXM4-80GB)" in plan.explain()


def test_a_scale_up_is_one_decision_all_or_nothing():
    inv = cluster(node("a", n=4))
    plan = place(inv, count=3, all_or_nothing=True)
    assert plan.placements == () and plan.unplaced == 3
    assert "all or nothing: only 2 of 3 fit, none placed" in plan.explain()
    partial = place(inv, count=3)
    assert len(partial.placements) == 2 and partial.unplaced == 1
    assert len({d for p in partial.placements for d in p.devices}) == 4      # no GPU given twice


def test_unhealthy_gpus_are_not_placeable_and_the_reason_says_so():
    n = node("sick", n=2, sick={0: GpuHealth(ecc_uncorrected=4)})
    plan = place(cluster(n))
    assert plan.placements == ()
    assert "1 GPU unhealthy: uncorrected ECC errors" in plan.explain()
    n = node("hot", n=2, topology="nvswitch", sick={0: GpuHealth(clock_event_reasons=0x40),
                                                      1: GpuHealth(row_remap_pending=True)})
    assert "GPUs unhealthy: hardware thermal slowdown, row remap pending (needs GPU reset)" in place(cluster(n)).explain()
    # A single TP=1 replica avoids the unhealthy GPU.
    n = node("sick", n=2, sick={0: GpuHealth(ecc_uncorrected=4)})
    assert place(cluster(n), ReplicaShape(tensor_parallel_size=1)).placements[0].devices == ("GPU-sick-1",)


def test_pcie_node_hosts_tp1_but_not_tp2():
    n = node("pcie", n=4, product="NVIDIA L40S", topology="pcie")
    assert place(cluster(n), ReplicaShape(tensor_parallel_size=1), count=4).complete
    plan = place(cluster(n), ReplicaShape(tensor_parallel_size=2))
    assert "at most 1 GPU in one NVLink domain, need 2" in plan.explain()


def test_same_inputs_same_plan():
    inv = cluster(*(node(f"n{i}", rack=f"r{i % 3}") for i in range(9)))
    held = busy(inv.nodes[4], 0, 1, 2)
    a = place(inv, count=12, in_use=held)
    b = place(inv, count=12, in_use=held)
    assert a == b and a.complete


def test_in_use_is_not_modified():
    held = Counter({"GPU-a-0": 1})
    place(cluster(node("a")), count=2, in_use=held)
    assert held == Counter({"GPU-a-0": 1})


def test_strategies_register_by_name():
    assert strategy_names() == ["first-fit", "fleet"]
    assert get_strategy("first-fit").name == "first-fit"
    with pytest.raises(KeyError, match="unknown placement strategy 'best'; known: first-fit, fleet"):
        get_strategy("best")


def test_cpu_replicas_take_free_cores_then_share():
    from fleet.inventory.model import NodeInventory
    inv = cluster(NodeInventory("cpu", cpu_cores=(0, 1)))
    plan = place(inv, ReplicaShape(accelerator="cpu"), count=3)
    labels = [p.label for p in plan.placements]
    assert labels == ["cpu:0", "cpu:1", "cpu:0 (shared)"]
    assert not plan.placements[2].exclusive
    refused = place(inv, ReplicaShape(accelerator="cpu", cpu_cores=4))
    assert "2 CPU cores, need 4" in refused.explain()


def test_cpu_replicas_go_to_nodes_without_gpus_while_those_have_free_cores():
    """A GPU node's cores feed its GPU replicas: a CPU replica takes a GPU-free node's cores even
    when the GPU node has more free, and goes to the GPU node only once the others are full."""
    from fleet.inventory.model import NodeInventory
    inv = cluster(node("gpu-node", 8, cpu_cores=tuple(range(64))), NodeInventory("cpu-node", cpu_cores=(0, 1, 2, 3)))
    plan = place(inv, ReplicaShape(accelerator="cpu", cpu_cores=2), count=3)
    assert [p.nodes for p in plan.placements] == [("cpu-node",), ("cpu-node",), ("gpu-node",)]
    assert all(p.exclusive for p in plan.placements)


def test_fleet_incremental_ranking_picks_what_ranking_every_group_picks():
    # FleetStrategy keeps rank_groups incrementally (_ShareRanking); GroupRanking ranks every
    # group at every pick. Racks shared by warm and cold nodes, zones and racks missing,
    # existing replicas, partly used nodes: the same plan, replica for replica.
    import random

    from fleet.placement.fleet_strategy import FleetStrategy
    from fleet.placement.strategies import GroupRanking

    class EveryGroup(FleetStrategy):
        def ranking(self, ctx):
            return GroupRanking(self, ctx)

    rng = random.Random(7)
    for trial in range(20):
        nodes = [node(f"n{i}", topology=rng.choice(["nvswitch", "quads"]), zone=rng.choice(["z1", "z2", "z3", None]),
                      rack=rng.choice(["r1", "r2", "r3", "r4", None])) for i in range(rng.randint(2, 24))]
        inv = cluster(*nodes)
        held = Counter({f"GPU-{n.name}-{i}": 1 for n in nodes for i in range(8) if rng.random() < 0.4})
        warm = frozenset(n.name for n in nodes if rng.random() < 0.3)
        existing = place(inv, count=rng.randint(0, 6), in_use=held).placements
        for shape in (TP2, ReplicaShape(gpu_product=H100, tensor_parallel_size=1)):
            request = PlacementRequest(shape, count=rng.randint(1, 60), existing=existing, warm_nodes=warm)
            fast = FleetStrategy().place_replicas(request, inv, held)
            assert fast.placements == EveryGroup().place_replicas(request, inv, held).placements, trial
