"""The controller's placement requests carry the model's memory need (`fleet.controller.model_memory`):
read once per spec, from local files inline and from the hub in a thread that never holds the
tick; a model that fits no GPU waits with placement's reason (``fleet status``, the CRD's
Degraded condition) instead of failing at start-up; an unreadable or slow source is placed
without a need and read again later. Also `fleet up`'s preflight applies the driver/CUDA filter."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import pytest
import yaml

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.controller.reconcile import Controller, ControllerSettings
from fleet.k8s.status import deployment_status
from fleet.models import MemoryNeed, facts_from_config
from fleet.models.read import ModelSourceError
from fleet.placement import get_strategy
from fleet.spec import load_deployments
from fleet.testing.hub_server import HubRepo, HubServer
from tests.support.controller import Harness, write_deployment
from tests.support.fakes import FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink
from tests.support.inventories import cluster, node

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
L4 = "NVIDIA L4"
ARGS = ["--max-model-len", "8192"]


@pytest.fixture(autouse=True)
def _vllm(vllm_installed, monkeypatch):  # vLLM counts as installed (tests/conftest.py)
    # The fake backend starts replicas of hub sources too (the real ones fetch into the weight cache).
    monkeypatch.setattr("tests.support.fakes.engine_model", lambda want: want.deployment.spec.model.source)
    yield


class SpyPlacer:
    """The default strategy, remembering every request it is asked."""

    def __init__(self) -> None:
        self.inner = get_strategy()
        self.requests = []

    def place_replicas(self, request, inventory, in_use=None):
        self.requests.append(request)
        return self.inner.place_replicas(request, inventory, in_use)


class MemoryHarness(Harness):
    def __init__(self, tmp_path: Path, files: list[Path], gpu_node, reader=None) -> None:
        self.clock = FakeClock()
        self.backend = FakeBackend(gpu_node)
        self.engines = FakeEngineAPI()
        self.pools = FakePoolSink()
        self.events = []
        self.placer = SpyPlacer()
        self.c = Controller(load_deployments(files), backend=self.backend, engine_api=self.engines,
                            pool_sink=self.pools, clock=self.clock, sleep=self.clock.sleep, placer=self.placer,
                            settings=ControllerSettings(backoff_base_s=10), on_event=self.events.append,
                            memory_reader=reader)  # fmt: skip

    async def settled(self) -> None:
        await asyncio.wait_for(self.c.model_memory.settled(), timeout=30)


def gpu_deployment(tmp_path: Path, config: str | None, source: str = "./models/m", replicas: int = 1,
                   tp: int = 1) -> Path:
    if config is not None:
        (tmp_path / "models" / "m").mkdir(parents=True, exist_ok=True)
        (tmp_path / "models" / "m" / "config.json").write_text((CONFIGS / f"{config}.json").read_text())
    return write_deployment(tmp_path, replicas=replicas, model={"name": "chat-model", "source": source},
                            engine={"args": ARGS}, resources={"accelerator": "gpu", "tensorParallelSize": tp})


def counting(reader):
    calls = []

    def read(ld):
        calls.append(ld.serving_hash)
        return reader(ld)
    return read, calls


async def test_scale_up_requests_carry_the_models_memory_need_read_once(tmp_path):
    from fleet.controller.model_memory import read_memory_need

    reader, calls = counting(read_memory_need)
    h = MemoryHarness(tmp_path, [gpu_deployment(tmp_path, "llama-3.1-8b-instruct", replicas=2)],
                      node("gpu-0", n=2), reader)
    await h.tick()
    assert h.status() == {"chat-0": S.STARTING, "chat-1": S.STARTING}
    memory = h.placer.requests[0].memory
    assert isinstance(memory, MemoryNeed) and memory.facts.layers == 32 and memory.context_tokens == 8192
    h.backend.exit("chat-1", 1)
    await h.tick(n=12)   # replaced after the backoff: placed again with the same need, not read again
    assert "chat-2" in h.c.replicas and h.placer.requests[-1].memory == memory
    assert len(calls) == 1


async def test_a_model_that_fits_no_gpu_waits_with_the_reason(tmp_path):
    # Llama 3.1 70B at TP=1: 131 GiB of weights; an L4 holds 22.5 GiB.
    h = MemoryHarness(tmp_path, [gpu_deployment(tmp_path, "llama-3.1-70b-instruct")],
                      node("l4-box", n=2, product=L4, memory_mib=23034))
    await h.tick(n=5)
    assert h.status() == {"chat-0": S.PENDING}
    assert h.backend.ensure_calls == []   # nothing started to fail at start-up
    why = h.c.waiting_reason("chat-0")
    assert f"model does not fit {L4} (23034 MiB): needs " in why, why
    # fleet status reads the state snapshot; the operator the CRD status's Degraded condition.
    [row] = h.c.snapshot()["replicas"]
    assert row["waiting_reason"] == why
    status = deployment_status(h.c, "chat", 1, None, 0.0)
    [degraded] = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "Unplaceable")
    assert f"model does not fit {L4}" in degraded["message"]


async def test_a_slow_model_source_does_not_hold_the_tick(tmp_path):
    release = threading.Event()
    started = threading.Event()
    need = MemoryNeed(facts_from_config(json.loads((CONFIGS / "qwen2.5-7b-instruct.json").read_text())))

    def slow(ld):
        started.set()
        release.wait(30)
        return need

    reader, calls = counting(slow)
    f = gpu_deployment(tmp_path, None, source="hf://org/slow")
    h = MemoryHarness(tmp_path, [f], node("gpu-0", n=2), reader)
    try:
        began_s = time.monotonic()
        await h.tick()
        assert time.monotonic() - began_s < 10   # the read waits 30 s: the tick did not
        assert h.status() == {"chat-0": S.STARTING}   # placed without the need meanwhile
        assert h.placer.requests[0].memory is None
        assert started.wait(30)
        await h.tick(n=2)
        assert len(calls) == 1   # one read in flight, not one per tick
    finally:
        release.set()
    await h.settled()
    assert h.c._wake.is_set()   # the next tick comes at once
    h.c.set_desired("chat", 2)
    await h.tick()
    assert h.placer.requests[-1].memory is need and h.status()["chat-1"] is S.STARTING


async def test_an_unreadable_source_is_placed_without_a_need_and_read_again_later(tmp_path):
    def broken(ld):
        raise ModelSourceError("hf://org/gone: repository 'org/gone' not found on http://hub")

    reader, calls = counting(broken)
    h = MemoryHarness(tmp_path, [gpu_deployment(tmp_path, None, source="hf://org/gone")], node("gpu-0", n=2), reader)
    await h.tick()
    await h.settled()
    ld = h.c.deployments["chat"].loaded
    assert "not found" in h.c.model_memory.unknown_reason(ld)
    h.c.set_desired("chat", 2)
    await h.tick()
    assert h.status() == {"chat-0": S.STARTING, "chat-1": S.STARTING}
    assert [r.memory for r in h.placer.requests] == [None, None] and len(calls) == 1
    h.clock.advance(h.c.model_memory.retry_after_s)
    h.c.model_memory.need(ld)
    await h.settled()
    assert len(calls) == 2


async def test_a_read_past_its_timeout_is_given_up(tmp_path):
    release = threading.Event()
    h = MemoryHarness(tmp_path, [gpu_deployment(tmp_path, None, source="hf://org/stuck")], node("gpu-0", n=2),
                      lambda ld: release.wait(30))
    h.c.model_memory.timeout_s = 0.05
    try:
        await h.tick()
        await h.settled()
        assert "no answer within 0.05 s" in h.c.model_memory.unknown_reason(h.c.deployments["chat"].loaded)
        assert h.status() == {"chat-0": S.STARTING}
    finally:
        release.set()


async def test_a_hub_model_too_big_waits_with_the_reason_after_its_first_read(tmp_path, monkeypatch):
    """The operator's path (no weight cache on its machine): config.json and the index from the hub
    stand-in through huggingface_hub, in a thread; the replica placed before the read finished
    fails once, its replacement waits with the reason instead of failing again."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("FLEET_CACHE_DIR", str(tmp_path / "fleet-cache"))
    files = {
        "config.json": (CONFIGS / "llama-3.1-70b-instruct.json").read_bytes(),
        "model.safetensors.index.json": json.dumps({"metadata": {"total_size": 141_107_412_992}}).encode(),
    }
    with HubServer({"meta-llama/Llama-3.1-70B-Instruct": HubRepo(files)}) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        f = gpu_deployment(tmp_path, None, source="hf://meta-llama/Llama-3.1-70B-Instruct")
        h = MemoryHarness(tmp_path, [f], node("l4-box", n=2, product=L4, memory_mib=23034))
        await h.tick()
        await h.settled()
    assert h.status() == {"chat-0": S.STARTING}
    h.backend.exit("chat-0", 1, "ValueError: ... larger than the maximum number of tokens that can be stored in KV cache")
    await h.tick(n=12)
    assert h.status()["chat-0"] is S.FAILED_START and h.status()["chat-1"] is S.PENDING
    assert f"model does not fit {L4} (23034 MiB)" in h.c.waiting_reason("chat-1")
    assert "weights 131.42 GiB" in h.c.waiting_reason("chat-1")
    assert h.backend.ensure_calls == ["chat-0"]


def test_fleet_up_preflight_refuses_an_engine_no_driver_can_run(tmp_path):
    from fleet.local.preflight import PreflightError, preflight

    f = write_deployment(tmp_path, replicas=1, engine={"kind": "vllm", "cudaVersion": "13.0"},
                         resources={"accelerator": "gpu", "tensorParallelSize": 1})
    old = cluster(node("gpu-box", n=2, driver_version="535.104.05"))
    with pytest.raises(PreflightError) as err:
        preflight(load_deployments([f]), old, {})
    [problem] = [p for p in err.value.problems if "spec.resources" in p]
    assert "driver 535.104.05 supports CUDA up to 12.2, the engine needs CUDA 13.0" in problem, problem
    new = cluster(node("gpu-box", n=2, driver_version="580.159.04"))
    try:
        preflight(load_deployments([f]), new, {})
    except PreflightError as err:   # the engine or weights may be missing here; the driver is not the problem
        assert not [p for p in err.problems if "spec.resources" in p], err.problems


def test_asked_outside_an_event_loop_a_hub_source_is_not_read(tmp_path):
    from fleet.controller.model_memory import ModelMemory

    reader, calls = counting(lambda ld: None)
    [ld] = load_deployments([gpu_deployment(tmp_path, None, source="hf://org/x")])
    memory = ModelMemory(FakeClock(), reader)
    assert memory.need(ld) is None and calls == []   # the controller's next tick starts the read


def test_fleet_up_preflight_reads_the_need_where_the_controller_does_and_never_asks_the_hub(tmp_path, monkeypatch):
    """One reading of the memory need (fleet/controller/model_memory.py): a hub model in this
    machine's weight cache is read from there by the preflight as by the controller, and refused
    when no GPU holds it; one not cached is not read before anything starts (no hub call)."""
    from fleet.controller.model_memory import memory_need_or_reason, read_memory_need
    from fleet.local.preflight import PreflightError, preflight

    cached = tmp_path / "weight-cache" / "org--big"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text((CONFIGS / "llama-3.1-70b-instruct.json").read_text())
    monkeypatch.setattr("fleet.agent.cache.cached_hub_dir", lambda source, root=None:
                        cached if source == "hf://org/big" else None)  # fmt: skip
    asked = []
    monkeypatch.setattr("fleet.models.read._facts_from_hub", lambda src: asked.append(src) or None)
    inv = cluster(node("gpu-box", n=2))
    [big] = load_deployments([gpu_deployment(tmp_path, None, source="hf://org/big")])
    with pytest.raises(PreflightError) as err:
        preflight([big], inv, {})
    [problem] = [p for p in err.value.problems if "spec.resources" in p]
    assert "model does not fit" in problem, problem
    assert read_memory_need(big) == memory_need_or_reason(big, hub=False)[0] is not None   # the controller's reading
    [other] = load_deployments([gpu_deployment(tmp_path, None, source="hf://org/other")])
    try:
        preflight([other], inv, {})
    except PreflightError as err:   # the engine may be missing here; the model is not read
        assert not [p for p in err.problems if "spec.resources" in p], err.problems
    assert memory_need_or_reason(other, hub=False) == (None, None) and asked == []


def long_context_deployment(tmp_path: Path, max_model_len: str, env: dict | None = None) -> Path:
    """Qwen2.5-7B (``max_position_embeddings`` 32,768) at ``--max-model-len max_model_len``."""
    (tmp_path / "models" / "m").mkdir(parents=True, exist_ok=True)
    (tmp_path / "models" / "m" / "config.json").write_text((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    return write_deployment(tmp_path, replicas=1, model={"name": "chat-model", "source": "./models/m"},
                            engine={"args": ["--max-model-len", max_model_len], "env": env or {}},
                            resources={"accelerator": "gpu", "tensorParallelSize": 1})


TOO_LONG = ("--max-model-len 65,536 is above the model's maximum 32,768 (max_position_embeddings=32768 in "
            "config.json): vLLM refuses it at start (_get_and_verify_max_len in vllm/config/model.py)")


async def test_a_max_model_len_vllm_refuses_waits_with_the_reason_as_a_model_too_big_does(tmp_path):
    # Memory is no obstacle (an H100 holds Qwen2.5-7B at 65,536 tokens): vLLM's length rule is.
    h = MemoryHarness(tmp_path, [long_context_deployment(tmp_path, "65536")], node("gpu-0", n=2))
    await h.tick(n=5)
    assert h.status() == {"chat-0": S.PENDING}
    assert h.backend.ensure_calls == []   # nothing started for vLLM to refuse
    why = h.c.waiting_reason("chat-0")
    assert why.startswith("cannot place 1 of 1 replica (") and TOO_LONG in why, why
    [row] = h.c.snapshot()["replicas"]   # fleet status
    assert row["waiting_reason"] == why
    status = deployment_status(h.c, "chat", 1, None, 0.0)   # the operator's CRD status
    [degraded] = [c for c in status["conditions"] if c["type"] == "Degraded"]
    assert (degraded["status"], degraded["reason"]) == ("True", "Unplaceable") and TOO_LONG in degraded["message"]
    # The length vLLM takes, applied to the running controller (fleet apply): placed and started.
    h.c.apply(load_deployments([long_context_deployment(tmp_path, "32768")]))
    await h.tick(n=3)
    started = [rid for rid, s in h.status().items() if s is S.STARTING]
    assert started and h.backend.ensure_calls == started


async def test_a_cpu_replicas_max_model_len_vllm_refuses_waits_with_the_reason(tmp_path):
    (tmp_path / "models" / "m").mkdir(parents=True)
    (tmp_path / "models" / "m" / "config.json").write_text((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    f = write_deployment(tmp_path, replicas=1, model={"name": "chat-model", "source": "./models/m"},
                         engine={"args": ["--max-model-len", "65536"]}, resources={"accelerator": "cpu"})
    h = MemoryHarness(tmp_path, [f], node("cpu-0", n=0, cpu_cores=(0, 1)))
    await h.tick(n=5)
    assert h.status() == {"chat-0": S.PENDING} and h.backend.ensure_calls == []
    assert TOO_LONG in h.c.waiting_reason("chat-0")


async def test_vllm_allow_long_max_model_len_in_the_engine_env_lets_the_length_through(tmp_path):
    f = long_context_deployment(tmp_path, "65536", env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"})
    h = MemoryHarness(tmp_path, [f], node("gpu-0", n=2))
    await h.tick()
    assert h.status() == {"chat-0": S.STARTING}
    assert h.placer.requests[0].memory.context_tokens == 65536


async def test_a_refused_length_preempts_nothing(tmp_path):
    """A deployment below its minimum preempts lower-priority replicas only for a replica that
    can start: never for one vLLM would refuse."""
    low = write_deployment(tmp_path, name="batch", replicas=2, priority=0,
                           resources={"accelerator": "gpu", "tensorParallelSize": 1})
    f = long_context_deployment(tmp_path, "65536")
    doc = yaml.safe_load(f.read_text())
    doc["spec"].update(priority=100, replicas={"min": 1, "max": 2, "initial": 1})
    f.write_text(yaml.safe_dump(doc))
    h = MemoryHarness(tmp_path, [low, f], node("gpu-0", n=2))
    await h.tick(n=5)
    assert h.status()["batch-0"] is S.STARTING and h.status()["batch-1"] is S.STARTING
    assert h.status()["chat-0"] is S.PENDING and TOO_LONG in h.c.waiting_reason("chat-0")
    assert not h.c.preemption.recent
    assert [r.drain_requested_at_s for r in h.c.replicas.values() if r.deployment == "batch"] == [None, None]
    assert "would not make room for a replica of chat" in h.c.waiting_reason("chat-0")
