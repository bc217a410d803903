"""Upstreams that break the protocol, through the router over real loopback sockets: an error event
inside a 200 stream fails the attempt (and ejects an engine that keeps sending one), a sized body
cut off or not a JSON object is retried elsewhere before the client sees a byte, a large body is
relayed as it arrives, and a stream that trickles or outlives its total-time limit is cut with an
OpenAI error event (router.request.attempt, router.request.relay, router.pools.upstream).

Waits are on conditions with a deadline (`WAIT_S`); the fake engines pace their bytes, and every
time bound asserted is a lower bound they guarantee or a generous upper bound (`WAIT_S`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
import pytest

from router.request.relay import MAX_BUFFERED_BODY_BYTES
from tests.support.router import FakeEngine
from tests.unit.test_router_proxy import WAIT_S, completion, counter_value, put_pool, raw_upstream, router

pytestmark = pytest.mark.asyncio

GOOD = {"id": "cmpl-good", "object": "text_completion", "model": "m",
        "choices": [{"index": 0, "text": "fine", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}  # fmt: skip


def token_event(text: str, id_: str = "cmpl-a") -> bytes:
    doc = {"id": id_, "object": "text_completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "text": text, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def stream_with_error_event(request: web.Request) -> web.StreamResponse:
    """A vLLM that answers 200 and reports its failure inside the stream."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(token_event("a"))
    await resp.write(b'data: {"error": {"message": "engine failed", "type": "InternalServerError", "code": 500}}\n\n')
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def test_an_engine_that_puts_an_error_event_in_every_stream_is_ejected() -> None:
    async with FakeEngine("bad", handler=stream_with_error_event) as bad, FakeEngine("good") as good, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "bad", "url": bad.url}, {"id": "good", "url": good.url}],
                       policy="round-robin", outlier_detection={"consecutive_gateway_failure": 2})  # fmt: skip
        bodies = []
        for _ in range(8):
            async with client.post("/v1/completions", json=completion(stream=True)) as resp:
                assert resp.status == 200
                bodies.append(await resp.read())
        assert counter_value(app, "fleet_router_endpoint_ejections_total", model="m", endpoint="bad",
                             reason="gateway") == 1  # fmt: skip
        pool = app.pools.get("m")
        assert pool is not None and pool.endpoints[0].ejected_until_s > 0
        errored = [b for b in bodies if b'"error"' in b]
        assert len(errored) == 2   # two in a row ejected it; the rest went to the good one
        assert all(b'"code": "internal_error"' in b or b'"code":"internal_error"' in b for b in errored)


async def test_a_200_whose_body_is_not_json_is_retried_on_another_endpoint() -> None:
    async def html(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="<html>upstream proxy error</html>", content_type="text/html")

    async with FakeEngine("bad", handler=html) as bad, FakeEngine("good") as good, router() as (app, client):
        await put_pool(client, "m", [{"id": "bad", "url": bad.url}, {"id": "good", "url": good.url}],
                       policy="round-robin")  # fmt: skip
        for _ in range(4):
            async with client.post("/v1/completions", json=completion()) as resp:
                assert resp.status == 200
                assert (await resp.json())["served_by"] == "good"
        pool = app.pools.get("m")
        assert pool is not None
        tried_bad = pool.endpoints[0].requests_total
        assert tried_bad >= 1 and pool.endpoints[0].errors_total == tried_bad
        assert counter_value(app, "fleet_router_retries_total", model="m") == tried_bad


async def test_a_sized_body_cut_before_any_byte_reached_the_client_is_retried() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"id\": ")
        await writer.drain()
        writer.transport.abort()

    async with raw_upstream(cut) as (cut_url, connections), FakeEngine("good") as good, router() as (app, client):
        await put_pool(client, "m", [{"id": "cut", "url": cut_url}, {"id": "good", "url": good.url}],
                       policy="round-robin")  # fmt: skip
        for _ in range(3):
            async with client.post("/v1/completions", json=completion()) as resp:
                assert resp.status == 200
                assert (await resp.json())["served_by"] == "good"
        assert len(connections) >= 1
        assert counter_value(app, "fleet_router_retries_total", model="m") == len(connections)
        assert counter_value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="cut",
                             reason="interrupted") == len(connections)  # fmt: skip


async def test_a_sized_body_cut_with_no_endpoint_left_is_a_502() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{")
        await writer.drain()
        writer.transport.abort()

    async with raw_upstream(cut) as (cut_url, _), router() as (app, client):
        await put_pool(client, "m", [{"id": "cut", "url": cut_url}])
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "upstream_error"


async def test_a_body_larger_than_the_buffer_is_relayed_whole_as_it_arrives() -> None:
    size = 3 * MAX_BUFFERED_BODY_BYTES
    filler = b"x" * (size - len(b'{"text": ""}'))
    body = b'{"text": "' + filler + b'"}'

    async def large(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = len(body)
        await resp.prepare(request)
        for start in range(0, len(body), 64 * 1024):
            await resp.write(body[start:start + 64 * 1024])
        await resp.write_eof()
        return resp

    async with FakeEngine("large", handler=large) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "large", "url": engine.url}])
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status == 200
            assert resp.headers["content-length"] == str(len(body))
            assert await resp.read() == body


async def trickle(request: web.Request) -> web.StreamResponse:
    """One token event, then one byte every 0.1 s: never silent, never a whole event."""
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(token_event("a"))
    for _ in range(1000):
        await resp.write(b" ")
        await asyncio.sleep(0.1)
    return resp


async def test_an_engine_trickling_bytes_is_cut_with_an_openai_error_event() -> None:
    limits = {"min_bytes_per_s": 50, "rate_window_s": 0.5}
    async with FakeEngine("slow", handler=trickle) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "slow", "url": engine.url}], stream_limits=limits, migration_limit=0)
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with client.post("/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status == 200
            body = await resp.read()
        assert loop.time() - began >= 0.5   # one whole window
        events = body.split(b"\n\n")
        assert events[0] == token_event("a").rstrip(b"\n")
        error = json.loads(events[1][len(b"data: "):])["error"]
        assert error["code"] == "upstream_interrupted" and "min_bytes_per_s" in error["message"]
        assert events[2] == b"data: [DONE]"
        assert counter_value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="slow",
                             reason="interrupted") == 1  # fmt: skip


async def test_a_stream_past_its_max_stream_duration_is_cut() -> None:
    async def endless(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(1000):
            await resp.write(token_event(str(i)))
            await asyncio.sleep(0.05)
        return resp

    async with FakeEngine("long", handler=endless) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "long", "url": engine.url}],
                       stream_limits={"max_stream_duration_s": 0.5}, migration_limit=0)  # fmt: skip
        loop = asyncio.get_running_loop()
        began = loop.time()
        async with client.post("/v1/completions", json=completion(stream=True)) as resp:
            body = await resp.read()
        assert loop.time() - began >= 0.5
        error_event = body.split(b"\n\n")[-3]
        error = json.loads(error_event[len(b"data: "):])["error"]
        assert "max_stream_duration_s" in error["message"]


async def test_a_request_with_no_head_by_its_max_stream_duration_gets_a_504() -> None:
    async def silent(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(WAIT_S)
        return web.json_response(GOOD)

    async with FakeEngine("silent", handler=silent) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "silent", "url": engine.url}],
                       stream_limits={"max_stream_duration_s": 0.3})  # fmt: skip
        doc: dict[str, Any] = completion()
        doc.pop("max_tokens")   # no first-token deadline for a non-streamed request without max_tokens
        async with client.post("/v1/completions", json=doc) as resp:
            assert resp.status == 504
            assert (await resp.json())["error"]["code"] == "upstream_timeout"


async def test_a_body_over_max_response_bytes_fails_the_attempt_before_any_byte() -> None:
    async def huge(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({**GOOD, "filler": "x" * 4000})

    async with FakeEngine("huge", handler=huge) as big, FakeEngine("good") as good, router() as (app, client):
        await put_pool(client, "m", [{"id": "huge", "url": big.url}, {"id": "good", "url": good.url}],
                       policy="round-robin", stream_limits={"max_response_bytes": 1000})  # fmt: skip
        for _ in range(3):
            async with client.post("/v1/completions", json=completion()) as resp:
                assert resp.status == 200 and (await resp.json())["served_by"] == "good"
        await put_pool(client, "m", [{"id": "huge", "url": big.url}], stream_limits={"max_response_bytes": 1000})
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status == 502


async def test_a_stream_whose_engine_dies_after_its_head_and_before_its_first_event_is_retried() -> None:
    async def head_only(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        await writer.drain()
        writer.transport.abort()

    async with raw_upstream(head_only) as (dying_url, connections), FakeEngine("good") as good, \
            router() as (app, client):  # fmt: skip
        await put_pool(client, "m", [{"id": "dying", "url": dying_url}, {"id": "good", "url": good.url}],
                       policy="round-robin")  # fmt: skip
        for _ in range(3):
            async with client.post("/v1/completions", json=completion(stream=True)) as resp:
                assert resp.status == 200
                body = await resp.read()
                assert b'"served_by": "good"' in body and body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
        assert len(connections) >= 1
        assert counter_value(app, "fleet_router_retries_total", model="m") == len(connections)
