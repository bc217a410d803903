"""Tokens in and out per model and version (router.protocol.tokens, router.stats.metrics): read from the
engine's usage object when there is one, from the stream's text events when not; the proxy
counts them over real loopback sockets in front of a fake engine answering as vLLM does."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp import web

from router.stats.metrics import RouterMetrics
from router.pools.pool import PoolTable
from router.kv.prompt_blocks import ROUTER_BLOCK_TOKENS, route_request
from router.pools.spec import PoolSpec
from router.protocol.sse import SseRelay
from router.protocol.tokens import TokenCount, body_tokens, stream_tokens
from tests.unit.test_router_proxy import completion, counter_value, put_pool, router
from tests.support.router import FakeEngine

# vLLM 0.x shapes (vllm/entrypoints/openai/serving_completion.py): a usage chunk has empty
# choices and comes last, before [DONE]; prompt_tokens_details is a nested object.
USAGE = {"prompt_tokens": 7, "total_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": None}


def event(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def text_event(text: str) -> bytes:
    return event({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]})


def relay(*chunks: bytes) -> SseRelay:
    sse = SseRelay()
    for i, chunk in enumerate(chunks):
        sse.feed(chunk, float(i))
    return sse


def test_a_whole_body_counts_its_usage() -> None:
    body = json.dumps({"choices": [{"text": "a \"prompt_tokens\": 99"}], "usage": USAGE}).encode()
    assert body_tokens(body) == TokenCount(7, 3, True)   # the escaped key inside a string is no key
    embeddings = json.dumps({"data": [], "usage": {"prompt_tokens": 5, "total_tokens": 5}}).encode()
    assert body_tokens(embeddings) == TokenCount(5, 0, True)
    assert body_tokens(b'{"choices": [{"text": "ok"}]}') == TokenCount(None, 0, False)
    cached = json.dumps({"usage": {**USAGE, "prompt_tokens_details": {"cached_tokens": 5}}}).encode()
    assert body_tokens(cached) == TokenCount(7, 3, True, cached=5)


def test_a_stream_reads_the_cached_tokens_of_its_usage_chunk() -> None:
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 6}}
    sse = relay(text_event("a"), event({"choices": [], "usage": usage}), b"data: [DONE]\n\n")
    assert stream_tokens(sse) == TokenCount(7, 3, True, cached=6)
    assert stream_tokens(relay(text_event("a"), event({"choices": [], "usage": USAGE}))).cached is None


def test_a_stream_with_a_usage_chunk_counts_the_usage_not_the_events() -> None:
    sse = relay(text_event("a"), text_event("bc"), event({"choices": [], "usage": USAGE}), b"data: [DONE]\n\n")
    assert sse.token_events == 2
    assert stream_tokens(sse) == TokenCount(7, 3, True)


def test_a_stream_without_usage_counts_its_text_events_and_no_prompt() -> None:
    # The usage key split over two reads still parses: SseRelay counts whole events.
    sse = relay(text_event("a") + text_event("b")[:9], text_event("b")[9:] + text_event("c"), b"data: [DONE]\n\n")
    assert stream_tokens(sse) == TokenCount(None, 3, False)


def test_counts_go_to_model_and_version_and_leave_with_the_pool() -> None:
    metrics = RouterMetrics()
    table = PoolTable(metrics, time.time)
    pool = table.put("m", PoolSpec.model_validate({"endpoints": [
        {"id": "e0", "url": "http://10.0.0.1:8000", "version": "v1"},
        {"id": "e1", "url": "http://10.0.0.2:8000", "version": "v1"}]}))
    for state in pool.endpoints:
        assert state.metrics is not None
        state.metrics.bind()
        state.metrics.count_tokens(TokenCount(7, 3, True))
    pool.endpoints[0].metrics.count_tokens(TokenCount(None, 4, False))  # type: ignore[union-attr]
    get = metrics.registry.get_sample_value
    labels = {"model": "m", "version": "v1"}
    assert get("fleet_router_prompt_tokens_total", labels) == 14
    assert get("fleet_router_generation_tokens_total", labels) == 10
    assert get("fleet_router_responses_without_usage_total", labels) == 1
    # An endpoint leaving its pool keeps the version's totals (the other endpoint still adds to them)...
    table.put("m", PoolSpec.model_validate({"endpoints": [{"id": "e1", "url": "http://10.0.0.2:8000",
                                                           "version": "v1"}]}))  # fmt: skip
    assert get("fleet_router_generation_tokens_total", labels) == 10
    # ... and the pool's deletion removes them.
    metrics.forget_pool("m")
    assert get("fleet_router_generation_tokens_total", labels) is None


@pytest.mark.asyncio
async def test_the_proxy_counts_tokens_of_whole_and_streamed_answers() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"choices": [{"text": "abc"}], "usage": USAGE})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for text in ("a", "b", "c", "d"):
            await resp.write(text_event(text))
        if body.get("stream_options", {}).get("include_usage"):
            await resp.write(event({"choices": [], "usage": {**USAGE, "completion_tokens": 4}}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with FakeEngine(handler=handler) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url, "version": "v1"}])
        for extra in ({}, {"stream": True, "stream_options": {"include_usage": True}}, {"stream": True}):
            async with client.post("/v1/completions", json=completion(**extra)) as resp:
                assert resp.status == 200
                await resp.read()
    labels = {"model": "m", "version": "v1"}
    assert counter_value(app, "fleet_router_prompt_tokens_total", **labels) == 7 + 7   # the third had no usage
    assert counter_value(app, "fleet_router_generation_tokens_total", **labels) == 3 + 4 + 4
    assert counter_value(app, "fleet_router_responses_without_usage_total", **labels) == 1


@pytest.mark.asyncio
async def test_error_answers_count_no_tokens() -> None:
    async with FakeEngine(status=400) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url}])
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status == 400
    assert counter_value(app, "fleet_router_responses_without_usage_total", model="m", version="") == 0


@pytest.mark.asyncio
async def test_the_proxy_counts_the_engines_prefix_cache_hits_beside_the_policys_prediction() -> None:
    # The engine says what its prefix cache held (usage.prompt_tokens_details.cached_tokens); the
    # router counts it beside what kv-aware expected there, over the same answers only.
    answers = iter([{"cached_tokens": 0}, {"cached_tokens": 900}, None])

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.json_response({"choices": [{"text": "ok"}],
                                  "usage": {**USAGE, "prompt_tokens_details": next(answers)}})  # fmt: skip

    prompt = " ".join(f"w{i}" for i in range(4000))   # many router blocks, the same each time
    async with FakeEngine(handler=handler) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url, "version": "v1"}], policy="kv-aware")
        for _ in range(3):
            async with client.post("/v1/completions", json=completion(prompt=prompt)) as resp:
                assert resp.status == 200
    labels = {"model": "m", "version": "v1"}
    assert counter_value(app, "fleet_router_prefix_cache_hits_total", **labels) == 900
    predicted = counter_value(app, "fleet_router_prefix_cache_predicted_hits_total", **labels)
    # The first answer was predicted cold (0); the second, every whole router block of the prompt
    # the first left there; the third (no details) is in neither counter, though kv-aware
    # predicted the same hit for it.
    blocks = route_request(completion(prompt=prompt), None, hash_blocks=True).block_hashes
    assert predicted == len(blocks) * ROUTER_BLOCK_TOKENS > 0
    assert counter_value(app, "fleet_router_prompt_tokens_total", **labels) == 3 * 7


def test_hit_and_predicted_counters_cover_the_same_answers() -> None:
    metrics = RouterMetrics()
    table = PoolTable(metrics, time.time)
    pool = table.put("m", PoolSpec.model_validate({"endpoints": [
        {"id": "e0", "url": "http://10.0.0.1:8000", "version": "v1"}]}))
    m = pool.endpoints[0].metrics
    assert m is not None
    m.bind()
    m.count_tokens(TokenCount(7, 3, True, cached=4), predicted_cached=6)
    m.count_tokens(TokenCount(7, 3, True), predicted_cached=6)    # the usage does not say: neither
    get = metrics.registry.get_sample_value
    labels = {"model": "m", "version": "v1"}
    assert get("fleet_router_prefix_cache_hits_total", labels) == 4
    assert get("fleet_router_prefix_cache_predicted_hits_total", labels) == 6
    metrics.forget_pool("m")
    assert get("fleet_router_prefix_cache_hits_total", labels) is None
