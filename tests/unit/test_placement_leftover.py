"""Leftover-aware best fit: `PlacementRequest.fill_shapes` and `PlacementRequest.strands`, the
``fleet`` strategy's preference for slots whose leftover GPUs still fit a requested shape, and
the controller filling the field from its other deployments."""

from __future__ import annotations

from collections import Counter

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.inventory.model import GpuHealth
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from tests.support.controller import write_deployment
from tests.support.inventories import H100, busy, cluster, node
from tests.unit.test_controller_memory import MemoryHarness

TP2 = ReplicaShape(gpu_product=H100, tensor_parallel_size=2)


def test_strands_only_a_leftover_narrower_than_every_known_shape():
    r = PlacementRequest(TP2, fill_shapes=(4, 8))
    assert [c for c in range(2, 9) if r.strands(c)] == [3]          # one GPU left: fits no TP=2, 4 or 8
    assert not PlacementRequest(TP2).strands(3)                      # nothing known: plain best fit
    tp4 = PlacementRequest(ReplicaShape(gpu_product=H100, tensor_parallel_size=4), fill_shapes=(2,))
    assert [c for c in range(4, 9) if tp4.strands(c)] == [5]
    assert not PlacementRequest(ReplicaShape(gpu_product=H100, mig_profile="1g.10gb"), fill_shapes=(2,)).strands(2)


def quads_with_odd_leftover():
    """Two nodes of two NVLink islands of four, their second islands full: n0's first island has a
    sick GPU (3 free), n1's none (4 free)."""
    n0 = node("n0", topology="quads", sick={0: GpuHealth(ecc_uncorrected=1)})
    n1 = node("n1", topology="quads")
    held = busy(n0, 4, 5, 6, 7) + busy(n1, 4, 5, 6, 7)     # both second islands full
    return cluster(n0, n1), held


def test_fleet_avoids_the_slot_a_replica_would_leave_one_gpu_in():
    inv, held = quads_with_odd_leftover()
    fleet = get_strategy("fleet")
    plain = fleet.place_replicas(PlacementRequest(TP2), inv, Counter(held))
    aware = fleet.place_replicas(PlacementRequest(TP2, fill_shapes=(2, 4)), inv, Counter(held))
    assert plain.placements[0].nodes == ("n0",)     # best fit: 3 free, one left stranded
    assert aware.placements[0].nodes == ("n1",)     # 4 free: 2 left, room for another TP=2
    # The kept index (a DeviceUse) and the full build agree.
    from fleet.placement import DeviceUse
    assert fleet.place_replicas(PlacementRequest(TP2, fill_shapes=(2, 4)), inv, DeviceUse(held)).placements == \
        aware.placements


def test_with_only_stranding_slots_it_still_places():
    inv, held = quads_with_odd_leftover()
    held += busy(inv.nodes[1], 0, 1)                # n1 island 0: 2 free: exact fit, strands nothing
    plan = get_strategy("fleet").place_replicas(PlacementRequest(TP2, count=2, fill_shapes=(2,)), inv, held)
    assert [p.nodes for p in plan.placements] == [("n1",), ("n0",)]


async def test_the_controller_fills_the_other_deployments_widths(tmp_path):
    gpu = {"accelerator": "gpu"}
    files = [write_deployment(tmp_path, name="wide", replicas=1, resources={**gpu, "tensorParallelSize": 4}),
             write_deployment(tmp_path, name="narrow", replicas=1, resources={**gpu, "tensorParallelSize": 2}),
             write_deployment(tmp_path, name="cpu", replicas=1)]
    h = MemoryHarness(tmp_path, files, node("gpu-0", n=8))
    await h.tick()
    fill = {r.deployment: r.fill_shapes for r in h.placer.requests}
    assert fill == {"wide": (2,), "narrow": (4,), "cpu": ()}
    assert h.status()["wide-0"] is S.STARTING
