"""`fleet router-pod` (fleet/k8s/routerpod.py): the OpenAI API on one port, the admin API on
another only; both served by one router app (one pool table)."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from fleet.k8s.routerpod import PublicOnly, serve_router_pod
from tests.support.waits import async_wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_public_wrapper_hides_the_admin_api():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=PublicOnly(app)), base_url="http://r") as c:
        assert (await c.get("/admin/v1/pools")).status_code == 404
        assert (await c.get("/admin")).status_code == 404
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/administrator")).status_code == 200   # only the /admin tree
    assert calls == ["/health", "/administrator"]


async def test_router_pod_serves_admin_on_its_own_port_only():
    port, admin_port = _free_port(), _free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop))
    auth = {"Authorization": "Bearer tok"}
    async with httpx.AsyncClient(timeout=5) as c:

        async def healthy() -> bool:
            return (await c.get(f"http://127.0.0.1:{port}/health")).status_code == 200

        await async_wait_until(healthy, 20, interval_s=0.05, what="the router pod to start",
                               ignoring=(httpx.TransportError,))
        pool = {"endpoints": [{"id": "e1", "url": "http://127.0.0.1:1"}]}
        assert (await c.put(f"http://127.0.0.1:{port}/admin/v1/pools/m", json=pool, headers=auth)).status_code == 404
        r = await c.put(f"http://127.0.0.1:{admin_port}/admin/v1/pools/m", json=pool, headers=auth)
        assert r.status_code in (200, 204), r.text
        models = (await c.get(f"http://127.0.0.1:{port}/v1/models")).json()   # same pool table, public side
        assert [m["id"] for m in models["data"]] == ["m"]
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_equal_ports_are_refused():
    with pytest.raises(ValueError, match="admin-port"):
        await serve_router_pod("127.0.0.1", 8080, 8080, "t")


async def test_a_drain_timeout_that_is_not_positive_is_refused_naming_the_option():
    with pytest.raises(ValueError, match="--drain-timeout-s must be > 0 seconds, not 0"):
        await serve_router_pod("127.0.0.1", 8080, 9090, "t", drain_timeout_s=0)


def test_router_pod_refuses_a_bad_picker_address(monkeypatch):
    from typer.testing import CliRunner

    from fleet.cli import app

    monkeypatch.setenv("FLEET_ROUTER_ADMIN_TOKEN", "tok")
    result = CliRunner().invoke(app, ["router-pod", "--picker", "fleet-picker"])   # no port
    assert result.exit_code == 2 and "--picker must be HOST:PORT" in result.output


async def test_router_pod_connects_to_a_static_picker():
    """`--picker HOST:PORT` reaches the router app: its picker client connects there."""
    from router.picker.service import PickerService

    picker = PickerService()
    await picker.start("127.0.0.1", 0)
    port, admin_port = _free_port(), _free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop,
                                                picker=("127.0.0.1", picker.port)))  # fmt: skip
    try:
        await async_wait_until(lambda: picker.metrics.facts.routers() == 1, 20, interval_s=0.05,
                               what="the router pod connected to the picker")
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await picker.close()


async def _slow_engine(chunks: int, gap_s: float):
    """An OpenAI completions upstream on loopback that streams ``chunks`` events ``gap_s`` apart."""
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(chunks):
            event = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                     "choices": [{"index": 0, "text": f"t{i}", "logprobs": None,
                                  "finish_reason": "length" if i == chunks - 1 else None}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


async def test_a_stopped_router_pod_accepts_no_one_and_finishes_the_streams_in_flight():
    """SIGTERM's path (the `stop` event): the public port refuses new connections at once, the
    stream in flight runs to its `[DONE]`, and only then does the pod exit."""
    runner, engine_port = await _slow_engine(chunks=8, gap_s=0.25)
    port, admin_port = _free_port(), _free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop))
    try:
        async with httpx.AsyncClient(timeout=20) as c:
            pool = {"endpoints": [{"id": "e1", "url": f"http://127.0.0.1:{engine_port}"}]}

            async def published() -> bool:
                r = await c.put(f"http://127.0.0.1:{admin_port}/admin/v1/pools/m", json=pool,
                                headers={"Authorization": "Bearer tok"})  # fmt: skip
                return r.status_code in (200, 204)

            await async_wait_until(published, 20, interval_s=0.05, what="the router pod to take its pool",
                                   ignoring=(httpx.TransportError,))  # fmt: skip
            body = {"model": "m", "prompt": "hi", "max_tokens": 8, "stream": True}
            async with c.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = r.aiter_bytes()
                received = await chunks.__anext__()
                stop.set()

                async def refused() -> bool:
                    try:
                        _, writer = await asyncio.open_connection("127.0.0.1", port)
                    except ConnectionRefusedError:
                        return True
                    writer.close()
                    return False

                await async_wait_until(refused, 10, interval_s=0.02, what="the public port to refuse")
                assert not task.done()   # still draining the stream in flight
                async for chunk in chunks:
                    received += chunk
            assert received.rstrip().endswith(b"data: [DONE]") and received.count(b'"text_completion"') == 8
        await asyncio.wait_for(task, 20)
    finally:
        stop.set()
        await runner.cleanup()
