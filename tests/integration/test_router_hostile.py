"""The router's deadlines in real time: hostile requests get a 4xx within the body and head
timeouts while good ones are served, and the deadlines bound receiving a request, not idle or
answering time (router.http.server, router.http.app); a router process killed and restarted answers 503,
not 404, for the models it served (router.http.remembered); an engine simulator's 413 reaches the
client in OpenAI's format (router.protocol.errors). In-process router on loopback (one test runs `python -m
router`); the rest of the hostile cases, and the helpers used here, are in
tests/unit/test_router_hostile.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from router.stats.metrics import UNKNOWN_MODEL
from router.request.asgi_io import MAX_REFLECTED_CHARS
from tests.support.router import FakeEngine
from tests.support.waits import async_wait_until
from tests.unit.test_router_hostile import AUTH, SHORT_S, TOKEN, WAIT_S, error_of, good_traffic, put_pool, raw_exchange, rejected, router, status_of  # the subject's helpers live in its unit file
from tests.unit.test_sim_server import replica

REPO = Path(__file__).resolve().parents[2]


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


async def test_a_router_killed_and_restarted_answers_503_not_404_until_its_pools_are_published(
        tmp_path: Path) -> None:  # fmt: skip
    """`python -m router --models-file`, `kill -9`, started again on the same file: each request
    for the model it served gets 503 + Retry-After (OpenAI clients retry it; a 404 they do not)
    until the controller PUTs the pool again; then 200. An unknown model is still 404."""
    models_file = tmp_path / "router-models.json"

    def start() -> tuple[subprocess.Popen[str], str]:
        proc = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", "0",
                                 "--models-file", str(models_file)], env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN":
                                TOKEN}, cwd=REPO, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert proc.stdout is not None
        line = proc.stdout.readline()   # blocks until it listens (or exits: empty line)
        assert line.startswith("fleet router listening on "), line
        return proc, line.split()[-1]

    timeout = aiohttp.ClientTimeout(total=WAIT_S)
    async with FakeEngine("e") as engine:
        proc, base = start()
        try:
            async with aiohttp.ClientSession(base, timeout=timeout) as client:
                await put_pool(client, "m", [{"id": "e", "url": engine.url}])
                await async_wait_until(lambda: models_file.exists() and "m" in models_file.read_text(), WAIT_S,
                                       what="the router to write the pool to its models file")
            proc.kill()   # kill -9: no shutdown of any kind
            proc.wait(timeout=WAIT_S)
            proc, base = start()
            async with aiohttp.ClientSession(base, timeout=timeout) as client:
                for _ in range(3):
                    async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                        assert resp.status == 503 and resp.headers["Retry-After"] == "2"
                        assert (await resp.json())["error"]["code"] == "model_not_published"
                async with client.post("/v1/completions", json={"model": "other", "prompt": "x"}) as resp:
                    assert resp.status == 404
                await put_pool(client, "m", [{"id": "e", "url": engine.url}])
                async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                    assert resp.status == 200
        finally:
            proc.kill()
            proc.wait(timeout=WAIT_S)


async def test_a_10_mb_prompt_to_the_engine_simulator_comes_back_413_in_openai_format() -> None:
    """The simulator refuses a body over aiohttp's 1 MiB (vLLM's JSON shape: numeric code); the
    router, whose limit is 64 MiB, relays that 413 in OpenAI's shape."""
    async with replica() as (sim, _), router() as (app, client, _base):
        await put_pool(client, "sim-model", [{"id": "sim", "url": f"http://127.0.0.1:{sim.port}"}])
        async with client.post("/v1/completions", json={"model": "sim-model", "prompt": "w " * 5_000_000}) as resp:
            assert resp.status == 413 and resp.content_type == "application/json"
            error = (await resp.json())["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
        assert "1048576" in error["message"]
        async with client.post("/v1/completions", json={"model": "sim-model", "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
