"""The router's deadlines in real time: hostile requests get a 4xx within the body and head
timeouts while good ones are served, and the deadlines bound receiving a request, not idle or
answering time (router.server, router.app). In-process router on loopback; the rest of the hostile
cases, and the helpers used here, are in tests/unit/test_router_hostile.py."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlsplit


from router.metrics import UNKNOWN_MODEL
from router.proxy import MAX_REFLECTED_CHARS
from tests.support.router import FakeEngine
from tests.unit.test_router_hostile import AUTH, SHORT_S, WAIT_S, error_of, good_traffic, put_pool, raw_exchange, rejected, router, status_of  # the subject's helpers live in its unit file


async def test_hostile_requests_get_4xx_in_bounded_time_while_good_ones_are_served() -> None:
    async with FakeEngine("good") as engine, router(timeout_keep_alive=1) as (app, client, base):
        await put_pool(client, "m", [{"id": "good", "url": engine.url}])
        async with good_traffic(client, "m") as statuses:
            # A body that never arrives in full: 408 and the connection closed.
            raw = await raw_exchange(base, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
                                           b"\r\ncontent-length: 100000\r\n\r\n" + b"x" * 50)  # fmt: skip
            assert status_of(raw) == 408 and error_of(raw)["code"] == "request_timeout"
            assert b"connection: close" in raw.lower()
            # A request head that never ends: 408; a connection that never sends anything is idle
            # and closed silently after the keep-alive timeout (shortened here).
            raw = await raw_exchange(base, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
            assert status_of(raw) == 408
            assert await raw_exchange(base, b"") == b""
            assert await raw_exchange(base, b"\r\n") == b""  # blank lines begin no request
            # A head larger than the limit: 431.
            raw = await raw_exchange(base, b"GET /health HTTP/1.1\r\nx-big: " + b"a" * 70_000)
            assert status_of(raw) == 431
            # A 1 MB model name: 404, reflected only in part.
            huge = "m" * 1_000_000
            async with client.post("/v1/completions", json={"model": huge, "prompt": "hi"}) as resp:
                assert resp.status == 404
                text = await resp.text()
            assert len(text) < 4 * MAX_REFLECTED_CHARS and "1000000 characters" in text
            assert json.loads(text)["error"]["code"] == "model_not_found"
            # Non-finite numbers in a pool document: 422 naming the field.
            for field, doc in (
                ("weight", b'{"endpoints": [{"id": "a", "url": "http://h:1", "weight": NaN}]}'),
                ("weight", b'{"endpoints": [{"id": "a", "url": "http://h:1", "weight": 1e999}]}'),
                ("queue_timeout_s", b'{"queue_timeout_s": NaN}'),
                ("queue_timeout_s", b'{"queue_timeout_s": Infinity}'),
            ):
                async with client.put("/admin/v1/pools/m2", data=doc, headers=AUTH) as resp:
                    assert resp.status == 422
                    error = (await resp.json())["error"]
                assert field in error["message"] and "finite" in error["message"]
        assert statuses and set(statuses) == {200}
    assert rejected(app, "", 408) == 2 and rejected(app, "", 431) == 1 and rejected(app, "", 422) == 4
    assert rejected(app, UNKNOWN_MODEL, 404) == 1


async def test_the_deadlines_bound_receiving_a_request_not_idle_or_answering_time() -> None:
    """The head has `head_timeout_s`; the body then has `body_timeout_s` of its own; an idle
    kept-alive connection and a slow answer are not cut by either."""
    async with FakeEngine("e") as engine, router(body_timeout_s=10 * SHORT_S) as (_, client, base):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}])
        body = json.dumps({"model": "m", "prompt": "hi"}).encode()
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n")
        parts = urlsplit(base)
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
        try:
            # The body arrives after the head deadline but within the body's own: served.
            writer.write(head % len(body))
            await asyncio.sleep(2 * SHORT_S)  # past head_timeout_s, inside body_timeout_s: the case under test
            writer.write(body)
            status_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)
            assert status_line.startswith(b"HTTP/1.1 200")
            response_head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), WAIT_S)
            length = int(response_head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await asyncio.wait_for(reader.readexactly(length), WAIT_S)
            # Idle on a kept-alive connection for longer than both deadlines: still usable.
            await asyncio.sleep(5 * SHORT_S)  # idle time is the case under test
            writer.write(head % len(body) + body)
            status_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)
            assert status_line.startswith(b"HTTP/1.1 200")
        finally:
            writer.close()
