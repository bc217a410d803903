"""Controller: replica lifecycle, replacement with backoff, drain and shutdown, on fake time
with a fake backend, fake engines and a fake router admin API."""

from __future__ import annotations

import asyncio
import json

import pytest

from fleet.inventory import Gpu, NodeInventory
from fleet.controller.lifecycle import ReplicaStatus as S
from router.pools.upstream import StreamLimits
from tests.support.controller import Harness, write_deployment
from tests.support.waits import async_wait_until


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


async def test_replicas_go_through_the_lifecycle_and_join_the_pool_only_when_warm(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path)])
    await h.tick()
    assert h.status() == {"chat-0": S.STARTING, "chat-1": S.STARTING}
    assert h.pool_ids() == []
    # Devices: one exclusive core each, pinned through the engine's environment.
    envs = [p.spec.env["VLLM_CPU_OMP_THREADS_BIND"] for p in h.backend.procs.values()]
    assert sorted(envs) == ["0", "1"]
    argv = h.backend.by_replica("chat-0").spec.argv
    assert argv[argv.index("--served-model-name") + 1] == "chat-model"
    assert argv[argv.index("--port") + 1] == str(h.port("chat-0"))
    kv = json.loads(argv[argv.index("--kv-events-config") + 1])   # vLLM's keys, events on, where the backend said
    assert kv == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "ipc:///fleet-fake/kv/chat-0.pub",
                  "replay_endpoint": "ipc:///fleet-fake/kv/chat-0.replay", "topic": ""}

    h.make_healthy("chat-0")
    await h.tick()
    # Healthy is not enough: the warm-up requests run first, through the engine's API.
    assert h.c.replicas["chat-0"].healthy_at_s is not None
    await h.tick()
    assert h.status() == {"chat-0": S.READY, "chat-1": S.STARTING}
    assert h.pool_ids() == ["chat-0"]
    (endpoint,) = h.pools.pools["chat-model"]
    assert endpoint.kv_events.publisher == "ipc:///fleet-fake/kv/chat-0.pub"   # routers subscribe there
    assert [p for _, p in h.engines.posts] == ["/v1/completions", "/v1/completions", "/v1/chat/completions"]

    h.make_healthy("chat-1")
    await h.tick(n=2)
    assert h.pool_ids() == ["chat-0", "chat-1"]
    seq = [e.new for e in h.events if e.replica_id == "chat-1"]
    assert seq == [S.STARTING, S.WARMING, S.READY]
    assert h.c.replicas["chat-1"].time_to_ready_s() == pytest.approx(4.0)


async def test_engine_that_cannot_start_fails_with_reason_and_is_replaced_with_backoff(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path)], backoff_base_s=10, backoff_max_s=25)
    await h.all_ready("chat-0", "chat-1")
    # chat-1 crashes; the other keeps serving.
    h.backend.exit("chat-1", 1, "RuntimeError: CUDA out of memory")
    await h.tick()
    r = h.c.replicas["chat-1"]
    assert r.status is S.FAILED_CRASHED
    assert r.failure.reason == "engine exited with code 1"
    assert r.failure.log_tail[-1] == "RuntimeError: CUDA out of memory"
    assert h.pool_ids() == ["chat-0"]
    # Replacement waits for the backoff (10 s after the first failure in a row).
    await h.tick(n=8)
    assert "chat-2" not in h.c.replicas
    await h.tick(n=2)
    assert h.status()["chat-2"] is S.STARTING
    # It fails before /health: FAILED_START; the next replacement waits 20 s.
    h.backend.exit("chat-2", 1, "ValueError: bad config.json")
    await h.tick()
    assert h.c.replicas["chat-2"].status is S.FAILED_START
    assert "before /health passed" in h.c.replicas["chat-2"].failure.reason
    await h.tick(n=18)
    assert "chat-3" not in h.c.replicas
    await h.tick(n=2)
    assert "chat-3" in h.c.replicas
    # Third failure in a row: capped at backoff_max_s = 25.
    h.backend.exit("chat-3", 1)
    await h.tick()
    assert h.c.deployments["chat"].next_create_at_s - h.clock() == pytest.approx(25.0)
    assert h.pool_ids() == ["chat-0"]
    assert h.status()["chat-0"] is S.READY


async def test_startup_timeout_stops_the_engine_and_escalates_to_sigkill(tmp_path):
    f = write_deployment(tmp_path, replicas=1, engine={"startupTimeoutSeconds": 30})
    h = Harness(tmp_path, [f], stop_grace_s=10)
    h.backend.ignore_sigterm = True
    await h.tick(n=30)
    assert h.status()["chat-0"] is S.STARTING
    await h.tick(n=2)
    r = h.c.replicas["chat-0"]
    assert r.status is S.FAILED_START and "within 30 s" in r.failure.reason
    assert h.backend.by_replica("chat-0").signals == ["SIGTERM"]
    await h.tick(n=10)
    assert h.backend.by_replica("chat-0").signals == ["SIGTERM", "SIGKILL"]
    await h.tick()
    assert not r.engine_alive


async def test_failed_warmup_never_joins_the_pool(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)])
    await h.tick()
    port = h.port("chat-0")
    h.engines.warmup_fails.add(port)
    h.make_healthy("chat-0")
    await h.tick(n=2)
    r = h.c.replicas["chat-0"]
    assert r.status is S.FAILED_WARMUP
    assert "HTTP 500: boom" in r.failure.reason
    # The model is known to the router from the first tick (503 while starting, not 404), empty.
    assert h.pools.pools == {"chat-model": []}
    assert h.backend.by_replica("chat-0").signals == ["SIGTERM"]


async def test_ready_replica_that_stops_answering_health_is_failed_and_replaced(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)], ready_health_interval_s=5, unhealthy_threshold=3)
    await h.all_ready("chat-0")
    h.engines.healthy.clear()
    await h.tick(n=2, seconds=5)
    assert h.status()["chat-0"] is S.READY
    await h.tick(seconds=5)
    assert h.status()["chat-0"] is S.FAILED_UNHEALTHY
    assert h.pool_ids() == []
    await h.tick(seconds=10)
    assert h.status()["chat-1"] is S.STARTING


async def test_scale_down_drains_in_flight_requests_before_stopping(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path)], drain_timeout_s=60)
    await h.all_ready("chat-0", "chat-1")
    h.pools.in_flight_by_id = {"chat-1": 2}
    h.c.set_desired("chat", 1)
    await h.tick()
    assert h.status()["chat-1"] is S.DRAINING
    # Out of rotation at once, still listed (draining) so its in-flight count is visible.
    assert h.pool_ids() == ["chat-0"]
    assert [e.id for e in h.pools.pools["chat-model"] if e.draining] == ["chat-1"]
    await h.tick(n=5)
    assert h.backend.by_replica("chat-1").signals == []
    h.pools.in_flight_by_id = {"chat-1": 0}
    await h.tick()
    assert h.backend.by_replica("chat-1").signals == ["SIGTERM"]
    await h.tick()
    assert h.status()["chat-1"] is S.TERMINATED
    assert [e.id for e in h.pools.pools["chat-model"]] == ["chat-0"]


async def test_drain_gives_up_after_the_drain_timeout(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)], drain_timeout_s=20)
    await h.all_ready("chat-0")
    h.pools.in_flight_by_id = {"chat-0": 1}
    h.c.set_desired("chat", 0)
    await h.tick(n=19)
    assert h.backend.by_replica("chat-0").signals == []
    await h.tick(n=2)
    assert h.backend.by_replica("chat-0").signals == ["SIGTERM"]


async def test_set_desired_is_clamped_to_spec_bounds_and_persisted_first(tmp_path):
    saved = []

    class Sink:
        def save(self, snap):
            saved.append(snap)

    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)])
    h.c.state_sink = Sink()
    h.c.set_desired("chat", 50)
    assert h.c.deployments["chat"].desired == 8
    assert saved[-1]["deployments"]["chat"]["desired"] == 8  # persisted before any replica exists
    assert h.c.replicas == {}


async def test_shutdown_leaves_no_process(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path)], stop_grace_s=0.1)
    await h.all_ready("chat-0", "chat-1")
    h.backend.ignore_sigterm = True
    await h.c.shutdown(timeout_s=5, interval_s=0.01)
    assert h.backend.alive() == []
    assert all(s in (S.TERMINATED,) for s in h.status().values())
    assert h.pools.pools["chat-model"] == []


async def test_router_update_failure_is_retried_next_tick(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)])
    h.pools.fail = True
    await h.all_ready("chat-0")
    assert h.pools.pools == {}
    h.pools.fail = False
    await h.tick()
    assert h.pool_ids() == ["chat-0"]


async def test_gpu_replicas_are_pinned_to_disjoint_gpus_and_wait_when_none_is_free(tmp_path):
    gpus = tuple(Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559) for i in range(4))
    node = NodeInventory("n", gpus=gpus, cpu_cores=(0, 1), nvlink_domains=((0, 1, 2, 3),))
    f = write_deployment(tmp_path, replicas=3, resources={"accelerator": "gpu", "tensorParallelSize": 2})
    h = Harness(tmp_path, [f], node=node)
    await h.tick()
    assert h.status() == {"chat-0": S.STARTING, "chat-1": S.STARTING, "chat-2": S.PENDING}
    envs = {p.spec.replica_id: p.spec.env["CUDA_VISIBLE_DEVICES"] for p in h.backend.procs.values()}
    assert envs == {"chat-0": "GPU-0,GPU-1", "chat-1": "GPU-2,GPU-3"}
    argv = h.backend.by_replica("chat-0").spec.argv
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert h.c.snapshot()["replicas"][2]["waiting_reason"] == (
        "cannot place 1 of 3 replicas (2 whole GPUs of NVIDIA H100 80GB HBM3 in one NVLink domain): "
        "1 node: at most 0 free GPUs in one NVLink domain, need 2 [n]"
    )
    # A failed replica frees its GPUs once its process is gone; the waiting one takes them.
    h.backend.exit("chat-0", 1)
    await h.tick()
    assert h.status()["chat-2"] is S.STARTING
    assert h.backend.by_replica("chat-2").spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-0,GPU-1"


async def test_missing_weights_fail_the_replica_with_the_field_named(tmp_path):
    f = write_deployment(tmp_path, replicas=1)
    h = Harness(tmp_path, [f])
    (tmp_path / "models" / "m").rmdir()
    await h.tick()
    r = h.c.replicas["chat-0"]
    assert r.status is S.FAILED_START
    assert r.failure.reason.startswith("weights not present: spec.model.source './models/m': ")
    assert h.backend.procs == {}


async def test_a_finished_warmup_wakes_the_loop_instead_of_waiting_for_the_next_tick(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1)])
    h.engines.gate = asyncio.Event()          # warm-up requests hang until released
    await h.tick()
    h.make_healthy("chat-0")
    await h.tick()
    assert h.status() == {"chat-0": S.WARMING}
    stop = asyncio.Event()
    loop_task = asyncio.create_task(h.c.run(stop, interval_s=3600))   # no timed tick within the test
    await asyncio.sleep(0)
    h.engines.gate.set()
    await async_wait_until(lambda: h.status()["chat-0"] is S.READY, 30, what="chat-0 READY after its warm-up")
    assert h.pool_ids() == ["chat-0"]
    stop.set()
    h.c.wake()
    await asyncio.wait_for(loop_task, timeout=30)


async def test_mig_replicas_are_pinned_by_mig_uuid_and_a_scale_up_is_placed_as_one_batch(tmp_path):
    from fleet.inventory import MigInstance

    migs = tuple(MigInstance(f"MIG-{j}", "3g.40gb", "GPU-0", start) for j, start in enumerate((0, 4)))
    gpus = (Gpu(0, "GPU-0", "NVIDIA H100 80GB HBM3", 81559, mig_enabled=True, mig_instances=migs),)
    node = NodeInventory("n", gpus=gpus, cpu_cores=(0, 1), nvlink_domains=())
    f = write_deployment(tmp_path, replicas=3, resources={"accelerator": "gpu", "migProfile": "3g.40gb"})
    h = Harness(tmp_path, [f], node=node)
    await h.tick()
    envs = {p.spec.replica_id: p.spec.env["CUDA_VISIBLE_DEVICES"] for p in h.backend.procs.values()}
    assert envs == {"chat-0": "MIG-0", "chat-1": "MIG-1"}
    assert h.c.replicas["chat-0"].assignment == "mig:3g.40gb@gpu0"
    reason = h.c.snapshot()["replicas"][2]["waiting_reason"]
    assert "cannot place 1 of 3 replicas (1 MIG 3g.40gb instance of NVIDIA H100 80GB HBM3)" in reason
    assert "every 3g.40gb instance in use" in reason


async def test_a_replica_on_a_gpu_gone_unhealthy_drains_and_its_replacement_lands_elsewhere(tmp_path):
    import dataclasses

    from fleet.inventory.model import GpuHealth

    gpus = tuple(Gpu(i, f"GPU-{i}", "NVIDIA H100 80GB HBM3", 81559) for i in range(3))
    node = NodeInventory("n", gpus=gpus, cpu_cores=(0, 1), nvlink_domains=((0, 1, 2),))
    f = write_deployment(tmp_path, replicas=2, resources={"gpuProduct": "NVIDIA H100 80GB HBM3"})
    h = Harness(tmp_path, [f], node=node)
    await h.all_ready("chat-0", "chat-1")
    on = {rid: h.backend.by_replica(rid).spec.env["CUDA_VISIBLE_DEVICES"] for rid in ("chat-0", "chat-1")}
    assert on == {"chat-0": "GPU-0", "chat-1": "GPU-1"}
    quarantined = GpuHealth(other_problems=("quarantined: Xid 79 (GPU fell off the bus)",))
    sick = dataclasses.replace(node, gpus=(gpus[0], dataclasses.replace(gpus[1], health=quarantined), gpus[2]))
    h.backend.nodes = (sick,)
    await h.tick()
    r = h.c.replicas["chat-1"]
    assert r.status is S.DRAINING
    assert r.drain_reason == "GPU GPU-1 on n unhealthy: quarantined: Xid 79 (GPU fell off the bus)"
    assert h.pool_ids() == ["chat-0"]                          # out of the pool at once
    assert h.backend.by_replica("chat-2").spec.env["CUDA_VISIBLE_DEVICES"] == "GPU-2"
    await h.tick()
    assert h.c.replicas["chat-1"].status is S.TERMINATED and h.c.replicas["chat-0"].status is S.READY


async def test_a_replacement_waits_for_a_draining_replicas_core_rather_than_share_one(tmp_path):
    f = write_deployment(tmp_path, replicas=2)
    h = Harness(tmp_path, [f])
    await h.all_ready("chat-0", "chat-1")
    h.pools.in_flight_by_id = {"chat-1": 1}
    h.c.replicas["chat-1"].drain_requested_at_s = h.clock()   # e.g. made room for a canary
    await h.tick()
    assert h.status()["chat-2"] is S.PENDING                   # cpu:0 would be shared: it waits
    assert "waiting for the devices of draining replica(s) chat-1" in h.c._waiting["chat-2"]
    h.pools.in_flight_by_id = {}
    await h.tick(n=2)
    assert h.status()["chat-1"] is S.TERMINATED
    assert h.backend.by_replica("chat-2").spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"   # chat-1's core, alone



async def test_the_pool_carries_the_first_token_timeout_and_retries_of_the_routing_spec(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1,
                                            routing={"firstTokenTimeoutSeconds": 7.5, "maxRetries": 2})])
    await h.tick()
    h.make_healthy("chat-0")
    await h.tick(n=2)
    pool = h.pools.settings["chat-model"]
    assert (pool.first_token_timeout_s, pool.max_retries) == (7.5, 2)


async def test_the_pool_carries_the_migration_limit_and_stream_limits_of_the_routing_spec(tmp_path):
    routing = {"migrationLimit": 1, "maxStreamDurationSeconds": 600, "minBytesPerSecond": 4,
               "byteRateWindowSeconds": 20}  # fmt: skip
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, routing=routing)])
    await h.tick()
    h.make_healthy("chat-0")
    await h.tick(n=2)
    pool = h.pools.settings["chat-model"]
    assert pool.migration_limit == 1
    assert pool.stream_limits.limits() == StreamLimits(max_stream_duration_s=600, min_bytes_per_s=4, rate_window_s=20)
