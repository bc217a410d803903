"""The router under hostile input: every case answered with a 4xx in bounded time, in OpenAI's
error format, counted in the rejection metrics under a bounded label, while good requests keep
being served (router.app, router.admin, router.proxy, router.server, router.spec).

Real loopback sockets, in-process router; raw sockets where a client must misbehave at the HTTP
level. Waits are on conditions with a deadline (`WAIT_S`), never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest

from router.app import MAX_ADMIN_BODY_BYTES, RouterApp, create_app
from router.metrics import UNKNOWN_MODEL
from tests.support.router import FakeEngine, running_app

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
        await asyncio.wait_for(_until(lambda: len(statuses) >= 3), WAIT_S)  # it did run alongside
    finally:
        stop.set()
        await asyncio.wait_for(task, WAIT_S)


async def _until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


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
        monkeypatch.setattr("router.proxy.parse_request", broken)
        monkeypatch.setattr(app.pools, "stats", broken)
        for method, path in (("POST", "/v1/completions"), ("GET", "/admin/v1/stats")):
            async with client.request(method, path, json={"model": "m", "prompt": "x"}, headers=AUTH) as resp:
                assert resp.status == 500, path
                assert (await resp.json())["error"]["code"] == "internal_error"
        async with client.get("/health") as resp:
            assert resp.status == 200
    assert rejected(app, "", 500) == 2


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
