"""The request path over real loopback sockets: router (uvicorn, in-process) in front of
fake engines (aiohttp.web or raw asyncio servers). Synchronisation is by events, never by
sleeping (router.request.proxy, router.http.app)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.http.app import RouterApp, create_app
from tests.support.router import FakeEngine, dead_endpoint, running_app
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.asyncio

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 10.0  # upper bound for any single wait; a pass never comes near it


@contextlib.asynccontextmanager
async def router(**kwargs: Any) -> AsyncIterator[tuple[RouterApp, aiohttp.ClientSession]]:
    app = create_app(TOKEN, **kwargs)
    timeout = aiohttp.ClientTimeout(total=WAIT_S)  # a hung request fails the test instead of hanging it
    async with running_app(app) as base, aiohttp.ClientSession(base, timeout=timeout) as client:
        yield app, client


async def put_pool(client: aiohttp.ClientSession, model: str, endpoints: list[dict[str, Any]],
                   policy: str = "latency-aware", **settings: Any) -> None:  # fmt: skip
    doc = {"policy": policy, "endpoints": endpoints, **settings}
    async with client.put(f"/admin/v1/pools/{model}", json=doc, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


def completion(model: str = "m", **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": "hi", "max_tokens": 4, **extra}


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_upstream(script: Script) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw HTTP/1.1 server: reads each request (head + Content-Length body), then runs
    `script(reader, writer)`. Yields its URL and a list counting accepted connections."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            await reader.readexactly(length)
            await script(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", connections
    finally:
        server.close()
        await server.wait_closed()


SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def http_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def counter_value(app: RouterApp, name: str, **labels: str) -> float:
    if "endpoint" in labels and not name.startswith("fleet_router_requests_in_flight"):
        labels.setdefault("version", "")  # per-endpoint series carry the endpoint's version
    value = app.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


# --- relaying ---------------------------------------------------------------------------


async def test_non_streaming_completion_is_relayed_with_body_unchanged() -> None:
    seen: list[tuple[bytes, str, str | None, str | None]] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        seen.append((await request.read(), request.query_string, request.headers.get("Authorization"),
                     request.headers.get("X-Custom")))  # fmt: skip  # not on the allow-list: not forwarded
        return web.json_response({"choices": [{"text": "ok"}]}, status=201)

    raw = b'{ "model" : "m",\n  "prompt": "hi",   "extra": [1, 2] }'
    async with FakeEngine(handler=handler) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url}])
        async with client.post("/v1/completions?api-version=2", data=raw,
                               headers={"Authorization": "Bearer user-key", "X-Custom": "1",
                                        "Content-Type": "application/json"}) as resp:  # fmt: skip
            assert resp.status == 201
            assert resp.content_type == "application/json"
            assert await resp.json() == {"choices": [{"text": "ok"}]}
    assert seen == [(raw, "api-version=2", "Bearer user-key", None)]
    state = app.pools.get("m").endpoints[0]  # type: ignore[union-attr]
    assert (state.requests_total, state.errors_total, state.in_flight) == (1, 0, 0)
    assert state.ewma_first_byte_s is not None and state.ewma_first_byte_s > 0


async def test_stream_chunk_reaches_client_before_engine_finishes() -> None:
    release = asyncio.Event()

    async def gated(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: chunk-1\n\n")
        await release.wait()
        await resp.write(b"data: chunk-2\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with FakeEngine(handler=gated) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url}])
        try:
            async with client.post("/v1/chat/completions",
                                   json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                         "stream": True}) as resp:  # fmt: skip
                assert resp.status == 200
                assert resp.content_type == "text/event-stream"
                first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S)
                assert first == b"data: chunk-1\n\n"
                assert not release.is_set()  # the engine is still holding the rest of the stream
                assert app.pools.get("m").endpoints[0].in_flight == 1  # type: ignore[union-attr]
                release.set()
                rest = await asyncio.wait_for(resp.content.read(), WAIT_S)
        finally:
            release.set()  # never leave the fake engine blocked, even when an assertion failed
        assert rest == b"data: chunk-2\n\ndata: [DONE]\n\n"
        assert app.pools.get("m").endpoints[0].in_flight == 0  # type: ignore[union-attr]


async def test_fake_engine_stream_relayed_in_full() -> None:
    async with FakeEngine("e0", chunks=5) as engine, router() as (_, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url}])
        async with client.post("/v1/completions", json=completion(stream=True)) as resp:
            body = await resp.read()
    events = [e for e in body.decode().split("\n\n") if e]
    assert len(events) == 6 and events[-1] == "data: [DONE]"


async def test_upstream_errors_are_relayed_not_retried() -> None:
    async with FakeEngine("bad", status=500) as bad, FakeEngine("good") as good, router() as (app, client):
        await put_pool(client, "m", [{"id": "bad", "url": bad.url}])
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status == 500  # relayed, in OpenAI's error format (router.protocol.errors.relayed_error)
            assert (await resp.json())["error"]["type"] == "server_error" and len(bad.requests) == 1
        await put_pool(client, "m", [{"id": "bad", "url": bad.url}, {"id": "good", "url": good.url}])
        bad.status = 422
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status in (200, 422)
        assert len(bad.requests) + len(good.requests) == 2  # one attempt per request
        assert counter_value(app, "fleet_router_retries_total", model="m") == 0
        assert counter_value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="bad",
                             reason="http_5xx") == 1  # fmt: skip


# --- rejections -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", b'{"model": "m", "prompt": ', None),
        ("/v1/completions", b"\xff\xfe not utf-8", None),
        ("/v1/completions", b'["model", "m"]', None),
        ("/v1/completions", b'{"prompt": "hi"}', "model"),
        ("/v1/completions", b'{"model": 7, "prompt": "hi"}', "model"),
        ("/v1/completions", b'{"model": "m"}', "prompt"),
        ("/v1/chat/completions", b'{"model": "m"}', "messages"),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}', "messages"),
        ("/v1/completions", b'{"model": "m", "prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", None),  # too deep
    ],
)
async def test_malformed_requests_get_openai_style_400(path: str, body: bytes, param: str | None) -> None:
    async with router() as (_, client):
        async with client.post(path, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 400
            error = (await resp.json())["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


async def test_unknown_model_is_404_listing_known_models() -> None:
    async with FakeEngine() as engine, router() as (_, client):
        await put_pool(client, "llama-3-8b", [{"id": "e0", "url": engine.url}])
        await put_pool(client, "org/qwen-7b", [{"id": "e0", "url": engine.url}])
        async with client.post("/v1/completions", json=completion("gpt-9")) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
    assert error["code"] == "model_not_found"
    assert "gpt-9" in error["message"] and "llama-3-8b" in error["message"] and "org/qwen-7b" in error["message"]


async def test_pool_without_ready_endpoint_is_503_with_retry_after() -> None:
    async with FakeEngine() as engine, router(retry_after_s=3) as (app, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url, "draining": True}])
        await put_pool(client, "empty", [])
        for model in ("m", "empty"):
            async with client.post("/v1/completions", json=completion(model)) as resp:
                assert resp.status == 503
                assert resp.headers["Retry-After"] == "3"
                assert (await resp.json())["error"]["code"] == "no_ready_endpoint"
    assert engine.requests == []
    assert counter_value(app, "fleet_router_rejected_requests_total", model="m", code="503") == 1


# --- retries ----------------------------------------------------------------------------


async def test_connection_failure_is_retried_on_another_endpoint() -> None:
    sock, dead_url = dead_endpoint()
    n = 10
    try:
        async with FakeEngine("live") as live, router(failure_cooldown_s=0.0) as (app, client):
            await put_pool(client, "m", [{"id": "dead", "url": dead_url}, {"id": "live", "url": live.url}],
                           policy="round-robin")  # fmt: skip
            for _ in range(n):
                async with client.post("/v1/completions", json=completion()) as resp:
                    assert resp.status == 200
                    assert (await resp.json())["served_by"] == "live"
            dead = app.pools.get("m").endpoints[0]  # type: ignore[union-attr]
            retries = counter_value(app, "fleet_router_retries_total", model="m")
            # Round-robin alternates first choices, so every other request met the dead port first.
            assert retries == n / 2
            assert dead.errors_total == dead.requests_total == retries
            assert counter_value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="dead",
                                 reason="connect") == retries  # fmt: skip
            assert len(live.requests) == n
    finally:
        sock.close()


async def test_failed_endpoint_cools_down_on_router_clock() -> None:
    now = [1000.0]
    sock, dead_url = dead_endpoint()
    try:
        async with FakeEngine("live") as live, router(clock=lambda: now[0], failure_cooldown_s=5.0) as (app, client):
            await put_pool(client, "m", [{"id": "dead", "url": dead_url}, {"id": "live", "url": live.url}],
                           policy="round-robin")  # fmt: skip
            dead = app.pools.get("m").endpoints[0]  # type: ignore[union-attr]

            async def send(count: int) -> None:
                for _ in range(count):
                    async with client.post("/v1/completions", json=completion()) as resp:
                        assert resp.status == 200

            await send(4)
            assert dead.requests_total == 1  # tried once, then skipped while cooling down
            now[0] += 5.0
            await send(4)
            assert dead.requests_total == 2
    finally:
        sock.close()


async def test_all_endpoints_unreachable_is_502_after_bounded_attempts() -> None:
    socks_urls = [dead_endpoint() for _ in range(4)]
    try:
        async with router() as (app, client):
            await put_pool(client, "m", [{"id": f"d{i}", "url": url} for i, (_, url) in enumerate(socks_urls)])
            async with client.post("/v1/completions", json=completion()) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["code"] == "upstream_unavailable"
            pool = app.pools.get("m")
            assert pool is not None
            attempts = sum(e.requests_total for e in pool.endpoints)
            assert attempts == 3
            assert counter_value(app, "fleet_router_retries_total", model="m") == 2
    finally:
        for sock, _ in socks_urls:
            sock.close()


async def test_no_retry_once_upstream_sent_bytes() -> None:
    async def die_mid_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + http_chunk(b"data: chunk-1\n\n"))
        await writer.drain()
        writer.transport.abort()  # no terminating chunk: the stream is cut

    async with raw_upstream(die_mid_stream) as (dying_url, connections), FakeEngine("live") as live, \
            router() as (app, client):  # fmt: skip
        # Measure the live endpoint first, so latency-aware tries the unmeasured dying one first.
        await put_pool(client, "m", [{"id": "live", "url": live.url}])
        async with client.post("/v1/completions", json=completion()) as resp:
            assert resp.status == 200
        await put_pool(client, "m", [{"id": "live", "url": live.url}, {"id": "dying", "url": dying_url}],
                       migration_limit=0)  # fmt: skip

        async with client.post("/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status == 200
            first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S)
            assert first == b"data: chunk-1\n\n"
            # The cut stream ends cleanly with an OpenAI error event, not a truncated body.
            rest = await asyncio.wait_for(resp.content.read(), WAIT_S)
            error_event, done, tail = rest.split(b"\n\n")
            assert error_event.startswith(b"data: ") and done == b"data: [DONE]" and tail == b""
            error = json.loads(error_event[len(b"data: "):])["error"]
            assert error["code"] == "upstream_interrupted" and "dying" in error["message"]

        assert len(connections) == 1
        assert len(live.requests) == 1  # only the warm-up request: no retry
        assert counter_value(app, "fleet_router_retries_total", model="m") == 0
        dying = app.pools.get("m").endpoints[1]  # type: ignore[union-attr]
        assert (dying.requests_total, dying.errors_total, dying.in_flight) == (1, 1, 0)
        assert counter_value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="dying",
                             reason="interrupted") == 1  # fmt: skip


async def test_client_disconnect_mid_stream_closes_upstream_and_frees_slot() -> None:
    upstream_closed = asyncio.Event()

    async def stream_until_closed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(SSE_HEAD + http_chunk(b"data: chunk-1\n\n"))
        await writer.drain()
        await reader.read()  # returns b"" once the router closes the connection
        upstream_closed.set()

    async with raw_upstream(stream_until_closed) as (url, _), router() as (app, client):
        await put_pool(client, "m", [{"id": "slow", "url": url}])
        resp = await client.post("/v1/completions", json=completion(stream=True))
        assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), WAIT_S) == b"data: chunk-1\n\n"
        state = app.pools.get("m").endpoints[0]  # type: ignore[union-attr]
        assert state.in_flight == 1
        resp.close()  # drops the connection to the router mid-stream
        await asyncio.wait_for(upstream_closed.wait(), WAIT_S)
        assert state.in_flight == 0
        assert counter_value(app, "fleet_router_requests_in_flight", model="m", endpoint="slow") == 0


@pytest.mark.parametrize("head", [False, True], ids=["before-the-head", "after-the-head"])
async def test_client_disconnect_before_the_first_chunk_closes_upstream(head: bool) -> None:
    """The engine sends nothing, or the head of a streamed reply and then nothing (still
    prefilling; the router holds the head until the first chunk): a client that leaves meanwhile
    must not leave the engine's connection open (the engine would generate for nobody)."""
    waiting = asyncio.Event()
    upstream_closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if head:
            writer.write(SSE_HEAD)
            await writer.drain()
        waiting.set()
        await reader.read()  # returns b"" once the router closes the connection
        upstream_closed.set()

    async with raw_upstream(silent) as (url, _), router() as (app, client):
        await put_pool(client, "m", [{"id": "stuck", "url": url}])
        pending = asyncio.create_task(client.post("/v1/completions", json=completion(stream=head)))
        await asyncio.wait_for(waiting.wait(), WAIT_S)
        pending.cancel()  # the client gives up: aiohttp drops its connection to the router
        with contextlib.suppress(asyncio.CancelledError):
            await pending
        await asyncio.wait_for(upstream_closed.wait(), WAIT_S)
        state = app.pools.get("m").endpoints[0]  # type: ignore[union-attr]
        assert (state.in_flight, state.errors_total) == (0, 0)


async def test_a_huge_max_tokens_is_relayed_to_the_engine_not_a_router_error() -> None:
    """A non-streamed request's deadline grows with max_tokens; one past a float's range gets no
    deadline (the engine answers it) instead of an OverflowError (a 500 from the router)."""
    async with FakeEngine("e0") as engine, router() as (_, client):
        await put_pool(client, "m", [{"id": "e0", "url": engine.url}])
        body = b'{"model": "m", "prompt": "hi", "max_tokens": 1' + b"0" * 400 + b"}"
        async with client.post("/v1/completions", data=body, headers={"content-type": "application/json"}) as resp:
            assert resp.status == 200, await resp.text()


async def test_a_retry_goes_only_to_endpoints_still_ready_in_the_pool_as_it_is_now() -> None:
    """The first attempt answers 500 after the controller drained one endpoint and removed
    another: the retry may not go to either (the removed one's pod may be gone already), so with
    none left the engine's 500 is relayed."""
    first: list[str] = []
    release = asyncio.Event()

    def engine(name: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handle(request: web.Request) -> web.StreamResponse:
            await request.read()
            first.append(name)
            if len(first) == 1:
                await release.wait()
                return web.json_response({"error": {"message": "boom"}}, status=500)
            return web.json_response({"served_by": name, "choices": [{"text": "ok"}]})
        return handle

    async with FakeEngine("a", handler=engine("a")) as a, FakeEngine("b", handler=engine("b")) as b, \
            FakeEngine("c", handler=engine("c")) as c, router() as (app, client):  # fmt: skip
        urls = {"a": a.url, "b": b.url, "c": c.url}
        await put_pool(client, "m", [{"id": n, "url": u} for n, u in urls.items()])
        pending = asyncio.create_task(client.post("/v1/completions", json=completion()))
        await async_wait_until(lambda: len(first) == 1, WAIT_S, what="len(first) == 1")
        kept = first[0]
        drained = next(n for n in urls if n != kept)   # and the third is removed
        await put_pool(client, "m", [{"id": kept, "url": urls[kept]},
                                     {"id": drained, "url": urls[drained], "draining": True}])  # fmt: skip
        release.set()
        resp = await asyncio.wait_for(pending, WAIT_S)
        assert resp.status == 500 and first == [kept]
        resp.release()


# --- read-only endpoints ----------------------------------------------------------------


async def test_models_health_and_metrics() -> None:
    async with FakeEngine("e0") as engine, router(wall_clock=lambda: 1_700_000_000.5) as (_, client):
        await put_pool(client, "b-model", [{"id": "e0", "url": engine.url}])
        await put_pool(client, "a-model", [{"id": "e0", "url": engine.url}])
        async with client.get("/v1/models") as resp:
            assert await resp.json() == {"object": "list", "data": [
                {"id": "a-model", "object": "model", "created": 1_700_000_000, "owned_by": "fleet"},
                {"id": "b-model", "object": "model", "created": 1_700_000_000, "owned_by": "fleet"},
            ]}  # fmt: skip
        async with client.get("/health") as resp:
            assert resp.status == 200 and await resp.json() == {"status": "ok"}
        for stream in (False, True):
            async with client.post("/v1/completions", json=completion("a-model", stream=stream)) as resp:
                await resp.read()
        async with client.post("/v1/completions", json=completion("nope")) as resp:
            assert resp.status == 404
        async with client.get("/metrics") as resp:
            assert resp.status == 200
            assert resp.content_type == "text/plain"
            text = await resp.text()
    for needle in (
        'fleet_router_requests_total{code="200",endpoint="e0",model="a-model",version=""} 2.0',
        'fleet_router_time_to_first_byte_seconds_count{endpoint="e0",model="a-model",version=""} 2.0',
        'fleet_router_time_to_first_token_seconds_count{endpoint="e0",model="a-model",version=""} 1.0',
        'fleet_router_time_per_output_token_seconds_count{endpoint="e0",model="a-model",version=""}',
        'fleet_router_e2e_request_latency_seconds_bucket{endpoint="e0",le="+Inf",model="a-model",version=""} 2.0',
        'fleet_router_requests_in_flight{endpoint="e0",model="a-model"} 0.0',
        'fleet_router_endpoint_errors_total{endpoint="e0",model="a-model",reason="connect",version=""} 0.0',
        'fleet_router_pool_endpoints{model="a-model",state="ready"} 1.0',
        'fleet_router_rejected_requests_total{code="404",model="(unknown)"} 1.0',
        "# TYPE fleet_router_retries_total counter",
    ):
        assert needle in text, needle


async def test_other_methods_and_paths_are_not_proxied() -> None:
    async with router() as (_, client):
        async with client.get("/v1/completions") as resp:
            assert resp.status == 405
            assert resp.headers["Allow"] == "POST"
        async with client.post("/v1/embeddings", json={"model": "m"}) as resp:
            assert resp.status == 404


async def test_create_app_refuses_empty_token() -> None:
    with pytest.raises(ValueError):
        create_app("")
