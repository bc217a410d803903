"""The preemption policy (fleet/placement/preemption.py): who gives up devices for a deployment below
its minimum, never below a victim's own minimum unless preemptible, the fewest victims that make
room, and the hold-off that keeps freed devices from the deployments that gave them up. Pure."""

from __future__ import annotations

from collections import Counter

import pytest

from fleet.inventory import Gpu, Inventory, NodeInventory
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from fleet.placement.preemption import Hold, Holder, HoldOffs, PreemptionPolicy, Standing
from fleet.placement.shapes import Assignment, ReplicaPlacement
from fleet.spec import SpecError, parse_document

H100 = "NVIDIA H100 80GB HBM3"
READY, STARTING = 6, 4          # ReplicaStatus indexes: further along is larger


def node(name: str, n: int = 4, product: str = H100) -> NodeInventory:
    gpus = tuple(Gpu(i, f"{name}-GPU-{i}", product, 81559) for i in range(n))
    return NodeInventory(name, gpus=gpus, cpu_cores=(0, 1), nvlink_domains=(tuple(range(n)),))


def on(node_name: str, *gpus: int) -> ReplicaPlacement:
    devices = tuple(f"{node_name}-GPU-{i}" for i in gpus)
    return ReplicaPlacement((Assignment(node_name, devices, label="gpu:" + ",".join(map(str, gpus))),), H100)


def world(holders: list[Holder]) -> Counter[str]:
    return Counter(d for h in holders for d in h.placement.devices)


def request(count: int = 1, tp: int = 1, deployment: str = "chat") -> PlacementRequest:
    return PlacementRequest(ReplicaShape(gpu_product=H100, tensor_parallel_size=tp), count, deployment)


policy = PreemptionPolicy(get_strategy())


def test_the_lowest_priority_least_advanced_newest_replica_above_its_minimum_goes_first():
    inv = Inventory((node("a"),))
    holders = [
        Holder("batch-0", "batch", on("a", 0), READY, 0.0),
        Holder("batch-1", "batch", on("a", 1), READY, 1.0),
        Holder("batch-2", "batch", on("a", 2), STARTING, 2.0),   # least advanced: goes first
        Holder("eval-0", "eval", on("a", 3), STARTING, 3.0),     # priority 5: after every batch replica
    ]
    standings = {"chat": Standing("chat", 100, False, 1, 0), "batch": Standing("batch", 0, False, 1, 3),
                 "eval": Standing("eval", 5, False, 0, 1)}
    d = policy.decide(request(), standings["chat"], inv, world(holders), holders, standings)
    assert [v.replica_id for v in d.victims] == ["batch-2"]
    assert d.victims[0].reason == ("preempted for chat (priority 100 > 0), 0/1 of its minimum replicas placed, "
                                   "1 more needed")
    assert d.plan is not None and d.plan.placements[0].devices == ("a-GPU-2",)
    assert d.reason == "preempting batch-2 for 1 replica(s) of chat (priority 100, below its minimum 0/1)"


def test_a_victim_deployment_is_never_taken_below_its_minimum_unless_preemptible():
    inv = Inventory((node("a", 2),))
    holders = [Holder("batch-0", "batch", on("a", 0), READY, 0.0), Holder("batch-1", "batch", on("a", 1), READY, 1.0)]
    chat = Standing("chat", 100, False, 2, 0)
    standings = {"chat": chat, "batch": Standing("batch", 0, False, 1, 2)}
    d = policy.decide(request(2), chat, inv, world(holders), holders, standings)
    assert [v.replica_id for v in d.victims] == ["batch-1"]          # one of two needed: batch keeps its 1
    standings["batch"] = Standing("batch", 0, False, 2, 2)
    d = policy.decide(request(2), chat, inv, world(holders), holders, standings)
    assert not d.preempts
    assert d.reason == "lower-priority deployments are at their minimum and not preemptible: batch (2/2)"
    standings["batch"] = Standing("batch", 0, True, 2, 2)              # preemptible: to zero
    d = policy.decide(request(2), chat, inv, world(holders), holders, standings)
    assert sorted(v.replica_id for v in d.victims) == ["batch-0", "batch-1"]
    assert d.victims[0].reason.endswith("(preemptible: may go below its minimum)")


def test_equal_or_higher_priority_is_never_a_victim_and_a_deployment_at_its_minimum_preempts_nothing():
    inv = Inventory((node("a", 1),))
    holders = [Holder("peer-0", "peer", on("a", 0), READY, 0.0)]
    chat = Standing("chat", 10, False, 1, 0)
    standings = {"chat": chat, "peer": Standing("peer", 10, True, 0, 1)}
    d = policy.decide(request(), chat, inv, world(holders), holders, standings)
    assert not d.preempts and d.reason == "no replica of a deployment with priority below 10 holds devices"
    at_min = Standing("chat", 100, False, 1, 1)
    d = policy.decide(request(), at_min, inv, world(holders), holders, {**standings, "chat": at_min})
    assert not d.preempts and "at its minimum" in d.reason


def test_only_the_victims_the_shape_needs_are_taken_a_tp2_replica_frees_one_nvlink_pair():
    # Two 2-GPU NVLink domains; batch holds one GPU of each, scrap (priority -1) one. A TP=2 replica needs
    # a whole domain: the cheapest victims that free one are scrap's replica and the batch one beside it.
    n = NodeInventory("a", gpus=tuple(Gpu(i, f"a-GPU-{i}", H100, 81559) for i in range(4)), cpu_cores=(0,),
                      nvlink_domains=((0, 1), (2, 3)))  # fmt: skip
    holders = [Holder("batch-0", "batch", on("a", 0), READY, 0.0), Holder("scrap-0", "scrap", on("a", 1), READY, 5.0),
               Holder("batch-1", "batch", on("a", 2), READY, 1.0), Holder("batch-2", "batch", on("a", 3), READY, 2.0)]
    chat = Standing("chat", 100, False, 1, 0)
    standings = {"chat": chat, "batch": Standing("batch", 0, False, 0, 3), "scrap": Standing("scrap", -1, False, 0, 1)}
    d = policy.decide(request(tp=2), chat, Inventory((n,)), world(holders), holders, standings)
    assert sorted(v.replica_id for v in d.victims) == ["batch-0", "scrap-0"]
    assert d.plan.placements[0].devices == ("a-GPU-0", "a-GPU-1")


def test_replicas_already_draining_for_the_claimant_count_as_freed():
    inv = Inventory((node("a", 2),))
    holders = [Holder("batch-1", "batch", on("a", 1), READY, 1.0)]
    in_use = world(holders) + Counter({"a-GPU-0": 1})                 # batch-0 drains for chat, still holds GPU-0
    chat = Standing("chat", 100, False, 1, 0)
    standings = {"chat": chat, "batch": Standing("batch", 0, False, 0, 1)}
    d = policy.decide(request(), chat, inv, in_use, holders, standings, freeing=["a-GPU-0"])
    assert not d.preempts and d.reason == "waiting for 1 device(s) being freed for chat to drain"


def test_when_every_allowed_victim_cannot_make_room_for_all_it_makes_room_for_as_many_as_it_can():
    inv = Inventory((node("a", 2), node("b", 2, product="NVIDIA L40S")))
    holders = [Holder("batch-0", "batch", on("a", 0), READY, 0.0), Holder("batch-1", "batch", on("a", 1), READY, 1.0),
               Holder("l40-0", "l40", ReplicaPlacement((Assignment("b", ("b-GPU-0",)),), "NVIDIA L40S"), READY, 0.0)]
    chat = Standing("chat", 100, False, 3, 0)
    standings = {"chat": chat, "batch": Standing("batch", 0, False, 1, 2), "l40": Standing("l40", 0, True, 0, 1)}
    d = policy.decide(request(3), chat, inv, world(holders), holders, standings)
    assert [v.replica_id for v in d.victims] == ["batch-1"]            # the L40S replica frees nothing an H100 needs
    standings["batch"] = Standing("batch", 0, False, 2, 2)
    d = policy.decide(request(3), chat, inv, world(holders), holders, standings)
    assert not d.preempts and d.reason == ("preempting every replica allowed (1 of lower priority) would not make "
                                           "room for a replica of chat")


def test_hold_offs_keep_freed_devices_from_lower_priorities_until_they_expire():
    holds = HoldOffs(hold_off_s=60.0)
    holds.add(["a-GPU-1"], "chat", 100, now_s=10.0)
    assert holds.blocked("batch", 0, 20.0) == Counter({"a-GPU-1": 1})
    assert holds.blocked("chat", 100, 20.0) == Counter()                # freed for it
    assert holds.blocked("vip", 200, 20.0) == Counter()                 # higher priority: not held off
    assert holds.blocked("peer", 100, 20.0) == Counter()                # equal: not held off
    assert holds.blocked("batch", 0, 70.0) == Counter()
    again = HoldOffs(60.0)
    again.restore(holds.to_list() + [{"devices": "x"}, {"nonsense": 1}], now_s=30.0)
    assert again.holds == [Hold(frozenset({"a-GPU-1"}), "chat", 100, 10.0, 70.0)]
    holds.expire(70.0)
    assert holds.holds == []


def _doc(**spec) -> dict:
    return {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "x"},
            "spec": {"model": {"name": "m", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"}, **spec}}


def test_the_spec_takes_priority_and_preemptible_and_names_a_bad_value():
    dep = parse_document(_doc(priority=100, preemptible=True))
    assert (dep.spec.priority, dep.spec.preemptible) == (100, True)
    assert (parse_document(_doc()).spec.priority, parse_document(_doc()).spec.preemptible) == (0, False)
    with pytest.raises(SpecError) as err:
        parse_document(_doc(priority=2_000_000_000))
    assert err.value.problems == ["spec.priority: Input should be less than or equal to 1000000000"]
    with pytest.raises(SpecError) as err:
        parse_document(_doc(preemptible="sometimes"))
    assert err.value.problems[0].startswith("spec.preemptible: ")
