"""Preemption in the controller (fleet/controller/preemption.py), on fake time with the fake backend,
engines and router: a higher-priority deployment below its minimum takes a GPU from a lower-priority
one, the victim drains through the router first, the preemption is an event with its reason, the
freed GPU is held off from the victim (no flapping, even when the claimant's replica crashes), and
the holds survive a controller restart."""

from __future__ import annotations

import pytest
import yaml

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.inventory import Gpu, NodeInventory
from fleet.spec import load_deployments
from tests.support.controller import Harness, write_deployment

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


def gpu_node(n: int = 2) -> NodeInventory:
    gpus = tuple(Gpu(i, f"GPU-{i}", H100, 81559) for i in range(n))
    return NodeInventory("n", gpus=gpus, cpu_cores=(0, 1), nvlink_domains=(tuple(range(n)),))


def _write(tmp_path, name: str, minimum: int, initial: int, **spec) -> object:
    f = write_deployment(tmp_path, name, resources={"gpuProduct": H100}, **spec)
    doc = yaml.safe_load(f.read_text())
    doc["spec"]["replicas"] = {"min": minimum, "max": 2, "initial": initial}
    f.write_text(yaml.safe_dump(doc))
    return f


def deployments(tmp_path, chat_min: int = 0, batch_min: int = 1, preemptible: bool = False):
    return [_write(tmp_path, "batch", batch_min, 2, priority=0, preemptible=preemptible),
            _write(tmp_path, "chat", chat_min, chat_min, priority=100)]


async def ready_batch(tmp_path, **kw) -> Harness:
    h = Harness(tmp_path, deployments(tmp_path, **kw), node=gpu_node(), drain_timeout_s=30, stop_grace_s=5,
                backoff_base_s=10, preemption_hold_off_s=120)  # fmt: skip
    await h.all_ready("batch-0", "batch-1")
    return h


async def raise_chat_min(h: Harness, tmp_path, to: int = 1) -> None:
    files = deployments(tmp_path, chat_min=to)
    h.c.apply([ld for ld in load_deployments(files) if ld.deployment.name == "chat"])


async def test_a_deployment_below_its_minimum_takes_a_gpu_from_a_lower_priority_one_drained_first(tmp_path):
    h = await ready_batch(tmp_path)
    await raise_chat_min(h, tmp_path)
    h.pools.in_flight_by_id = {"batch-1": 1}                                # a request still running on the victim
    await h.tick()
    victim = h.c.replicas["batch-1"]                                      # the newest of equals
    assert victim.status is S.DRAINING and victim.preempted_for == "chat"
    assert victim.drain_reason == ("preempted for chat (priority 100 > 0), 0/1 of its minimum replicas placed, "
                                   "1 more needed")
    assert h.pool_ids("batch-model") == ["batch-0"]                       # out of the pool: no new requests
    assert [e.id for e in h.pools.pools["batch-model"] if e.draining] == ["batch-1"]
    assert h.backend.by_replica("batch-1").signals == []                  # its request finishes first
    waiting = h.c.waiting_reason("chat-0")
    assert waiting.startswith("cannot place 1 of 1 replica") and "preempting batch-1 for 1 replica(s) of chat" in waiting
    drained = [e for e in h.events if e.replica_id == "batch-1" and e.new is S.DRAINING]
    assert [e.detail for e in drained] == [victim.drain_reason]          # the event, with its reason
    [recent] = h.c.snapshot()["preemption"]["recent"]
    assert (recent["replica"], recent["deployment"], recent["for"], recent["devices"]) == \
        ("batch-1", "batch", "chat", ["GPU-1"])

    await h.tick()                                                       # still draining: nothing more preempted
    assert h.status()["batch-0"] is S.READY
    assert "waiting for 1 device(s) being freed for chat to drain" in h.c.waiting_reason("chat-0")
    h.pools.in_flight_by_id = {}
    await h.tick(n=2)
    assert h.status()["batch-1"] is S.TERMINATED
    assert h.backend.by_replica("chat-0").spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    # batch wants 2 (desired) and has 1: its replacement waits, held off the GPU it gave up.
    assert h.status()["batch-2"] is S.PENDING
    reason = h.c.waiting_reason("batch-2")
    assert "1 device(s) freed for higher-priority chat are held off for" in reason
    h.make_healthy("chat-0")
    await h.tick(n=2)
    assert h.status()["chat-0"] is S.READY and h.status()["batch-0"] is S.READY


async def test_the_victim_is_not_replaced_onto_the_gpu_it_gave_up_while_the_claimant_crash_loops(tmp_path):
    h = await ready_batch(tmp_path)
    await raise_chat_min(h, tmp_path)
    await h.tick(n=3)                                                    # batch-1 drained (nothing in flight)
    assert h.status()["chat-0"] is S.STARTING
    h.backend.exit("chat-0", 1, "RuntimeError: CUDA out of memory")      # chat's engine crashes on start
    await h.tick()
    assert h.status()["chat-0"] is S.FAILED_START
    for _ in range(9):                                                   # chat's replacement waits 10 s of backoff
        await h.tick()
        assert h.status()["batch-2"] is S.PENDING                        # the free GPU is not batch's again
    await h.tick(n=2)
    assert h.backend.by_replica("chat-1").spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    assert len(h.c.snapshot()["preemption"]["recent"]) == 1             # one preemption, not one per crash
    assert h.status()["batch-0"] is S.READY


async def test_the_hold_off_ends_and_the_victim_gets_capacity_back_when_the_claimant_lets_go(tmp_path):
    h = await ready_batch(tmp_path)
    await raise_chat_min(h, tmp_path)
    await h.tick(n=3)
    h.make_healthy("chat-0")
    await h.tick(n=2)
    assert h.status()["chat-0"] is S.READY
    await raise_chat_min(h, tmp_path, to=0)
    h.c.set_desired("chat", 0)
    await h.tick(n=3)
    assert h.status()["chat-0"] is S.TERMINATED
    assert h.status()["batch-2"] is S.PENDING                            # GPU-1 free, but still held off
    await h.tick(n=120)
    assert h.backend.by_replica("batch-2").spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-1"


async def test_a_victim_deployment_at_its_minimum_is_kept_unless_preemptible(tmp_path):
    h = await ready_batch(tmp_path, batch_min=2)
    await raise_chat_min(h, tmp_path)
    await h.tick(n=2)
    assert {h.status()[r] for r in ("batch-0", "batch-1")} == {S.READY}
    assert h.c.waiting_reason("chat-0").endswith(
        "lower-priority deployments are at their minimum and not preemptible: batch (2/2)")
    assert h.c.snapshot()["preemption"]["recent"] == []

    p = tmp_path / "p"
    p.mkdir()
    h = await ready_batch(p, batch_min=2, preemptible=True)
    await raise_chat_min(h, p, to=2)
    await h.tick()
    assert {h.status()[r] for r in ("batch-0", "batch-1")} == {S.DRAINING}


async def test_holds_and_recent_preemptions_survive_a_controller_restart(tmp_path):
    h = await ready_batch(tmp_path)
    await raise_chat_min(h, tmp_path)
    await h.tick(n=3)
    snapshot = h.c.snapshot()
    again = Harness(tmp_path, deployments(tmp_path, chat_min=1), node=gpu_node(), preemption_hold_off_s=120)
    again.clock.now_s = h.clock.now_s
    again.c.preemption.restore(snapshot, again.clock())
    assert again.c.preemption.blocked("batch", again.clock()) == {"GPU-1": 1}
    assert [e["replica"] for e in again.c.preemption.recent] == ["batch-1"]


async def test_the_crd_status_of_both_deployments_lists_the_preemption(tmp_path):
    from fleet.k8s.status import deployment_status

    h = await ready_batch(tmp_path)
    await raise_chat_min(h, tmp_path)
    await h.tick()
    for name in ("batch", "chat"):
        [p] = deployment_status(h.c, name, 1, None, now=1_800_000_000.0)["preemptions"]
        assert (p["replica"], p["deployment"], p["for"], p["time"]) == ("batch-1", "batch", "chat", "2027-01-15T08:00:00Z")
        assert p["reason"].startswith("preempted for chat (priority 100 > 0)")


async def test_replicas_above_the_minimum_wait_for_free_capacity_and_preempt_nothing(tmp_path):
    h = Harness(tmp_path, [_write(tmp_path, "batch", 1, 1, priority=0), _write(tmp_path, "chat", 1, 1, priority=100)],
                node=gpu_node(2))  # fmt: skip
    await h.all_ready("batch-0", "chat-0")
    h.c.set_desired("chat", 2)                                           # an autoscaler's wish, above the minimum
    await h.tick(n=3)
    assert h.status()["chat-1"] is S.PENDING and h.status()["batch-0"] is S.READY
    assert h.c.snapshot()["preemption"]["recent"] == []
    assert h.c.waiting_reason("chat-1").startswith("cannot place 1 of 1 replica")
