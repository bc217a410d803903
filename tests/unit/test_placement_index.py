"""The free-capacity index kept across placement calls (fleet.placement.freeindex): the indexed
picks equal the full build's, replica for replica; the index follows the in-use map through a
`DeviceUse` journal and through plain mappings; tentative takes are given back."""

from __future__ import annotations

import random
from collections import Counter

from fleet.inventory.model import GpuHealth
from fleet.placement import PlacementRequest, ReplicaShape
from fleet.placement.freeindex import DeviceUse, free_state
from fleet.placement.fleet_strategy import FleetStrategy
from tests.support.inventories import A100_80, H100, cluster, node

MIG_GEOMETRIES = [[("3g.40gb", 0), ("3g.40gb", 4)], [("1g.10gb", s) for s in range(7)],
                  [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)]]


def random_cluster(rng: random.Random, nodes: int):
    out = []
    for i in range(nodes):
        mig = {g: rng.choice(MIG_GEOMETRIES) for g in range(4)} if rng.random() < 0.2 else None
        sick = {rng.randrange(8): GpuHealth(ecc_uncorrected=1)} if rng.random() < 0.1 else None
        cached = frozenset(rng.sample(["img:1", "hf://org/m", "hf://org/other"], rng.randint(0, 2)))
        out.append(node(f"n{i}", product=rng.choice([H100, H100, A100_80]), topology=rng.choice(["nvswitch", "quads"]),
                        mig=mig, sick=sick, zone=rng.choice(["z1", "z2", "z3", None]),
                        rack=rng.choice(["r1", "r2", "r3", "r4", "r5", None]), cached=cached))
    return cluster(*out)


def random_use(rng: random.Random, inv, share: float) -> Counter[str]:
    return Counter({d: 1 for n in inv.nodes for g in n.gpus
                    for d in ([m.uuid for m in g.mig_instances] or [g.uuid]) if rng.random() < share})


class Indexed(FleetStrategy):
    indexed_min_budget = 10**9     # the indexed path however many special nodes


def both(strategy: FleetStrategy, request: PlacementRequest, inv, in_use, product: str):
    """(the indexed path's placements, the full build's) on the same state."""
    state = free_state(inv)
    with state.lock:
        state.sync(in_use)
        indexed = strategy._place_indexed(request, inv, state, product)
    return indexed, strategy._place_single(request, inv, Counter(in_use), product)


def test_indexed_picks_equal_the_full_build_replica_for_replica():
    rng = random.Random(11)
    strategy = Indexed()
    checked = 0
    for trial in range(60):
        inv = random_cluster(rng, rng.randint(2, 40))
        held = random_use(rng, inv, rng.choice([0.0, 0.3, 0.6]))
        shapes = [ReplicaShape(gpu_product=p, tensor_parallel_size=t) for p in (H100, A100_80) for t in (1, 2, 4)]
        shapes += [ReplicaShape(gpu_product=H100, mig_profile=m) for m in ("1g.10gb", "3g.40gb")]
        for shape in shapes:
            existing = strategy.place_replicas(PlacementRequest(shape, count=rng.randint(0, 5)), inv, held).placements
            request = PlacementRequest(
                shape, count=rng.randint(1, 4), existing=existing, image=rng.choice([None, "img:1"]),
                model_source=rng.choice([None, "hf://org/m"]),
                warm_nodes=frozenset(n.name for n in inv.nodes if rng.random() < 0.1),
                fill_shapes=rng.choice([(), (2,), (4, 8), (1, 2, 8)]))   # leftover-aware best fit too
            indexed, full = both(strategy, request, inv, held, shape.gpu_product)
            assert indexed is not None
            assert indexed == full, (trial, shape)
            checked += len(full)
    assert checked > 300


def test_the_index_follows_a_device_use_journal_and_plain_maps():
    # One inventory, one long life: replicas come and go through a DeviceUse (the journal),
    # then through fresh plain Counters (the full comparison); picks stay those of a full build
    # and the state's held set is exactly what the map holds.
    rng = random.Random(5)
    inv = random_cluster(rng, 30)
    strategy = Indexed()
    use = DeviceUse(random_use(rng, inv, 0.3))
    live = []
    shapes = [ReplicaShape(gpu_product=H100, tensor_parallel_size=t) for t in (1, 2, 4)]
    shapes.append(ReplicaShape(gpu_product=H100, mig_profile="1g.10gb"))
    for step in range(300):
        shape = rng.choice(shapes)
        mapping = use if step < 200 else Counter(use)
        request = PlacementRequest(shape, count=rng.randint(1, 3))
        indexed, full = both(strategy, request, inv, mapping, H100)
        assert indexed == full, step
        plan = strategy.place_replicas(request, inv, mapping)
        assert plan.placements == tuple(full)
        for p in plan.placements:
            use.update(p.devices)
            live.append(p)
        while live and rng.random() < 0.5:
            gone = live.pop(rng.randrange(len(live)))
            use.subtract(gone.devices)
            if rng.random() < 0.5:
                use = DeviceUse(+use)     # zeros dropped: a new object, compared whole once
        state = free_state(inv)
        state.sync(use if step < 200 else Counter(use))
        assert state.held == {d for d, c in use.items() if c}
    assert live


def test_device_use_journals_every_change_and_drops_an_old_journal():
    use = DeviceUse({"a": 1})
    mark = use.mark
    use.update(["b", "b"])
    use["c"] = 1
    del use["a"]
    use.subtract({"b": 2})
    use.pop("c")
    assert set(use.changes_since(mark)) == {"a", "b", "c"}
    assert use.changes_since(use.mark) == []
    for i in range(5000):
        use[f"x{i % 3}"] = i
    assert use.changes_since(mark) is None      # fell behind: the next sync compares the whole map


def test_in_use_untouched_and_tentative_takes_given_back():
    inv = cluster(node("a"), node("b"))
    held = Counter({"GPU-a-0": 1})
    plan = FleetStrategy().place_replicas(PlacementRequest(ReplicaShape(gpu_product=H100, tensor_parallel_size=2),
                                                           count=3), inv, held)
    assert len(plan.placements) == 3 and held == Counter({"GPU-a-0": 1})
    assert free_state(inv).held == {"GPU-a-0"}
    assert sum(s.capacity for s in free_state(inv).index("h100-80gb-hbm3", None).slots) == 15


def test_indexed_gangs_equal_the_full_build():
    from fleet.placement import gangs

    rng = random.Random(3)
    strategy = FleetStrategy()
    checked = 0
    for trial in range(60):
        nodes = [node(f"n{i}", topology=rng.choice(["nvswitch", "quads"]), zone=rng.choice(["z1", "z2", None]),
                      rack=rng.choice(["r1", "r2", "r3"]), network_block=rng.choice(["b1", "b2", "b2", None]),
                      nvlink_fabric=rng.choice([None, None, "f1"]),
                      sick={rng.randrange(8): GpuHealth(ecc_uncorrected=1)} if rng.random() < 0.1 else None)
                 for i in range(rng.randint(2, 30))]
        inv = cluster(*nodes)
        held = random_use(rng, inv, rng.choice([0.0, 0.3, 0.6]))
        shape = ReplicaShape(gpu_product=H100, tensor_parallel_size=rng.choice([16, 32]))
        existing = strategy.place_replicas(PlacementRequest(shape, count=rng.randint(0, 2)), inv, held).placements
        request = PlacementRequest(shape, count=rng.randint(1, 3), existing=existing,
                                   warm_nodes=frozenset(n.name for n in nodes if rng.random() < 0.2))
        gang = gangs.gang_shape(shape, inv, "h100-80gb-hbm3", existing)
        assert gang is not None
        full = gangs.place_gangs(strategy, request, inv, Counter(held), H100, gang, strategy._context(request, inv))
        assert list(strategy.place_replicas(request, inv, held).placements) == full, trial
        checked += len(full)
    assert checked > 20


def test_a_map_that_changes_most_devices_rebuilds_the_index(monkeypatch):
    from fleet.placement.freeindex import FreeState

    monkeypatch.setattr(FreeState, "REBUILD_AFTER", 10)
    rng = random.Random(2)
    inv = random_cluster(rng, 20)
    strategy = Indexed()
    shape = ReplicaShape(gpu_product=H100, tensor_parallel_size=2)
    for in_use in (random_use(rng, inv, 0.5), Counter(), random_use(rng, inv, 0.5), Counter({"GPU-n0-0": 1})):
        request = PlacementRequest(shape, count=3)
        indexed, full = both(strategy, request, inv, in_use, H100)
        assert indexed == full
        assert free_state(inv).held == {d for d, c in in_use.items() if c}


def test_explanations_from_kept_node_facts_equal_judging_each_node_afresh():
    import json
    from pathlib import Path

    from fleet.inventory.model import product_key
    from fleet.models import EngineMemorySettings, MemoryNeed, facts_from_config
    from fleet.placement import explain

    config = json.loads((Path(__file__).parents[1] / "data/model_configs/llama-3.1-70b-instruct.json").read_text())
    too_big = MemoryNeed(facts_from_config(config), EngineMemorySettings(max_model_len=8192), 1)
    rng = random.Random(9)
    for trial in range(40):
        inv = random_cluster(rng, rng.randint(1, 30))
        held = random_use(rng, inv, rng.choice([0.2, 0.6, 0.9]))
        for product in (H100, A100_80):
            for tp in (1, 2, 4, 8):
                memory = too_big if rng.random() < 0.2 else None
                request = PlacementRequest(ReplicaShape(gpu_product=product, tensor_parallel_size=tp), memory=memory)
                classes: dict[str, list[str]] = {}
                for n in inv.nodes:
                    if (r := explain.node_reason(n, request.shape, product_key(product), held, memory=memory)) is not None:
                        classes.setdefault(r, []).append(n.name)
                expected = sorted(((r, tuple(n)) for r, n in classes.items()), key=lambda c: (-len(c[1]), c[0]))
                got = explain.by_node_class(request, inv, held, product, None)
                assert [(c.reason, c.nodes) for c in got] == expected, (trial, product, tp)
