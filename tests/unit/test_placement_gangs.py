"""Gangs (fleet.placement.gangs): replicas wider than a node, all or nothing, inside one NVLink
fabric or network block."""

from __future__ import annotations

from collections import Counter

from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from tests.support.inventories import H100, busy, cluster, node

TP16 = ReplicaShape(gpu_product=H100, tensor_parallel_size=16)


def place(inv, shape=TP16, count=1, in_use=None, strategy="fleet", **request):
    return get_strategy(strategy).place_replicas(PlacementRequest(shape, count=count, **request), inv, in_use or Counter())


def test_tp16_on_8_gpu_nodes_is_a_gang_of_two_whole_domains_in_one_block():
    inv = cluster(node("a", network_block="b1"), node("b", network_block="b2"), node("c", network_block="b1"))
    plan = place(inv)
    (p,) = plan.placements
    assert plan.gang is not None and (plan.gang.nodes, plan.gang.per_node) == (2, 8)
    assert sorted(p.nodes) == ["a", "c"]                      # same block; b is alone in b2
    assert all(len(m.devices) == 8 and m.domain == "nvlink0" for m in p.members)
    assert p.members[0].env["CUDA_VISIBLE_DEVICES"] == ",".join(f"GPU-{p.nodes[0]}-{i}" for i in range(8))


def test_a_gang_is_placed_whole_or_not_at_all():
    a, c = node("a", network_block="b1"), node("c", network_block="b1")
    inv = cluster(a, c)
    plan = place(inv, in_use=busy(c, 7))
    assert plan.placements == ()
    assert "need 8 per gang member" in plan.explain()
    assert "network block b1 has 1 node with 8 free GPUs in one NVLink domain, a gang needs 2" in plan.explain()


def test_two_gangs_asked_one_fits_no_half_gang_is_left():
    inv = cluster(*(node(n, network_block="b1") for n in ("a", "b", "c")))
    plan = place(inv, count=2)
    assert len(plan.placements) == 1 and plan.unplaced == 1
    used = Counter(d for p in plan.placements for d in p.devices)
    assert len(used) == 16


def test_nodes_without_a_block_cannot_form_a_gang():
    plan = place(cluster(node("a"), node("b")))
    assert plan.placements == ()
    assert "no NVLink fabric or network block (a gang of 2 nodes needs one)" in plan.explain()


def test_a_multi_node_nvlink_fabric_is_preferred_over_a_network_block():
    inv = cluster(node("n1", network_block="b1"), node("n2", network_block="b1"),
                  node("f1", network_block="b1", nvlink_fabric="nvl72-a"),
                  node("f2", network_block="b1", nvlink_fabric="nvl72-a"))
    assert sorted(place(inv).placements[0].nodes) == ["f1", "f2"]


def test_new_gang_replicas_keep_the_gang_shape_of_existing_ones():
    inv = cluster(*(node(n, network_block="b1") for n in ("a", "b", "c", "d")))
    first = place(inv).placements
    second = place(inv, existing=first, in_use=Counter(first[0].devices))
    assert second.gang == place(inv).gang
    assert len(second.placements[0].members) == 2
    assert not set(second.placements[0].nodes) & set(first[0].nodes)


def test_gang_member_share_divides_the_tensor_parallel_size():
    # TP=16 on nodes with two NVLink islands of four: four members of four GPUs.
    inv = cluster(*(node(f"q{i}", topology="quads", network_block="b1") for i in range(4)))
    plan = place(inv)
    assert (plan.gang.nodes, plan.gang.per_node) == (4, 4)
    assert len(plan.placements[0].members) == 4 and all(len(m.devices) == 4 for m in plan.placements[0].members)
