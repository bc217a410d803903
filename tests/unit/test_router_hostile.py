"""The router under hostile input: every case answered with a 4xx in bounded time, in OpenAI's
error format, counted in the rejection metrics under a bounded label, while good requests keep
being served (router.http.app, router.http.admin, router.request.parse, router.request.refuse,
router.http.server, router.pools.spec).

Real loopback sockets, in-process router; raw sockets where a client must misbehave at the HTTP
level. Waits are on conditions with a deadline (`WAIT_S`), never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from router.http.app import MAX_ADMIN_BODY_BYTES, RouterApp, create_app
from router.stats.metrics import UNKNOWN_MODEL
from tests.support.router import FakeEngine, running_app
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.asyncio

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 10.0  # upper bound for any single wait; a pass never comes near it
SHORT_S = 0.5  # the body / head timeouts the router under test runs with (unless a test sets them)


@contextlib.asynccontextmanager
async def router(**server: Any) -> AsyncIterator[tuple[RouterApp, aiohttp.ClientSession, str]]:
    app = create_app(TOKEN)
    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    server = {"head_timeout_s": SHORT_S, "body_timeout_s": SHORT_S, **server}
    async with running_app(app, **server) as base, \
            aiohttp.ClientSession(base, timeout=timeout) as client:  # fmt: skip
        yield app, client, base


async def put_pool(client: aiohttp.ClientSession, model: str, endpoints: list[dict[str, Any]]) -> None:
    async with client.put(f"/admin/v1/pools/{model}", json={"endpoints": endpoints}, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


def rejected(app: RouterApp, model: str, code: int) -> float:
    value = app.metrics.registry.get_sample_value("fleet_router_rejected_requests_total",
                                                  {"model": model, "code": str(code)})  # fmt: skip
    return 0.0 if value is None else value


async def raw_exchange(base: str, data: bytes, *, then_wait: bool = True) -> bytes:
    """Open a connection, send `data` (possibly an incomplete request), and read until the router
    closes the connection; fails if that takes longer than WAIT_S."""
    parts = urlsplit(base)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        if data:
            writer.write(data)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), WAIT_S)  # read() returns at EOF: the router closed
    finally:
        writer.close()


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


def error_of(raw: bytes) -> dict[str, Any]:
    return json.loads(raw.split(b"\r\n\r\n", 1)[1])["error"]  # type: ignore[no-any-return]


@contextlib.asynccontextmanager
async def good_traffic(client: aiohttp.ClientSession, model: str) -> AsyncIterator[list[int]]:
    """Good requests sent one after another until the block ends; yields their statuses."""
    statuses: list[int] = []
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            async with client.post("/v1/completions", json={"model": model, "prompt": "hi"}) as resp:
                await resp.read()
                statuses.append(resp.status)

    task = asyncio.create_task(loop())
    try:
        yield statuses
        # it did run alongside
        await async_wait_until(lambda: len(statuses) >= 3, WAIT_S, what="3 good requests answered")
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


# --- the hostile cases of the issue, with good traffic flowing --------------------------


async def test_admin_token_is_checked_before_the_body_is_read_and_bodies_are_bounded() -> None:
    async with router() as (app, client, base):
        # Declares 200 MiB and sends none of it: the 401 comes from the head alone.
        head = (b"PUT /admin/v1/pools/m HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: 209715200\r\n")  # fmt: skip
        for auth in (b"", b"authorization: Bearer wrong\r\n", b"authorization: Basic " + TOKEN.encode() + b"\r\n",
                     b"authorization: Bearer \r\n"):  # fmt: skip
            raw = await raw_exchange(base, head + auth + b"\r\n")
            assert status_of(raw) == 401 and error_of(raw)["type"] == "authentication_error"
            assert b"www-authenticate: bearer" in raw.lower() and b"connection: close" in raw.lower()
        # With the token, a declared size over the limit is refused at once (413) ...
        raw = await raw_exchange(base, head + f"authorization: Bearer {TOKEN}\r\n\r\n".encode())
        assert status_of(raw) == 413
        # ... and so is a chunked body that grows past it, without holding all of it.
        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(MAX_ADMIN_BODY_BYTES // (1024 * 1024) + 2):
                yield b" " * (1024 * 1024)

        async with client.put("/admin/v1/pools/m", data=chunks(), headers=AUTH) as resp:
            assert resp.status == 413
        # An admin body that never arrives in full: 408.
        slow = head.replace(b"209715200", b"1000") + f"authorization: Bearer {TOKEN}\r\n\r\n{{".encode()
        raw = await raw_exchange(base, slow)
        assert status_of(raw) == 408
        async with client.get("/health") as resp:
            assert resp.status == 200
    assert rejected(app, "", 401) == 4 and rejected(app, "", 413) == 2 and rejected(app, "", 408) == 1


async def test_every_router_error_is_in_openai_format_and_counted() -> None:
    async with FakeEngine("e") as engine, router() as (app, client, _):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        cases = [
            ("GET", "/nope", None, 404, ""),
            ("POST", "/health", None, 405, ""),
            ("GET", "/v1/completions", None, 405, ""),
            ("POST", "/v1/completions", b"{not json", 400, ""),
            ("POST", "/v1/completions", b'{"prompt": "x"}', 400, ""),
            ("POST", "/v1/completions", b'{"model": "other", "prompt": "x"}', 404, UNKNOWN_MODEL),
            ("GET", "/admin/v1/pools/none", None, 404, ""),
            ("GET", "/admin/v1/stats?window_s=-1", None, 422, ""),
        ]
        for method, path, body, status, label in cases:
            before = rejected(app, label, status)
            async with client.request(method, path, data=body, headers=AUTH) as resp:
                assert resp.status == status, (method, path)
                error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (method, path)
            assert rejected(app, label, status) == before + 1, (method, path)


async def test_random_model_names_do_not_create_metric_series() -> None:
    async with FakeEngine("e") as engine, router() as (app, client, _):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        for i in range(50):
            async with client.post("/v1/completions", json={"model": f"random-{i}", "prompt": "x"}) as resp:
                assert resp.status == 404
        async with client.get("/metrics") as resp:
            text = await resp.text()
    series = [line for line in text.splitlines() if line.startswith("fleet_router_rejected_requests_total{")]
    assert series == [f'fleet_router_rejected_requests_total{{code="404",model="{UNKNOWN_MODEL}"}} 50.0']
    assert "random-" not in text


# --- large pools -------------------------------------------------------------------------


def pool_doc(n: int, prefix: str, url: str) -> dict[str, Any]:
    return {"endpoints": [{"id": f"{prefix}{i}", "url": url if i == 0 else f"http://10.0.{i // 256}.{i % 256}:9",
                           "draining": i > 0} for i in range(n)]}  # fmt: skip


async def test_a_pool_of_10000_endpoints_is_replaced_and_deleted_while_serving() -> None:
    """Functional half of proof 6 (the timing is loadtests/bench_pool_update.py's): a 10,000-
    endpoint pool is created, replaced and deleted, good requests answered throughout, and the
    replaced endpoints' metric series are gone."""
    # The server's default deadlines: a loop slowed by this test's big documents on a loaded
    # machine must not turn a good request into a 408.
    async with FakeEngine("e") as engine, router(head_timeout_s=10.0, body_timeout_s=60.0) as (app, client, _):
        await put_pool(client, "small", [{"id": "e", "url": engine.url}])
        async with good_traffic(client, "small") as statuses:
            async with client.put("/admin/v1/pools/big", json=pool_doc(10_000, "a", engine.url), headers=AUTH) as resp:
                assert resp.status == 200
                assert (await resp.json())["endpoints_total"] == 10_000
            async with client.post("/v1/completions", json={"model": "big", "prompt": "x"}) as resp:
                assert resp.status == 200  # served by a0, the only ready endpoint: its series exist now
            assert app.metrics.registry.get_sample_value(
                "fleet_router_requests_total", {"model": "big", "endpoint": "a0", "version": "", "code": "200"}) == 1
            async with client.put("/admin/v1/pools/big", json=pool_doc(10_000, "b", engine.url), headers=AUTH) as resp:
                assert resp.status == 200
            async with client.get("/admin/v1/pools/big", headers=AUTH) as resp:
                listed = (await resp.json())["endpoints"]
            assert len(listed) == 10_000 and listed[0]["id"] == "b0"
            async with client.delete("/admin/v1/pools/big", headers=AUTH) as resp:
                assert resp.status == 200
        assert set(statuses) == {200}
        async with client.get("/metrics") as resp:
            text = await resp.text()
    assert 'model="big"' not in text


async def test_a_version_change_moves_the_endpoint_to_new_series() -> None:
    async with FakeEngine("e") as engine, router() as (app, client, _):
        for version in ("v1", "v2"):
            await put_pool(client, "m", [{"id": "e", "url": engine.url, "version": version}])
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 200
        get = app.metrics.registry.get_sample_value
        labels = {"model": "m", "endpoint": "e", "code": "200"}
        assert get("fleet_router_requests_total", {**labels, "version": "v1"}) is None
        assert get("fleet_router_requests_total", {**labels, "version": "v2"}) == 1
        assert app.pools.get("m").endpoints[0].requests_total == 2  # type: ignore[union-attr]  # same state kept


async def test_a_bug_is_answered_500_in_openai_format(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    async with router() as (app, client, _):
        monkeypatch.setattr("router.request.parse.parse_request", broken)
        monkeypatch.setattr(app.pools, "stats", broken)
        monkeypatch.setattr("router.http.app.read_body", broken)   # the admin guard, before FastAPI
        for method, path in (("POST", "/v1/completions"), ("GET", "/admin/v1/stats"), ("PUT", "/admin/v1/pools/m")):
            async with client.request(method, path, json={"model": "m", "prompt": "x"}, headers=AUTH) as resp:
                assert resp.status == 500, path
                assert (await resp.json())["error"]["code"] == "internal_error"
        async with client.get("/health") as resp:
            assert resp.status == 200
    assert rejected(app, "", 500) == 3


async def test_a_request_the_http_parser_cannot_read_gets_400_in_openai_format() -> None:
    async with router() as (app, client, base):
        raw = await raw_exchange(base, b"GARBAGE\x00 / HTTP/1.1\r\n\r\n")
        assert status_of(raw) == 400 and error_of(raw)["code"] == "invalid_http_request"
        async with client.get("/health") as resp:
            assert resp.status == 200
    assert rejected(app, "", 400) == 1


async def test_an_endpoint_failing_before_its_answer_is_complete_counts_as_a_rejection() -> None:
    async def cut_short(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"cho")
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(cut_short, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        async with router() as (app, client, _):
            await put_pool(client, "m", [{"id": "cut", "url": url}])
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 502
                assert (await resp.json())["error"]["code"] == "upstream_error"
        assert rejected(app, "m", 502) == 1
    finally:
        server.close()
        await server.wait_closed()


# --- a restarted router: 503, not 404, for the models it served (router.http.remembered) ---------


async def test_a_restarted_router_answers_503_for_the_models_it_served_until_they_are_published(
        tmp_path: Path) -> None:  # fmt: skip
    path = tmp_path / "router-models.json"
    async with FakeEngine("e") as engine:
        first = create_app(TOKEN, models_path=path)
        async with running_app(first) as base, aiohttp.ClientSession(base) as client:
            for model in ("m", "gone"):
                await put_pool(client, model, [{"id": "e", "url": engine.url}])
            async with client.delete("/admin/v1/pools/gone", headers=AUTH) as resp:
                assert resp.status == 200
            assert first.models_file is not None
            await asyncio.wait_for(first.models_file.flushed(), WAIT_S)
        assert json.loads(path.read_text())["models"] == ["m"]

        second = create_app(TOKEN, models_path=path)  # the router restarted: no pool yet
        async with running_app(second) as base, aiohttp.ClientSession(base) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"] == "2"
                error = (await resp.json())["error"]
            assert error["code"] == "model_not_published" and set(error) == {"message", "type", "param", "code"}
            async with client.post("/v1/completions", json={"model": "gone", "prompt": "x"}) as resp:
                assert resp.status == 404   # deleted before the restart: unknown
            await put_pool(client, "m", [{"id": "e", "url": engine.url}])
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                assert resp.status == 200
    assert rejected(second, "m", 503) == 1 and rejected(second, UNKNOWN_MODEL, 404) == 1


async def test_an_unreadable_models_file_is_ignored_and_rewritten(tmp_path: Path) -> None:
    path = tmp_path / "router-models.json"
    path.write_bytes(b'{"version": 1, "models": ["m"')  # truncated
    app = create_app(TOKEN, models_path=path)
    async with FakeEngine("e") as engine, running_app(app) as base, aiohttp.ClientSession(base) as client:
        async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 404
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        assert app.models_file is not None
        await asyncio.wait_for(app.models_file.flushed(), WAIT_S)
    assert json.loads(path.read_text()) == {"version": 1, "models": ["m"]}


# --- request heads: limits on every read path --------------------------------------------


async def raw_in_reads(base: str, parts: list[bytes]) -> bytes:
    """Send `parts` as separate writes (each drained and given time to arrive on its own) and read
    until the router closes the connection."""
    address = urlsplit(base)
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        for part in parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.05)  # lets each part arrive as its own read; either way the limit holds
        return await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()


POST_HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


async def test_head_limits_hold_whether_the_head_comes_in_one_read_two_or_many() -> None:
    async with FakeEngine("e") as engine, router() as (app, client, base):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        body = b'{"model": "m", "prompt": "x"}'
        tail = b"content-length: %d\r\n\r\n" % len(body) + body
        many_small = b"".join(b"x-h%d: %s\r\n" % (i, b"v" * 700) for i in range(90))  # 63.8 KB, legal
        cases = [
            ("100 KB header, one read", [POST_HEAD + b"x-big: " + b"a" * 100_000 + b"\r\n" + tail], 431),
            ("60 KB header, one read", [POST_HEAD + b"x-big: " + b"a" * 60_000 + b"\r\n" + tail], 431),
            ("70 KB head, two reads", [POST_HEAD + many_small, b"x-more: " + b"b" * 8000 + b"\r\n" + tail], 431),
            ("100 KB of padding, one read", [POST_HEAD + b"x-pad: " + b" " * 100_000 + b"v\r\n" + tail], 431),
            ("101 header fields", [POST_HEAD + b"".join(b"x-%d: 1\r\n" % i for i in range(101)) + tail], 431),
            ("9 KB request target", [b"POST /v1/completions?q=" + b"q" * 9000 + b" HTTP/1.1\r\nhost: x\r\n" + tail],
             414),
        ]  # fmt: skip
        for name, parts, status in cases:
            raw = await raw_in_reads(base, parts)
            assert status_of(raw) == status, name
            assert error_of(raw)["code"] in ("request_header_fields_too_large", "uri_too_long"), name
            assert b"connection: close" in raw.lower(), name
        # A 64 KB head of many small fields is within every limit: served.
        raw = await raw_exchange(base, POST_HEAD + many_small + b"connection: close\r\n" + tail)
        assert status_of(raw) == 200
        # The second request of a kept-alive connection is held to the same limits ...
        address = urlsplit(base)
        reader, writer = await asyncio.open_connection(address.hostname, address.port)
        try:
            writer.write(POST_HEAD + tail)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            assert head.startswith(b"HTTP/1.1 200")
            await asyncio.wait_for(reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r")[0])),
                                   WAIT_S)  # fmt: skip
            writer.write(POST_HEAD + b"x-big: " + b"a" * 100_000 + b"\r\n" + tail)
            raw = await asyncio.wait_for(reader.read(), WAIT_S)
        finally:
            writer.close()
        assert status_of(raw) == 431
        # ... and a pipelined one refused in its head lets the answer before it finish, then closes.
        raw = await raw_exchange(base, POST_HEAD + tail + POST_HEAD + b"x-big: " + b"a" * 100_000 + b"\r\n" + tail)
        assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1") == 1
    assert rejected(app, "", 431) == 7 and rejected(app, "", 414) == 1


async def test_upgrade_requests_are_served_as_http1_or_refused_never_switched() -> None:
    async with router() as (app, client, base):
        ws = (b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: websocket\r\n"
              b"sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n")  # fmt: skip
        raw = await raw_exchange(base, ws)   # answered, then the connection closed
        assert status_of(raw) == 200 and raw.endswith(b'{"status":"ok"}')
        h2c = POST_HEAD + b"connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\ncontent-length: 2\r\n\r\n{}"
        raw = await raw_exchange(base, h2c)
        assert status_of(raw) == 400 and error_of(raw)["code"] == "upgrade_not_supported"


# --- what reaches the engine -------------------------------------------------------------


async def test_only_allow_listed_end_to_end_headers_reach_the_engine() -> None:
    seen: list[dict[str, str]] = []

    async def record(request: web.Request) -> web.StreamResponse:
        seen.append({k.lower(): v for k, v in request.headers.items()})
        await request.read()
        return web.json_response({"choices": []})

    sent = {"Authorization": "Bearer user-key", "X-Request-Id": "req-1", "traceparent": "00-ab-cd-01",
            "tracestate": "k=v", "X-Session-Id": "s1", "X-Custom": "1", "TE": "trailers", "Trailer": "x",
            "Keep-Alive": "timeout=5", "Proxy-Authorization": "Basic eA==", "Cookie": "a=b", "Accept-Encoding": "gzip",
            "Content-Type": "text/plain"}  # fmt: skip
    async with FakeEngine(handler=record) as engine, router() as (app, client, _):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        async with client.post("/v1/completions", data=b'{"model": "m", "prompt": "x"}', headers=sent) as resp:
            assert resp.status == 200
        # A header that Connection names is hop-by-hop, allow-listed or not.
        async with client.post("/v1/completions", data=b'{"model": "m", "prompt": "x"}',
                               headers={**sent, "Connection": "keep-alive, X-Request-Id"}) as resp:  # fmt: skip
            assert resp.status == 200
    own = {"host", "content-length", "user-agent", "accept"}   # what aiohttp sets for its own connection
    assert {k: v for k, v in seen[0].items() if k not in own} == {
        "authorization": "Bearer user-key", "x-request-id": "req-1", "traceparent": "00-ab-cd-01",
        "tracestate": "k=v", "content-type": "application/json"}  # fmt: skip
    assert "x-request-id" not in seen[1] and seen[1]["authorization"] == "Bearer user-key"
    assert seen[0].get("accept-encoding") in (None, "identity")


# --- admin bodies: a depth limit ----------------------------------------------------------


async def test_a_deeply_nested_admin_body_gets_400_naming_the_reason_while_serving() -> None:
    async with FakeEngine("e") as engine, router(head_timeout_s=10.0, body_timeout_s=60.0) as (app, client, _):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        async with good_traffic(client, "m") as statuses:
            for body in (b"[" * 50_000 + b"]" * 50_000, b'{"endpoints": ' * 50_000, b"{not json"):
                async with client.put("/admin/v1/pools/deep", data=body, headers=AUTH) as resp:
                    assert resp.status == 400
                    error = (await resp.json())["error"]
                assert error["code"] == "invalid_json" and error["message"].startswith("invalid JSON")
            assert "nested deeper than 16 levels" in error["message"] or "Expecting" in error["message"]
        assert set(statuses) == {200}
        assert app.pools.get("deep") is None
    assert rejected(app, "", 400) == 3 and rejected(app, "", 500) == 0


# --- engine errors, relayed in OpenAI's format -------------------------------------------


async def test_engine_errors_reach_the_client_in_openai_format_with_their_status() -> None:
    vllm_error = {"error": {"message": "This model's maximum context length is 512 tokens.",
                            "type": "BadRequestError", "param": None, "code": 400}}  # fmt: skip

    async def answer(request: web.Request) -> web.StreamResponse:
        doc = await request.json()
        kind = doc["prompt"]
        if kind == "vllm":
            return web.json_response(vllm_error, status=400)
        if kind == "text":
            return web.Response(text="Internal Server Error", status=500)
        if kind == "chunked":
            resp = web.StreamResponse(status=413, headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            await resp.write(b"too large")
            await resp.write_eof()
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})   # fails mid-stream
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\ndata: ' + json.dumps(
            {"error": {"message": "engine failed", "type": "InternalServerError", "param": None, "code": 500}}
        ).encode() + b"\n\ndata: [DONE]\n\n")  # fmt: skip
        await resp.write_eof()
        return resp

    async with FakeEngine(handler=answer) as engine, router() as (app, client, _):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        for prompt, status, code in (("vllm", 400, "context_length_exceeded"), ("text", 500, "internal_error"),
                                     ("chunked", 413, "request_too_large")):  # fmt: skip
            async with client.post("/v1/completions", json={"model": "m", "prompt": prompt}) as resp:
                assert resp.status == status and resp.content_type == "application/json", prompt
                error = (await resp.json())["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, prompt
        async with client.post("/v1/completions", json={"model": "m", "prompt": "stream", "stream": True}) as resp:
            events = (await resp.read()).split(b"\n\n")
        error = json.loads(events[1].removeprefix(b"data: "))["error"]
        assert (error["type"], error["code"], error["message"]) == ("server_error", "internal_error", "engine failed")


async def test_a_pipelined_request_after_a_large_body_is_not_mistaken_for_a_large_head() -> None:
    """Two requests in one write: the first with a 64 KB body, the second a small head whose first
    bytes fall inside the 64 KiB the router reads as a head. Counting those bytes against the
    second head would refuse it; both are answered."""
    async with FakeEngine("e") as engine, router() as (app, client, base):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        first_head = len(POST_HEAD + b"content-length: 65000\r\n\r\n")
        envelope = len(json.dumps({"model": "m", "prompt": ""}))
        big = json.dumps({"model": "m", "prompt": "x" * (65_536 - 20 - first_head - envelope)}).encode()
        small = b'{"model": "m", "prompt": "x"}'
        raw = await raw_exchange(base, POST_HEAD + b"content-length: %d\r\n\r\n" % len(big) + big + POST_HEAD +
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(small) + small)  # fmt: skip
        assert raw.count(b"HTTP/1.1 200") == 2
    assert rejected(app, "", 431) == 0
