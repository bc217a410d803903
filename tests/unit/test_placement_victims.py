"""Scale-down victims (fleet.placement.victims, PlacementStrategy.drain_order, the scale step's
``prefer``): the replica whose NVLink domain frees up whole goes first."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.controller.scale import scale_step
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from tests.support.inventories import H100, cluster, node

TP2 = ReplicaShape(gpu_product=H100, tensor_parallel_size=2)


def test_the_replica_alone_in_its_domain_drains_before_the_newest():
    # a: the deployment's replica beside 6 free GPUs; b: its replica among 6 GPUs held by others.
    inv = cluster(node("a"), node("b"))
    others = Counter({f"GPU-b-{i}": 1 for i in range(2, 8)})
    fleet = get_strategy("fleet")
    first = fleet.place_replicas(PlacementRequest(TP2), inv, others).placements[0]      # best fit: on b
    assert first.nodes == ("b",)
    held = others + Counter(first.devices)
    second = fleet.place_replicas(PlacementRequest(TP2, existing=(first,)), inv, held).placements[0]
    assert second.nodes == ("a",)
    held.update(second.devices)
    # Listed oldest first as [a's, b's]: newest first drains b's and leaves a's domain broken; fleet
    # drains a's, which frees a whole 8-GPU domain.
    order = [second, first]
    assert get_strategy("first-fit").drain_order(order, 1, inv, held) == [1]
    assert fleet.drain_order(order, 1, inv, held) == [0]
    # With a's domain shared by others and b's mostly freed, b's replica (whose removal frees
    # more) goes first, then a's.
    held.update(f"GPU-a-{i}" for i in range(2, 8))
    held.subtract({f"GPU-b-{i}": 1 for i in range(2, 6)})
    assert fleet.drain_order(order, 2, inv, +held) == [1, 0]


def test_the_greedy_order_counts_what_earlier_victims_freed():
    inv = cluster(node("a"))
    fleet = get_strategy("fleet")
    plan = fleet.place_replicas(PlacementRequest(TP2, count=4), inv, Counter())
    held = Counter(d for p in plan.placements for d in p.devices)
    assert sorted(fleet.drain_order(list(plan.placements), 4, inv, held)) == [0, 1, 2, 3]


@dataclass
class R:
    name: str
    status: S
    created: int


def test_the_scale_step_asks_prefer_only_among_the_status_it_splits():
    active = [R("pending", S.PENDING, 5), R("r1", S.READY, 0), R("r2", S.READY, 1), R("r3", S.READY, 2)]
    asked = []

    def prefer(equals, n):
        asked.append(([r.name for r in equals], n))
        return sorted(equals, key=lambda r: r.created)      # the oldest, say
    step = scale_step(active, 2, lambda r: r.created, prefer)
    assert [r.name for r in step.drain] == ["pending", "r1"]
    assert asked == [(["r3", "r2", "r1"], 1)]
    assert [r.name for r in scale_step(active, 2, lambda r: r.created).drain] == ["pending", "r3"]
