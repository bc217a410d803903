"""Streamed replies through the router: whole SSE events, a clean error ending when the engine
dies mid-stream (read by the `openai` client), and the time to first token / time per output
token the router measures (router.protocol.sse, router.request.relay, router.request.attempt,
router.stats.metrics, router.stats.windows).

Time assertions are lower bounds the fake engines guarantee by pacing their events, never
upper bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from aiohttp import web

from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.enginesim.runner import bind_socket
from fleet.enginesim.server import ReplicaSettings, SimReplica
from router.http.app import RouterApp, create_app
from router.protocol.sse import MAX_PENDING_BYTES, SseRelay
from tests.support.router import FakeEngine, running_app

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 10.0
GAP_S = 0.02  # the fake engines' pacing between token events

SLOW = Profile(
    name="test-slow", model="sim-model", hardware="nothing (unit test)",
    config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=256,
                        max_model_len=1024),
    cost=StepCost(fixed_s=0.01, per_token_s=1e-5), typical_startup_s=0.0, notes="unit tests",
)  # fmt: skip


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[tuple[RouterApp, aiohttp.ClientSession, str]]:
    app = create_app(TOKEN)
    async with running_app(app) as base, \
            aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=WAIT_S)) as client:  # fmt: skip
        yield app, client, base


async def put_pool(client: aiohttp.ClientSession, model: str, url: str, version: str = "v1") -> None:
    doc = {"endpoints": [{"id": "e", "url": url, "version": version}]}
    async with client.put(f"/admin/v1/pools/{model}", json=doc, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


def sample(app: RouterApp, name: str, **labels: str) -> float:
    value = app.metrics.registry.get_sample_value(name, {"model": "m", "endpoint": "e", "version": "v1", **labels})
    return 0.0 if value is None else value


# --- SseRelay, pure -----------------------------------------------------------------------


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def text_event(text: str) -> bytes:
    return event({"choices": [{"index": 0, "text": text, "finish_reason": None}]})


def test_relay_holds_back_a_partial_event_until_its_end_arrives() -> None:
    relay = SseRelay()
    whole = text_event("a") + text_event("b")
    cut = len(text_event("a")) + 7
    assert relay.feed(whole[:cut], 1.0) == text_event("a")
    assert relay.feed(whole[cut:], 2.0) == text_event("b")
    assert (relay.first_token_s, relay.last_token_s, relay.token_events) == (1.0, 2.0, 2)
    assert relay.feed(b"data: [DO", 3.0) == b"" and relay.rest() == b"data: [DO"


def test_relay_output_does_not_depend_on_how_reads_split_the_stream() -> None:
    stream = (event({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) + text_event("a") +
              text_event("bc") + event({"choices": [], "usage": {"completion_tokens": 3}}) + b"data: [DONE]\n\n")
    for i in range(1, len(stream)):
        for j in range(i, len(stream), 7):
            relay = SseRelay()
            out = [relay.feed(stream[:i], 1.0), relay.feed(stream[i:j], 2.0), relay.feed(stream[j:], 3.0)]
            assert b"".join(out) + relay.rest() == stream
            assert all(chunk.endswith(b"\n\n") for chunk in out if chunk)  # whole events only
            assert (relay.token_events, relay.output_tokens()) == (2, 3)


def test_relay_counts_only_events_that_carry_generated_text() -> None:
    relay = SseRelay()
    chat_role = event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    content = event({"choices": [{"delta": {"content": " hi"}}]})
    reasoning = event({"choices": [{"delta": {"reasoning_content": "hmm"}}]})
    tool = event({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]})
    last = event({"choices": [{"delta": {"content": ""}, "finish_reason": "stop"}]})
    usage = event({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}})
    quoted = event({"choices": [{"text": "\"text\": \"x"}]})  # looks like a key inside a string: one token
    relay.feed(chat_role, 1.0)
    assert relay.first_token_s is None
    for t, chunk in enumerate((content, reasoning, tool, last, quoted, b"data: [DONE]\n\n"), start=2):
        relay.feed(chunk, float(t))
    assert relay.token_events == 4 and relay.usage_tokens is None
    relay.feed(usage, 9.0)
    assert relay.output_tokens() == 7 and (relay.first_token_s, relay.last_token_s) == (2.0, 6.0)
    assert relay.time_per_output_token_s() == pytest.approx((6.0 - 2.0) / 6)


def test_relay_handles_crlf_streams_and_gives_up_holding_without_boundaries() -> None:
    relay = SseRelay()
    crlf = b'data: {"choices":[{"text":"a"}]}\r\n\r\n'
    assert relay.feed(crlf + crlf[:5], 1.0) == crlf and relay.aligned
    relay = SseRelay()
    blob = b"x" * (MAX_PENDING_BYTES + 1)
    assert relay.feed(blob, 1.0) == blob and not relay.aligned


def test_no_tpot_from_a_single_read_or_a_single_token() -> None:
    relay = SseRelay()
    relay.feed(text_event("a") + text_event("b") + text_event("c"), 1.0)
    assert relay.token_events == 3 and relay.time_per_output_token_s() is None
    relay = SseRelay()
    relay.feed(text_event("a"), 1.0)
    assert relay.time_per_output_token_s() is None


# --- through the router ---------------------------------------------------------------------


def paced_engine(events: list[bytes], gaps_s: list[float]) -> Any:
    """An aiohttp handler that streams `events`, waiting `gaps_s[i]` before event i (or answers
    one JSON document to a request without `"stream": true`)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response({"choices": [{"index": 0, "text": "whole", "finish_reason": "stop"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for gap_s, data in zip(gaps_s, events, strict=True):
            if gap_s:
                await asyncio.sleep(gap_s)  # the engine's pacing, not a synchronisation
            await resp.write(data)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


@pytest.mark.asyncio
async def test_time_to_first_token_and_time_per_output_token_are_measured() -> None:
    role = event({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    tokens = [event({"choices": [{"delta": {"content": f" t{i}"}}]}) for i in range(5)]
    gaps = [0.0, 3 * GAP_S] + [GAP_S] * 4  # role at once; first token 3 gaps later; then one per gap
    async with FakeEngine(handler=paced_engine([role, *tokens], gaps)) as engine, router() as (app, client, _):
        await put_pool(client, "m", engine.url)
        async with client.post("/v1/chat/completions", json={"model": "m", "messages": [], "stream": True}) as resp:
            body = await resp.read()
        assert body.count(b"data: ") == 7 and body.endswith(b"data: [DONE]\n\n")
        first_byte_s = sample(app, "fleet_router_time_to_first_byte_seconds_sum")
        ttft_s = sample(app, "fleet_router_time_to_first_token_seconds_sum")
        # The role event is a byte, not a token (bounds leave room for timer and read jitter).
        assert ttft_s >= first_byte_s + 2 * GAP_S
        assert sample(app, "fleet_router_time_per_output_token_seconds_count") == 1
        assert sample(app, "fleet_router_time_per_output_token_seconds_sum") >= GAP_S / 2  # ~4 gaps / 4 intervals
        async with client.get("/admin/v1/stats", headers=AUTH) as resp:
            tpot = (await resp.json())["models"]["m"]["tpot_s"]
        assert tpot["samples"] == 1 and tpot["p50"] >= GAP_S / 2
        # A non-streamed reply gives a first-byte sample, no TTFT or TPOT sample.
        async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            await resp.read()
        assert sample(app, "fleet_router_time_to_first_byte_seconds_count") == 2
        assert sample(app, "fleet_router_time_to_first_token_seconds_count") == 1


@contextlib.asynccontextmanager
async def sim_replica() -> AsyncIterator[SimReplica]:
    replica = SimReplica(ReplicaSettings(profile=SLOW, served_model_name="m"))
    await replica.start(bind_socket("127.0.0.1", 0))
    try:
        yield replica
    finally:
        await replica.close()


@pytest.mark.asyncio
async def test_a_stream_cut_by_the_engines_death_ends_with_an_error_the_openai_client_raises() -> None:
    """Proof 4, router part: the simulated engine crashes mid-stream; the OpenAI client reads the
    router's error event as an `APIError`, not a broken connection or a silent end."""
    async with sim_replica() as replica, router() as (app, client, base):
        await put_pool(client, "m", f"http://127.0.0.1:{replica.port}")
        async with httpx.AsyncClient(trust_env=False, timeout=WAIT_S) as http:
            oai = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", http_client=http, max_retries=0)
            stream = await oai.completions.create(model="m", prompt="hello", max_tokens=500, stream=True,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
            received = []
            with pytest.raises(openai.APIError) as raised:
                async for chunk in stream:
                    received.append(chunk.choices[0].text)
                    if len(received) == 2:
                        replica.crash("test: the engine dies mid-stream")
        assert len(received) >= 2 and "failed mid-stream" in raised.value.message
        assert not isinstance(raised.value, openai.APIConnectionError)
        assert sample(app, "fleet_router_endpoint_errors_total", reason="interrupted") == 1
        assert app.pools.get("m").endpoints[0].in_flight == 0  # type: ignore[union-attr]
