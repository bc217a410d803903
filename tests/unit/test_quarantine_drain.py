"""A fault injected into the stand-in NVML (built from a real H100's readings): the node agent
quarantines that GPU, the local backend's inventory reports it, the controller drains the replica
on it and places the replacement on another GPU. Fake time; no process starts."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from fleet.agent.health import GpuHealthChecker
from fleet.agent.nvml_health import NvmlHealthReader
from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy
from fleet.agent.runner import NodeAgent
from fleet.local.backend import LocalBackend
from fleet.inventory.nvml import node_from_nvml
from fleet.controller.lifecycle import ReplicaStatus as S
from tests.support.fake_nvml import FakePynvml, nvswitch_8gpu
from tests.support.fakes import FakeClock
from tests.support.controller import Harness, write_deployment


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


async def test_an_injected_gpu_fault_drains_the_replica_on_it_and_the_replacement_lands_elsewhere(tmp_path):
    clock = FakeClock()
    snapshot = nvswitch_8gpu()
    fake = FakePynvml(snapshot)
    agent = NodeAgent("n", GpuHealthChecker(NvmlHealthReader(fake), clock), QuarantinePolicy(QuarantineConfig(), clock),
                      clock, registry=CollectorRegistry())  # fmt: skip
    node = node_from_nvml(snapshot, "n")
    local = LocalBackend(tmp_path / "state", "fleet-q", node, agent=agent)   # its inventory is what we test
    f = write_deployment(tmp_path, replicas=2, resources={"gpuProduct": node.gpus[0].product, "tensorParallelSize": 2})
    h = Harness(tmp_path, [f], node=node)
    await h.all_ready("chat-0", "chat-1")
    placed = {rid: h.backend.by_replica(rid).spec.env["CUDA_VISIBLE_DEVICES"] for rid in ("chat-0", "chat-1")}
    victim_gpu = placed["chat-1"].split(",")[0]
    index = next(g.index for g in node.gpus if g.uuid == victim_gpu)

    agent.step()
    assert (await local.inventory()).nodes[0].quarantined == {}
    fake.inject(index, ecc_volatile_uncorrected=2)                # a double-bit ECC error on that GPU
    [decision] = agent.step()
    assert (decision.target, decision.action) == (victim_gpu, "quarantine")
    seen = (await local.inventory()).nodes[0]
    assert list(seen.quarantined) == [victim_gpu]
    assert any(p.startswith("quarantined: ") for p in next(g for g in seen.gpus if g.uuid == victim_gpu).health.problems())

    h.backend.nodes = (seen,)                                      # the controller's backend reports it
    await h.tick()
    r = h.c.replicas["chat-1"]
    assert r.status is S.DRAINING and r.drain_reason.startswith(f"GPU {victim_gpu} on n unhealthy: quarantined: ")
    assert h.pool_ids() == ["chat-0"]
    replacement = h.backend.by_replica("chat-2").spec.env["CUDA_VISIBLE_DEVICES"]
    assert victim_gpu not in replacement.split(",") and not set(replacement.split(",")) & set(placed["chat-0"].split(","))


def test_a_gpu_replica_is_pinned_to_the_cpu_cores_local_to_its_gpus(tmp_path):
    from fleet.controller.backend import ReplicaWant
    from fleet.placement import PlacementRequest, get_strategy
    from fleet.inventory import Inventory
    from fleet.spec import load_deployments

    clock = FakeClock()
    snapshot = nvswitch_8gpu()
    for i, d in enumerate(snapshot["devices"]):          # two NUMA nodes: GPUs 0-3 by cores 0-15, 4-7 by 16-31
        d["cpu_affinity"] = list(range(0, 16)) if i < 4 else list(range(16, 32))
    checker = GpuHealthChecker(NvmlHealthReader(FakePynvml(snapshot)), clock)
    agent = NodeAgent("n", checker, QuarantinePolicy(QuarantineConfig(), clock), clock, registry=CollectorRegistry())
    agent.step()
    node = node_from_nvml(snapshot, "n")
    local = LocalBackend(tmp_path / "state", "fleet-n", node, agent=agent)
    f = write_deployment(tmp_path, replicas=1, resources={"gpuProduct": node.gpus[0].product, "tensorParallelSize": 2})
    (ld,) = load_deployments([f])
    busy = {g.uuid: 1 for g in node.gpus[:4]}            # the first NUMA node's GPUs are taken
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(ld.deployment, 1), Inventory((node,)), busy)
    want = ReplicaWant("chat-0", ld.deployment, plan.placements[0], ld.serving_hash, ld.base_dir)
    assert local.numa_cores(want) == tuple(range(16, 32))


def test_a_cpu_replica_runs_whole_on_its_placed_cores(tmp_path):
    """Its API server too, not only vLLM's OpenMP threads: a starting engine's ``import torch``
    probes every core it may run on, and must not queue on a core another replica keeps busy."""
    from fleet.controller.backend import ReplicaWant
    from fleet.inventory import Inventory
    from fleet.inventory.model import NodeInventory
    from fleet.placement import PlacementRequest, get_strategy
    from fleet.spec import load_deployments

    node = NodeInventory("n", cpu_cores=(0, 1, 2, 3))
    local = LocalBackend(tmp_path / "state", "fleet-n", node)
    f = write_deployment(tmp_path, replicas=1, resources={"accelerator": "cpu", "cpuCores": 2})
    (ld,) = load_deployments([f])
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(ld.deployment, 1), Inventory((node,)),
                                         {"cpu:0": 1})  # fmt: skip
    want = ReplicaWant("chat-0", ld.deployment, plan.placements[0], ld.serving_hash, ld.base_dir)
    assert local.pinned_cores(want) == (1, 2)
