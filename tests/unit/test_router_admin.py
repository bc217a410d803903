"""The admin API over real HTTP: auth, pool replacement, draining (router.http.admin, router.pools.pool)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.http.app import RouterApp, create_app
from tests.support.router import FakeEngine, running_app

pytestmark = pytest.mark.asyncio

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 10.0


@contextlib.asynccontextmanager
async def router() -> AsyncIterator[tuple[RouterApp, aiohttp.ClientSession]]:
    app = create_app(TOKEN)
    timeout = aiohttp.ClientTimeout(total=WAIT_S)  # a hung request fails the test instead of hanging it
    async with running_app(app) as base, aiohttp.ClientSession(base, timeout=timeout) as client:
        yield app, client


async def put(client: aiohttp.ClientSession, model: str, doc: dict[str, Any]) -> dict[str, Any]:
    async with client.put(f"/admin/v1/pools/{model}", json=doc, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()  # type: ignore[no-any-return]


async def pools(client: aiohttp.ClientSession) -> dict[str, Any]:
    async with client.get("/admin/v1/pools", headers=AUTH) as resp:
        assert resp.status == 200
        return (await resp.json())["pools"]  # type: ignore[no-any-return]


async def complete(client: aiohttp.ClientSession, model: str = "m", n: int = 1) -> None:
    for _ in range(n):
        async with client.post("/v1/completions", json={"model": model, "prompt": "hi"}) as resp:
            assert resp.status == 200
            await resp.read()


BAD_AUTH = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": TOKEN},
    {"Authorization": f"Basic {TOKEN}"},
    {"Authorization": "Bearer"},
]


@pytest.mark.parametrize("headers", BAD_AUTH)
async def test_admin_requires_the_bearer_token(headers: dict[str, str]) -> None:
    async with router() as (app, client):
        for method, path, body in (
            ("GET", "/admin/v1/pools", None),
            ("PUT", "/admin/v1/pools/m", {"policy": "no-such-policy"}),  # 401 before validation
            ("DELETE", "/admin/v1/pools/m", None),
        ):
            async with client.request(method, path, json=body, headers=headers) as resp:
                assert resp.status == 401
                assert resp.headers["WWW-Authenticate"] == "Bearer"
        assert app.pools.models() == []


async def test_admin_accepts_the_right_token_any_scheme_case() -> None:
    async with router() as (_, client):
        async with client.get("/admin/v1/pools", headers={"Authorization": f"bearer {TOKEN}"}) as resp:
            assert resp.status == 200
            assert await resp.json() == {"pools": {}}


async def test_unknown_policy_is_422_naming_known_policies() -> None:
    async with router() as (_, client):
        async with client.put("/admin/v1/pools/m", json={"policy": "fastest", "endpoints": []}, headers=AUTH) as resp:
            assert resp.status == 422
            text = await resp.text()
    assert "fastest" in text and "latency-aware" in text and "least-outstanding" in text and "round-robin" in text


async def test_a_weight_too_large_is_422_naming_the_field_and_changes_nothing() -> None:
    async with router() as (_, client):
        good = {"policy": "round-robin", "endpoints": [{"id": "a", "url": "http://127.0.0.1:9", "version": "v1"},
                                                       {"id": "b", "url": "http://127.0.0.1:9", "version": "v2"}]}
        await put(client, "m", good)
        bad = {**good, "endpoints": [{**e, "weight": 1e308, "draining": e["id"] == "b"} for e in good["endpoints"]]}
        async with client.put("/admin/v1/pools/m", json=bad, headers=AUTH) as resp:
            assert resp.status == 422
            assert "weight" in await resp.text()
        async with client.get("/admin/v1/pools", headers=AUTH) as resp:
            endpoints = (await resp.json())["pools"]["m"]["endpoints"]
    assert [(e["id"], e["weight"], e["draining"]) for e in endpoints] == [("a", 1.0, False), ("b", 1.0, False)]


async def test_pool_listing_and_update_keep_stats_of_unchanged_endpoints() -> None:
    async with FakeEngine("a") as a, FakeEngine("b") as b, FakeEngine("c") as c, router() as (_, client):
        await put(client, "org/model", {"policy": "round-robin", "endpoints": [
            {"id": "a", "url": a.url, "version": "v1"}, {"id": "b", "url": b.url, "version": "v1"}]})  # fmt: skip
        await complete(client, "org/model", n=4)
        before = {e["id"]: e for e in (await pools(client))["org/model"]["endpoints"]}
        assert before["a"]["requests_total"] == before["b"]["requests_total"] == 2
        assert before["a"]["ewma_first_byte_s"] > 0

        listing = await put(client, "org/model", {"policy": "round-robin", "endpoints": [
            {"id": "a", "url": a.url, "version": "v2", "weight": 0.5},  # unchanged id+url: stats kept
            {"id": "b", "url": c.url, "version": "v2"},  # same id, new url: fresh
        ]})  # fmt: skip
        assert listing["policy"] == "round-robin"
        after = {e["id"]: e for e in (await pools(client))["org/model"]["endpoints"]}
        assert after["a"] == {**before["a"], "version": "v2", "weight": 0.5}
        assert after["b"] == {"id": "b", "url": c.url, "version": "v2", "weight": 1.0, "draining": False,
                              "in_flight": 0, "requests_total": 0, "errors_total": 0,
                              "ewma_first_byte_s": None, "ejected": False, "ejected_for_s": None,
                              "ejection_reason": None, "ejections_total": 0, "stalls_total": 0,
                              "consecutive_failures": 0, "consecutive_stalls": 0}  # fmt: skip
        await complete(client, "org/model", n=2)
        assert len(c.requests) == 1 and len(b.requests) == 2


async def test_draining_endpoint_gets_no_new_requests_and_reports_in_flight() -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def gated(request: web.Request) -> web.StreamResponse:
        started.set()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await release.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with FakeEngine("old", handler=gated) as old, FakeEngine("new") as new, router() as (_, client):
        await put(client, "m", {"endpoints": [{"id": "old", "url": old.url}]})
        long_request = await client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True})
        await asyncio.wait_for(started.wait(), WAIT_S)

        await put(client, "m", {"endpoints": [{"id": "old", "url": old.url, "draining": True},
                                              {"id": "new", "url": new.url}]})  # fmt: skip
        await complete(client, "m", n=10)
        assert len(new.requests) == 10
        listed = {e["id"]: e for e in (await pools(client))["m"]["endpoints"]}
        assert listed["old"]["draining"] is True and listed["old"]["in_flight"] == 1
        assert listed["old"]["requests_total"] == 1

        release.set()
        assert await asyncio.wait_for(long_request.read(), WAIT_S) == b"data: 1\n\ndata: [DONE]\n\n"
        long_request.release()
        listed = {e["id"]: e for e in (await pools(client))["m"]["endpoints"]}
        assert listed["old"]["in_flight"] == 0


async def test_removed_endpoint_finishes_its_in_flight_request() -> None:
    release = asyncio.Event()
    started = asyncio.Event()

    async def gated(request: web.Request) -> web.StreamResponse:
        started.set()
        await release.wait()
        return web.json_response({"served_by": "old"})

    async with FakeEngine("old", handler=gated) as old, FakeEngine("new") as new, router() as (app, client):
        await put(client, "m", {"endpoints": [{"id": "old", "url": old.url}]})
        pending = asyncio.create_task(client.post("/v1/completions", json={"model": "m", "prompt": "x"}))
        await asyncio.wait_for(started.wait(), WAIT_S)
        removed = app.pools.get("m").endpoints[0]  # type: ignore[union-attr]
        await put(client, "m", {"endpoints": [{"id": "new", "url": new.url}]})
        release.set()
        resp = await asyncio.wait_for(pending, WAIT_S)
        assert resp.status == 200 and (await resp.json())["served_by"] == "old"
        resp.release()
        assert removed.in_flight == 0


async def test_delete_pool() -> None:
    async with FakeEngine() as engine, router() as (_, client):
        await put(client, "m", {"endpoints": [{"id": "e", "url": engine.url}]})
        async with client.delete("/admin/v1/pools/m", headers=AUTH) as resp:
            assert resp.status == 200
        async with client.delete("/admin/v1/pools/m", headers=AUTH) as resp:
            assert resp.status == 404
        async with client.get("/admin/v1/pools/m", headers=AUTH) as resp:
            assert resp.status == 404
        async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            assert resp.status == 404
        async with client.get("/metrics") as resp:
            assert 'model="m"' not in await resp.text()



async def test_ready_only_after_the_control_plane_says_every_pool_is_published() -> None:
    """A (re)started router knows no pool: Ready then would answer 404 for every model
    (docs/kubernetes.md, the chart's readiness probe reads /ready)."""
    async with router() as (app, client):
        async with client.get("/health") as resp:
            assert resp.status == 200   # alive ...
        async with client.get("/ready") as resp:
            assert resp.status == 503   # ... not ready (an error in OpenAI's format, like every other)
            assert (await resp.json())["error"]["code"] == "not_synced"
        async with client.post("/admin/v1/synced") as resp:
            assert resp.status == 401   # only the control plane may say so
        async with client.post("/admin/v1/synced", headers=AUTH) as resp:
            assert resp.status == 200
        async with client.get("/ready") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ready"


@pytest.mark.parametrize("url, why", [
    ("http://127.0.0.1 :1", "neither an IP address nor a DNS name"),
    ("http://127.0.0.1:0", "bad port (1-65535)"),
    ("http://127.0.0.1:65536", "bad port (1-65535)"),
    ("http://engine_0..local:8000", "neither an IP address nor a DNS name"),
    ("ftp://127.0.0.1:21", "http(s)://host[:port]"),
])
async def test_an_endpoint_url_that_cannot_be_reached_is_422_naming_the_field(url: str, why: str) -> None:
    async with router() as (app, client):
        doc = {"policy": "round-robin", "endpoints": [{"id": "a", "url": url}]}
        async with client.put("/admin/v1/pools/m", json=doc, headers=AUTH) as resp:
            assert resp.status == 422
            text = await resp.text()
        assert "url" in text and why in text, text
        assert app.pools.models() == []
        for good in ("http://127.0.0.1:1", "https://[::1]:65535", "http://chat-0.fleet.svc.cluster.local:8000"):
            await put(client, "m", {"policy": "round-robin", "endpoints": [{"id": "a", "url": good}]})
