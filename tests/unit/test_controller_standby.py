"""Standby replicas in the controller (`fleet.controller.standby`): a scale-down sleeps a drained
replica, a scale-up wakes it before creating one, a refill sleeps once warm; on fake time with
the fake backend, engines and router admin API."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.engines.kinds import get_engine
from fleet.spec import SpecError, parse_document
from warmup.client import EngineRequestError
from tests.support.controller import Harness, write_deployment

SIM = {"engine": {"kind": "sim"}, "standby": {"maxReplicas": 1}}


def doc(**spec) -> dict:
    return {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "d"},
            "spec": {"model": {"name": "m", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"}, **spec}}


def test_standby_spec_fields_and_errors():
    spec = parse_document(doc(standby={"maxReplicas": 2})).spec
    assert spec.standby.max_replicas == 2 and spec.standby.sleep_level == 1 and spec.standby_max == 2
    assert parse_document(doc()).spec.standby_max == 0
    with pytest.raises(SpecError, match=r"spec\.standby\.sleepLevel"):
        parse_document(doc(standby={"maxReplicas": 1, "sleepLevel": 2}))
    with pytest.raises(SpecError, match=r"spec\.standby\.maxReplicas"):
        parse_document(doc(standby={"maxReplicas": -1}))


def test_vllm_on_cpu_cannot_sleep_and_starts_cold():
    d = doc(standby={"maxReplicas": 1}, resources={"accelerator": "cpu"})
    d["spec"]["engine"] = {"kind": "vllm"}
    d["spec"]["model"]["source"] = "./m"
    spec = parse_document(d).spec
    assert spec.standby_max == 0 and "CPU build cannot sleep" in spec.standby_unsupported()
    gpu = parse_document({**d, "spec": {**d["spec"], "resources": {"accelerator": "gpu"}}})
    assert gpu.spec.standby_max == 1
    launch = gpu.engine_launch(Path("."))
    vllm = get_engine("vllm")
    assert "--enable-sleep-mode" in vllm.command(launch, "m", "h", 1)
    assert vllm.env(launch) == {"VLLM_SERVER_DEV_MODE": "1"}


async def test_a_refill_sleeps_once_warm_and_never_joins_the_pool(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, **SIM)])
    await h.tick()
    assert h.status() == {"chat-0": S.STARTING, "chat-1": S.STARTING}
    assert h.c.replicas["chat-1"].standby_refill
    argv = h.backend.by_replica("chat-1").spec.argv
    assert "--enable-sleep-mode" in argv
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)
    assert h.status() == {"chat-0": S.READY, "chat-1": S.STANDBY}
    assert h.pool_ids() == ["chat-0"] and [e.id for e in h.pools.pools["chat-model"]] == ["chat-0"]
    assert h.engines.sleep_calls == [(h.c.replicas["chat-1"].endpoint, "sleep")]
    assert h.c.snapshot()["replicas"][1]["status"] == "STANDBY"


async def test_scale_up_wakes_standby_first_then_refills(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, **SIM)])
    await h.tick()
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)
    h.engines.wake_gate = asyncio.Event()
    h.c.set_desired("chat", 2)
    await h.tick()
    r = h.c.replicas["chat-1"]
    assert r.status is S.WARMING and r.woke_at_s is not None
    assert "chat-2" in h.c.replicas and h.c.replicas["chat-2"].standby_refill   # the pool refills, cold
    assert h.pool_ids() == ["chat-0"]                                           # not before the wake and warm-up
    h.engines.wake_gate.set()
    await h.tick(n=2)
    assert r.status is S.READY and h.pool_ids() == ["chat-0", "chat-1"]
    assert r.wake_to_ready_s() is not None
    assert [c for _, c in h.engines.sleep_calls] == ["sleep", "wake_up"]


async def test_scale_down_sleeps_after_in_flight_requests_finish_and_refills_give_way(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=2, **SIM)], drain_timeout_s=60)
    await h.tick()
    assert h.c.replicas["chat-2"].standby_refill       # the refill starts, never made healthy here
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=2)
    h.pools.in_flight_by_id = {"chat-1": 2}
    h.c.set_desired("chat", 1)
    await h.tick()
    assert h.status()["chat-0"] is S.READY and h.status()["chat-1"] is S.STANDBY
    assert h.status()["chat-2"] in (S.DRAINING, S.TERMINATED)   # a sleeping replica came first
    # Out of rotation at once, listed draining while its requests finish; not asleep yet.
    assert h.pool_ids() == ["chat-0"]
    assert [e.id for e in h.pools.pools["chat-model"] if e.draining] == ["chat-1"]
    assert h.engines.sleep_calls == []
    h.pools.in_flight_by_id = {"chat-1": 0}
    await h.tick()
    assert [c for _, c in h.engines.sleep_calls] == ["sleep"]
    assert [e.id for e in h.pools.pools["chat-model"]] == ["chat-0"]
    assert h.backend.by_replica("chat-1").signals == []   # kept running, asleep


async def test_standby_off_drains_standby_and_shutdown_stops_it(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, **SIM)], stop_grace_s=0.1)
    await h.tick()
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)
    assert h.status()["chat-1"] is S.STANDBY
    await h.c.shutdown(timeout_s=5, interval_s=0.01)
    assert h.backend.alive() == [] and set(h.status().values()) == {S.TERMINATED}


async def test_a_failed_wake_fails_the_replica_with_the_reason(tmp_path):
    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, **SIM)])
    await h.tick()
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)

    async def broken(endpoint, timeout_s):
        raise EngineRequestError("POST /wake_up: HTTP 500: boom")

    h.engines.wake_up = broken
    h.c.set_desired("chat", 2)
    await h.tick(n=2)
    r = h.c.replicas["chat-1"]
    assert r.status is S.FAILED_WARMUP and "POST /wake_up failed" in r.failure.reason


async def test_crd_status_counts_standby_and_says_why_it_is_off(tmp_path):
    from fleet.k8s.status import deployment_status

    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, **SIM)])
    await h.tick()
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)
    st = deployment_status(h.c, "chat", 1, None, 0.0)
    assert st["standbyReplicas"] == 1 and st["readyReplicas"] == 1 and "standbyUnsupported" not in st
    assert h.c.snapshot()["standby"]["chat"] == {"target": 1, "asleep": 1, "unsupported": None}

    cold = Harness(tmp_path, [write_deployment(tmp_path, name="cpu", replicas=1, standby={"maxReplicas": 1})])
    await cold.tick()
    assert list(cold.c.replicas) == ["cpu-0"]                       # no refill: vLLM on CPU cannot sleep
    st = deployment_status(cold.c, "cpu", 1, None, 0.0)
    assert st["standbyReplicas"] == 0 and "CPU build cannot sleep" in st["standbyUnsupported"]


def test_validate_notes_standby_and_why_it_is_off(tmp_path):
    from typer.testing import CliRunner

    from fleet.cli import app

    sim = write_deployment(tmp_path, name="sim", **SIM)
    cpu = write_deployment(tmp_path, name="cpu", standby={"maxReplicas": 1})
    result = CliRunner().invoke(app, ["validate", str(sim), str(cpu)])
    assert result.exit_code == 0, result.output
    assert "spec.standby: up to 1 replica(s) kept asleep" in result.output
    assert "spec.standby: vLLM's CPU build cannot sleep" in result.output


async def test_switching_standby_off_replaces_and_drains_the_standby_replica(tmp_path):
    from fleet.spec import load_deployments

    h = Harness(tmp_path, [write_deployment(tmp_path, replicas=1, **SIM)])
    await h.tick()
    h.make_healthy("chat-0", "chat-1")
    await h.tick(n=3)
    assert h.status()["chat-1"] is S.STANDBY
    h.c.apply(load_deployments([write_deployment(tmp_path, replicas=1, engine={"kind": "sim"})]))
    await h.tick(n=2)
    assert h.status()["chat-1"] in (S.DRAINING, S.TERMINATED)
    assert not any(r.standby_refill for r in h.c.replicas.values() if not r.status.terminal())
