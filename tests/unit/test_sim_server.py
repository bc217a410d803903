"""fleet.enginesim.server: the simulator's HTTP surface over real loopback sockets, in-process.

Step costs are a few milliseconds so tests run fast; time assertions are lower bounds the
model guarantees (a step's tokens are never delivered before the step ends), never upper ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from fleet.enginesim.cost import StepCost
from fleet.enginesim.faults import FaultPlan
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.enginesim.runner import bind_socket
from fleet.enginesim.server import ReplicaSettings, SimReplica
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.asyncio

STEP_S = 0.004
FAST = Profile(
    name="test-fast", model="sim-model", hardware="nothing (unit test)",
    config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=256,
                        max_model_len=512),
    cost=StepCost(fixed_s=STEP_S, per_token_s=1e-5), typical_startup_s=0.0, notes="unit tests",
)  # fmt: skip
WAIT = aiohttp.ClientTimeout(total=20)


@contextlib.asynccontextmanager
async def replica(**kw) -> AsyncIterator[tuple[SimReplica, aiohttp.ClientSession]]:
    dead: list[str] = []
    r = SimReplica(ReplicaSettings(profile=FAST, served_model_name="sim-model", **kw),
                   on_dead=lambda rep, why: dead.append(why))  # fmt: skip
    r.dead_calls = dead  # type: ignore[attr-defined]
    sock = bind_socket("127.0.0.1", 0)
    await r.start(sock)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{r.port}", timeout=WAIT) as client:
            yield r, client
    finally:
        await r.close()


async def sse(resp: aiohttp.ClientResponse) -> list[tuple[float, object]]:
    """(arrival time, parsed event) of each SSE event; "[DONE]" stays a string."""
    out = []
    async for raw in resp.content:
        line = raw.strip()
        if line.startswith(b"data:"):
            payload = line[5:].strip().decode()
            out.append((time.monotonic(), payload if payload == "[DONE]" else json.loads(payload)))
    return out


async def test_models_and_health_say_it_is_a_simulator():
    async with replica(model_source="sim://test-fast") as (r, c):
        async with c.get("/health") as resp:
            assert resp.status == 200
        async with c.get("/v1/models") as resp:
            doc = await resp.json()
        m = doc["data"][0]
        assert m["id"] == "sim-model" and m["max_model_len"] == 512
        assert "SIMULATOR" in m["simulator"]["note"] and m["owned_by"] == "fleet-sim"


async def test_completion_counts_tokens_and_reports_usage_like_vllm():
    async with replica() as (r, c):
        body = {"model": "sim-model", "prompt": "hi " * 40, "max_tokens": 7}
        async with c.post("/v1/completions", json=body) as resp:
            assert resp.status == 200
            doc = await resp.json()
    assert doc["object"] == "text_completion" and doc["model"] == "sim-model"
    assert doc["usage"] == {"prompt_tokens": 40, "completion_tokens": 7, "total_tokens": 47}
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "length" and len(choice["text"].split()) == 7
    assert doc["system_fingerprint"] == "fleet-sim-test-fast"


async def test_prompt_tokens_details_report_the_prefix_cache_hit_as_vllm_does():
    # vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, the prompt
    # tokens found in the prefix cache (whole 16-token blocks), in whole and streamed answers.
    prompt = list(range(100, 100 + 100))
    async with replica(prompt_tokens_details=True) as (r, c):
        usages = []
        for stream in (False, True):
            body = {"prompt": prompt, "max_tokens": 2, "stream": stream, "stream_options": {"include_usage": True}}
            if not stream:
                del body["stream_options"]
            async with c.post("/v1/completions", json=body) as resp:
                usages.append((await resp.json())["usage"] if not stream else (await sse(resp))[-2][1]["usage"])
    assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}      # cold cache
    assert usages[1]["prompt_tokens_details"] == {"cached_tokens": 96}     # 6 full blocks of the first
    async with replica() as (r, c):   # off (vLLM's default): no details
        async with c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}) as resp:
            assert "prompt_tokens_details" not in (await resp.json())["usage"]


async def test_chat_completion_and_token_id_prompts():
    async with replica() as (r, c):
        chat = {"messages": [{"role": "user", "content": "hello " * 5}], "max_tokens": 3}
        async with c.post("/v1/chat/completions", json=chat) as resp:
            doc = await resp.json()
        assert doc["object"] == "chat.completion"
        assert doc["choices"][0]["message"]["role"] == "assistant"
        assert doc["usage"]["prompt_tokens"] == 7
        async with c.post("/v1/completions", json={"prompt": list(range(100, 333)), "max_tokens": 1}) as resp:
            assert (await resp.json())["usage"]["prompt_tokens"] == 233


async def test_streamed_completion_sends_one_chunk_per_token_paced_by_the_model():
    async with replica() as (r, c):
        body = {"prompt": "a b c", "max_tokens": 10, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.monotonic()
        async with c.post("/v1/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            events = await sse(resp)
    assert events[-1][1] == "[DONE]"
    usage = events[-2][1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    tokens = [(t, e) for t, e in events[:-2]]
    assert len(tokens) == 10
    assert [e["choices"][0]["finish_reason"] for _, e in tokens] == [None] * 9 + ["length"]
    times = [t for t, _ in tokens]
    assert times == sorted(times)
    # Ten steps of at least STEP_S each happened before the last token could be sent.
    assert times[-1] - t0 >= 10 * STEP_S * 0.9


async def test_streamed_chat_starts_with_the_role_and_omits_usage_unless_asked():
    async with replica() as (r, c):
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        async with c.post("/v1/chat/completions", json=body) as resp:
            events = [e for _, e in await sse(resp)]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[0]["object"] == "chat.completion.chunk"
    assert [bool(e["choices"][0]["delta"]["content"]) for e in events[1:-1]] == [True] * 3
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]"
    assert all("usage" not in e for e in events[:-1])


async def test_output_is_deterministic_under_a_seed():
    async def text(c, **extra) -> str:
        async with c.post("/v1/completions", json={"prompt": "same prompt", "max_tokens": 6, **extra}) as resp:
            return (await resp.json())["choices"][0]["text"]

    async with replica(seed=7) as (r, c):
        a, b, other = await text(c), await text(c), await text(c, seed=8)
    async with replica(seed=7) as (r, c):
        again = await text(c)
    assert a == b == again and a != other


async def test_ignore_eos_and_min_tokens_with_an_eos_model():
    async with replica(mean_output_tokens=2.0) as (r, c):
        lengths = []
        for i in range(20):
            async with c.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 30}) as resp:
                doc = await resp.json()
            lengths.append((doc["usage"]["completion_tokens"], doc["choices"][0]["finish_reason"]))
        assert any(reason == "stop" and n < 30 for n, reason in lengths)
        async with c.post("/v1/completions", json={"prompt": "p1", "max_tokens": 30, "ignore_eos": True}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 30
        async with c.post("/v1/completions", json={"prompt": "p1", "max_tokens": 30, "min_tokens": 25}) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] >= 25


@pytest.mark.parametrize("path,body,status,fragment", [
    ("/v1/completions", {"model": "other", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "max_model_len=512"),
    ("/v1/completions", {"prompt": "w " * 600}, 400, "maximum context length"),
    ("/v1/completions", {"prompt": "w " * 500, "max_tokens": 20}, 400, "too large"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "batched"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "n": 2}, 400, "n=1"),
    ("/v1/completions", {"prompt": "lone \udc80 surrogate"}, 400, "not valid Unicode"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udc80"}]}, 400, "not valid Unicode"),
])  # fmt: skip
async def test_bad_requests_get_vllm_style_errors(path, body, status, fragment):
    async with replica() as (r, c):
        async with c.post(path, json=body) as resp:
            assert resp.status == status
            err = (await resp.json())["error"]
    assert fragment in err["message"] and err["code"] == status


async def test_aiohttp_errors_come_in_vllm_json_shape_too():
    """A 10 MB prompt (over aiohttp's 1 MiB body limit), an unknown path and a deep JSON body get
    vLLM's JSON error shape, not aiohttp's text/plain."""
    async with replica() as (r, c):
        cases = [("POST", "/v1/completions", json.dumps({"prompt": "w" * 10_000_000}).encode(), 413),
                 ("GET", "/nope", None, 404), ("POST", "/v1/completions", b"[" * 50_000 + b"]" * 50_000, 400)]
        for method, path, data, status in cases:
            async with c.request(method, path, data=data, headers={"content-type": "application/json"}) as resp:
                assert resp.status == status and resp.content_type == "application/json", path
                err = (await resp.json())["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == status and err["message"]
        async with c.get("/health") as resp:
            assert resp.status == 200


async def test_a_client_that_goes_away_is_aborted_in_the_engine():
    async with replica() as (r, c):
        body = {"prompt": "x", "max_tokens": 400, "stream": True}
        async with c.post("/v1/completions", json=body) as resp:
            await resp.content.readline()                  # the first token arrived
        await async_wait_until(lambda: not r.model.has_work(), 30, what="the engine to drop the disconnected request")
        assert not r.model.has_work()
        assert r.model.pool.num_free == FAST.config.num_gpu_blocks
        async with c.get("/metrics") as resp:
            text = await resp.text()
        assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="sim-model"} 1.0' in text


async def test_metrics_follow_the_requests():
    async with replica() as (r, c):
        for _ in range(3):
            async with c.post("/v1/completions", json={"prompt": "hi " * 40, "max_tokens": 4}) as resp:
                assert resp.status == 200
        async with c.get("/metrics") as resp:
            text = await resp.text()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    lv = '{engine="0",model_name="sim-model"}'
    assert float(samples[f"vllm:time_to_first_token_seconds_count{lv}"]) == 3
    assert float(samples[f"vllm:e2e_request_latency_seconds_count{lv}"]) == 3
    assert float(samples[f"vllm:inter_token_latency_seconds_count{lv}"]) == 9
    assert float(samples[f"vllm:generation_tokens_total{lv}"]) == 12
    # The repeated prompt hits the prefix cache: 32 of its 40 tokens, twice.
    assert float(samples[f"vllm:prefix_cache_hits_total{lv}"]) == 64
    assert float(samples[f"vllm:num_requests_running{lv}"]) == 0
    assert "(Fleet engine SIMULATOR)" in text


async def test_startup_delay_keeps_the_port_closed_until_started():
    r = SimReplica(ReplicaSettings(profile=FAST, served_model_name="m", startup_delay_s=0.3))
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    start = asyncio.create_task(r.start(sock))
    try:
        async with aiohttp.ClientSession(timeout=WAIT) as c:
            with pytest.raises(aiohttp.ClientConnectionError):
                await c.get(f"http://127.0.0.1:{port}/health")
            await start
            async with c.get(f"http://127.0.0.1:{port}/health") as resp:
                assert resp.status == 200
    finally:
        await r.close()


async def test_fail_at_start_never_listens():
    dead = []
    r = SimReplica(ReplicaSettings(profile=FAST, served_model_name="m", faults=FaultPlan(fail_at_start=True)),
                   on_dead=lambda rep, why: dead.append(why))  # fmt: skip
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    await r.start(sock)
    assert r.state == "failed" and dead and "fail at start" in dead[0]
    async with aiohttp.ClientSession(timeout=WAIT) as c:
        with pytest.raises(aiohttp.ClientConnectionError):
            await c.get(f"http://127.0.0.1:{port}/health")


async def test_crash_after_n_requests_answers_n_then_dies():
    async with replica(faults=FaultPlan(crash_after_requests=2)) as (r, c):
        for _ in range(2):
            async with c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
                assert resp.status == 200
        await async_wait_until(lambda: r.state == "crashed", 30, what="the replica to crash after 2 requests")
        assert r.state == "crashed" and "crash after 2" in r.dead_calls[0]
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession(timeout=WAIT) as fresh:
                await fresh.get(f"http://127.0.0.1:{r.port}/health")


async def test_slowdown_switch_scales_the_models_step_times():
    async with replica(faults=FaultPlan(slowdown=2.0)) as (r, c):
        assert r.model.slowdown == 2.0
        async with c.post("/sim/faults", json={"slowdown": 5}) as resp:
            assert (await resp.json())["slowdown"] == 5.0
        async with c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 200
        async with c.get("/metrics") as resp:
            text = await resp.text()
        line = next(ln for ln in text.splitlines() if ln.startswith("vllm:e2e_request_latency_seconds_sum"))
        # Two steps of at least 5 x STEP_S each in the model's own time.
        assert float(line.rsplit(" ", 1)[1]) >= 2 * 5 * STEP_S * 0.99
        async with c.post("/sim/faults", json={"slowdown": 0}) as resp:
            assert resp.status == 400


async def test_a_failing_engine_step_fails_its_requests_with_500_and_the_replica_goes_on(monkeypatch):
    async with replica() as (r, c):
        real_step = r.model.step
        calls = {"n": 0}

        def broken_step(now_s):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("bug in the model")
            return real_step(now_s)

        monkeypatch.setattr(r.model, "step", broken_step)
        async with c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 500
            assert "bug in the model" in (await resp.json())["error"]["message"]
        async with c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}) as resp:
            assert resp.status == 200


async def test_a_client_gone_mid_stream_is_one_debug_line_not_a_traceback(monkeypatch, caplog):
    """The write that meets the closed connection (aiohttp's ClientConnectionResetError, raised
    here on the third write) ends the stream quietly; the request is aborted in the engine."""
    from aiohttp import web
    from aiohttp.client_exceptions import ClientConnectionResetError

    writes = []
    original = web.StreamResponse.write

    async def write(self, data):
        writes.append(data)
        if len(writes) == 3:
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await original(self, data)

    caplog.set_level("DEBUG")
    async with replica() as (r, c):
        monkeypatch.setattr(web.StreamResponse, "write", write)
        body = {"prompt": "x", "max_tokens": 400, "stream": True}
        async with c.post("/v1/completions", json=body) as resp:
            await resp.read()                      # the server ends the stream after the failed write
        monkeypatch.undo()
        await async_wait_until(lambda: not r.model.has_work(), 30, what="the engine to drop the request")
        assert r.answered == 0
    errors = [rec for rec in caplog.records if rec.levelname in ("ERROR", "WARNING") or rec.exc_info]
    gone = [rec for rec in caplog.records if "went away mid-stream" in rec.getMessage()]
    assert errors == [] and len(gone) == 1 and gone[0].levelname == "DEBUG", [(x.name, x.getMessage()) for x in caplog.records]
