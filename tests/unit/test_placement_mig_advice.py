"""MIG repartition advice (fleet.placement.mig_advice): valid geometries, least disruptive first."""

from __future__ import annotations

from collections import Counter

from fleet.inventory.mig import check_geometry, mig_model_for
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from tests.support.inventories import A100_80, H100, cluster, node

SHAPE = ReplicaShape(gpu_product=H100, mig_profile="3g.40gb")


def plan_for(inv, count, in_use=None, shape=SHAPE):
    return get_strategy().place_replicas(PlacementRequest(shape, count=count), inv, in_use or Counter())


def assert_valid(advice, product=H100):
    model = mig_model_for(product, 81559 if "H100" in product else 81920)
    for a in advice:
        assert check_geometry(model, [*a.keep, *a.create]) is None, a
        assert a.gain == sum(1 for s in a.create if s.profile == "3g.40gb") > 0


def test_no_advice_when_everything_fits():
    inv = cluster(node("m", n=1, mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]}))
    assert plan_for(inv, 2).advice == ()


def test_free_slices_beside_busy_instances_come_first():
    inv = cluster(node("m", n=3, mig={
        0: [("3g.40gb", 0), ("3g.40gb", 4)],                    # both taken
        1: [("4g.40gb", 0)],                                     # busy, slices 4-7 empty
        2: [("1g.10gb", s) for s in range(7)],                   # idle, other profile
    }))
    held = Counter({"MIG-m-0-0": 1, "MIG-m-0-1": 1, "MIG-m-1-0": 1})
    plan = plan_for(inv, 1, held)
    assert plan.placements == ()
    (a,) = plan.advice
    assert (a.gpu_index, a.enable_mig, a.destroy) == (1, False, ())
    assert [str(s) for s in a.create] == ["3g.40gb@4"]
    assert a.commands() == ["nvidia-smi mig -i 1 -cgi 9:4 -C"]
    assert_valid(plan.advice)


def test_idle_instances_of_another_profile_are_replaced_then_idle_gpus_get_mig_mode():
    inv = cluster(node("m", n=3, mig={0: [("1g.10gb", s) for s in range(7)]}))   # GPUs 1 and 2 whole, idle
    plan = plan_for(inv, 4)
    assert plan.placements == ()
    first, second = plan.advice                # 2 + 2 instances cover the 4 missing: advice stops
    assert first.gpu_index == 0 and len(first.destroy) == 7 and not first.enable_mig
    assert second.gpu_index == 1 and second.enable_mig
    assert second.commands() == ["nvidia-smi -i 1 -mig 1", "nvidia-smi mig -i 1 -cgi 9:0,9:4 -C"]
    assert_valid(plan.advice)
    assert len(plan_for(inv, 6).advice) == 3


def test_busy_instances_are_kept_and_never_destroyed():
    inv = cluster(node("m", n=1, mig={0: [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 4), ("1g.10gb", 5)]}))
    held = Counter({"MIG-m-0-0": 1})          # the 1g at slice 0 is busy
    plan = plan_for(inv, 1, held)
    (a,) = plan.advice
    assert "MIG-m-0-0" not in a.destroy
    assert [str(s) for s in a.create] == ["3g.40gb@4"]
    assert "destroy only the idle instances" in a.commands()[0]
    assert_valid(plan.advice)


def test_advice_follows_the_versions_product():
    inv = cluster(node("a", n=1, product=A100_80, memory_mib=81920), node("h", n=1, mig={0: [("3g.40gb", 0)]}))
    plan = plan_for(inv, 2, shape=ReplicaShape(mig_profile="3g.40gb"))
    assert plan.product == H100 and len(plan.placements) == 1
    assert {a.product for a in plan.advice} == {H100}
    assert [str(s) for s in plan.advice[0].create] == ["3g.40gb@4"]


def test_busy_and_unhealthy_gpus_get_no_advice():
    from fleet.inventory.model import GpuHealth
    inv = cluster(node("m", n=2, sick={1: GpuHealth(ecc_uncorrected=1)}))
    plan = plan_for(inv, 1, Counter({"GPU-m-0": 1}))
    assert plan.advice == ()


def _need(name: str):
    import json
    from pathlib import Path

    from fleet.models import EngineMemorySettings, MemoryNeed, facts_from_config

    config = json.loads((Path(__file__).resolve().parents[1] / "data" / "model_configs" / f"{name}.json").read_text())
    return MemoryNeed(facts_from_config(config), EngineMemorySettings(max_model_len=8192), 1)


def test_advice_proposes_only_instances_that_hold_the_model():
    inv = cluster(node("m", n=2, mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]}))   # GPU 1 whole and idle
    held = Counter({"MIG-m-0-0": 1, "MIG-m-0-1": 1})
    small = get_strategy().place_replicas(PlacementRequest(SHAPE, count=1, memory=_need("llama-3.1-8b-instruct")),
                                          inv, held)
    assert [a.gpu_index for a in small.advice] == [1] and small.advice[0].gain == 2
    # Llama 3.1 70B bf16 (131 GiB of weights) on 40,448 MiB instances: nothing to create.
    big = get_strategy().place_replicas(PlacementRequest(SHAPE, count=1, memory=_need("llama-3.1-70b-instruct")),
                                        inv, held)
    assert big.placements == () and big.advice == ()
    assert "model does not fit MIG 3g.40gb of NVIDIA H100 80GB HBM3 (40448 MiB)" in big.explain()
