"""The admission queue and the windowed stats over real loopback sockets: a request that finds
every endpoint at its concurrency limit waits in the router, first come first served, and its
wait is the router's queue time (router.pools.admission, router.request.proxy, router.http.admin /stats)."""

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
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.asyncio

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WAIT_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class GatedEngine:
    """Answers each completion only when the test releases its prompt; records arrival order."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.gates: dict[str, asyncio.Event] = {}

    def gate(self, prompt: str) -> asyncio.Event:
        return self.gates.setdefault(prompt, asyncio.Event())

    async def handler(self, request: web.Request) -> web.StreamResponse:
        prompt = (await request.json())["prompt"]
        self.seen.append(prompt)
        await self.gate(prompt).wait()
        return web.json_response({"choices": [{"text": prompt}]})

    def release_all(self) -> None:
        for event in self.gates.values():
            event.set()


@contextlib.asynccontextmanager
async def router(clock: Clock) -> AsyncIterator[tuple[RouterApp, aiohttp.ClientSession]]:
    app = create_app(TOKEN, clock=clock)
    async with running_app(app) as base, aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=WAIT_S)) as c:
        yield app, c


async def put_pool(client: aiohttp.ClientSession, endpoints: list[dict[str, Any]], **settings: Any) -> None:
    doc = {"policy": "least-outstanding", "endpoints": endpoints, **settings}
    async with client.put("/admin/v1/pools/m", json=doc, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


async def complete(client: aiohttp.ClientSession, prompt: str) -> tuple[int, dict[str, Any]]:
    async with client.post("/v1/completions", json={"model": "m", "prompt": prompt}) as resp:
        return resp.status, await resp.json()


async def slot_taken_and_one_queued(client: aiohttp.ClientSession, engine: GatedEngine,
                                    queue: Any) -> tuple[asyncio.Task, asyncio.Task]:  # fmt: skip
    """Request "a" takes the pool's only slot (held at the engine) and "b" waits in the queue."""
    a = asyncio.create_task(complete(client, "a"))
    await async_wait_until(lambda: engine.seen == ["a"], WAIT_S, what='engine.seen == ["a"]')
    b = asyncio.create_task(complete(client, "b"))
    await async_wait_until(lambda: len(queue) == 1, WAIT_S, what="len(queue) == 1")
    return a, b


async def stats(client: aiohttp.ClientSession, window_s: float = 30.0) -> dict[str, Any]:
    async with client.get(f"/admin/v1/stats?window_s={window_s}", headers=AUTH) as resp:
        assert resp.status == 200
        return (await resp.json())["models"]["m"]  # type: ignore[no-any-return]


async def test_full_endpoints_queue_requests_first_come_first_served_and_measure_queue_time() -> None:
    clock, engine = Clock(), GatedEngine()
    async with FakeEngine(handler=engine.handler) as e0, router(clock) as (app, client):
        await put_pool(client, [{"id": "e0", "url": e0.url}], max_concurrency_per_endpoint=1)
        queue = app.pools.get("m").shared.queue  # type: ignore[union-attr]
        try:
            a, b = await slot_taken_and_one_queued(client, engine, queue)
            c = asyncio.create_task(complete(client, "c"))
            await async_wait_until(lambda: len(queue) == 2, WAIT_S, what="len(queue) == 2")
            snap = await stats(client)
            assert (snap["in_flight"], snap["queued"], snap["arrivals"]) == (1, 2, 3)

            clock.now_s += 3.0  # b and c have waited 3 s when a finishes
            engine.gate("a").set()
            assert (await a)[0] == 200
            await async_wait_until(lambda: engine.seen == ["a", "b"], WAIT_S,  # b, not c: first come, first served
                                   what='engine.seen == ["a", "b"]')
            assert len(queue) == 1
            clock.now_s += 2.0
            engine.gate("b").set()
            await async_wait_until(lambda: engine.seen == ["a", "b", "c"], WAIT_S,
                                   what='engine.seen == ["a", "b", "c"]')
            engine.gate("c").set()
            assert [(await t)[0] for t in (b, c)] == [200, 200]
        finally:
            engine.release_all()
        snap = await stats(client)
    assert snap["queue_time_s"]["samples"] == 3
    assert snap["queue_time_s"]["p50"] == 3.0 and snap["queue_time_s"]["max"] == 5.0
    assert snap["queue_time_s"]["mean"] == pytest.approx((0.0 + 3.0 + 5.0) / 3)
    assert snap["queued"] == 0 and snap["in_flight"] == 0
    # Client-side TTFT counts the wait: c arrived at 100 and was answered at 105.
    assert snap["ttft_s"]["max"] == 5.0
    assert app.metrics.registry.get_sample_value("fleet_router_queue_time_seconds_count", {"model": "m"}) == 3
    assert app.metrics.registry.get_sample_value("fleet_router_queue_time_seconds_sum", {"model": "m"}) == 8.0


async def test_a_woken_waiter_no_longer_counts_so_a_second_freed_slot_is_not_lost() -> None:
    """Two slots free before the one waiter woken by the first runs: the second finds no unwoken
    waiter, so it stays free for the next arrival (which sees no queue) instead of being given to
    a waiter already woken, while that arrival queues for a wake-up that never comes."""
    from router.pools.admission import AdmissionQueue

    queue = AdmissionQueue()
    w1 = asyncio.create_task(queue.wait(WAIT_S))
    await async_wait_until(queue.has_waiters, WAIT_S, what="queue.has_waiters()")
    assert queue.wake(1) == 1
    assert not queue.has_waiters() and len(queue) == 0 and queue.wake(1) == 0
    assert await w1
    w2 = asyncio.create_task(queue.wait(0.01))          # one that times out unwoken leaves the count too
    assert not await w2 and len(queue) == 0


async def test_a_new_endpoint_takes_the_queued_request_at_once() -> None:
    clock, engine = Clock(), GatedEngine()
    async with FakeEngine(handler=engine.handler) as e0, FakeEngine("e1") as e1, router(clock) as (app, client):
        await put_pool(client, [{"id": "e0", "url": e0.url}], max_concurrency_per_endpoint=1)
        queue = app.pools.get("m").shared.queue  # type: ignore[union-attr]
        try:
            a, b = await slot_taken_and_one_queued(client, engine, queue)
            # A replica joins (the controller scaled up): the waiting request goes to it.
            await put_pool(client, [{"id": "e0", "url": e0.url}, {"id": "e1", "url": e1.url}],
                           max_concurrency_per_endpoint=1)
            status, body = await b
            assert status == 200 and body["served_by"] == "e1"
            assert not a.done()  # a still holds e0
        finally:
            engine.release_all()
        assert (await a)[0] == 200


async def test_queue_full_and_queue_timeout_are_503_with_retry_after() -> None:
    clock, engine = Clock(), GatedEngine()
    async with FakeEngine(handler=engine.handler) as e0, router(clock) as (app, client):
        await put_pool(client, [{"id": "e0", "url": e0.url}], max_concurrency_per_endpoint=1,
                       max_queue_length=1, queue_timeout_s=0.2)
        queue = app.pools.get("m").shared.queue  # type: ignore[union-attr]
        try:
            a, b = await slot_taken_and_one_queued(client, engine, queue)
            clock.now_s += 7.0  # router time while b waits (the 0.2 s timeout runs in real time)
            async with client.post("/v1/completions", json={"model": "m", "prompt": "c"}) as resp:
                assert resp.status == 503 and resp.headers["Retry-After"]
                assert (await resp.json())["error"]["code"] == "queue_full"
            status, body = await b  # nothing frees e0's slot within 0.2 s
            assert status == 503 and body["error"]["code"] == "queue_timeout"
        finally:
            engine.release_all()
        assert (await a)[0] == 200
        snap = await stats(client)
    assert snap["rejected"] == 2 and snap["queued"] == 0
    # a was dispatched at once; b gave up after 7 s of router time, which counts as its queue time.
    assert snap["queue_time_s"]["samples"] == 2 and snap["queue_time_s"]["max"] == 7.0
    assert engine.seen == ["a"]


async def test_a_request_waiting_when_its_pool_is_deleted_is_told_so() -> None:
    clock, engine = Clock(), GatedEngine()
    async with FakeEngine(handler=engine.handler) as e0, router(clock) as (app, client):
        await put_pool(client, [{"id": "e0", "url": e0.url}], max_concurrency_per_endpoint=1)
        queue = app.pools.get("m").shared.queue  # type: ignore[union-attr]
        try:
            a, b = await slot_taken_and_one_queued(client, engine, queue)
            async with client.delete("/admin/v1/pools/m", headers=AUTH) as resp:
                assert resp.status in (200, 204)
            status, body = await b
            assert status == 503 and body["error"]["code"] == "no_ready_endpoint"
            assert "removed" in body["error"]["message"]
        finally:
            engine.release_all()
        await a


async def test_a_client_that_leaves_the_queue_does_not_lose_the_slot() -> None:
    clock, engine = Clock(), GatedEngine()
    async with FakeEngine(handler=engine.handler) as e0, router(clock) as (app, client):
        await put_pool(client, [{"id": "e0", "url": e0.url}], max_concurrency_per_endpoint=1)
        queue = app.pools.get("m").shared.queue  # type: ignore[union-attr]
        try:
            a, b = await slot_taken_and_one_queued(client, engine, queue)
            b.cancel()  # the client gives up while queued
            with contextlib.suppress(asyncio.CancelledError):
                await b
            await async_wait_until(lambda: len(queue) == 0, WAIT_S, what="len(queue) == 0")
            engine.gate("a").set()
            assert (await a)[0] == 200
            engine.gate("d").set()
            assert (await complete(client, "d"))[0] == 200  # the slot is free again
        finally:
            engine.release_all()
    assert engine.seen == ["a", "d"]


async def test_without_a_limit_requests_are_dispatched_at_once_with_zero_queue_time() -> None:
    clock = Clock()
    async with FakeEngine("e0") as e0, router(clock) as (app, client):
        await put_pool(client, [{"id": "e0", "url": e0.url}])
        for i in range(5):
            clock.now_s += 1.0
            assert (await complete(client, str(i)))[0] == 200
        snap = await stats(client, window_s=60)
        async with client.get("/metrics") as resp:
            text = await resp.text()
    assert snap["queue_time_s"]["samples"] == 5 and snap["queue_time_s"]["max"] == 0.0
    assert snap["arrivals"] == 5
    assert snap["ttft_s"]["samples"] == 5 and snap["e2e_s"]["samples"] == 5
    assert 'fleet_router_queued_requests{model="m"} 0.0' in text
    assert 'fleet_router_window_latency_seconds{model="m",quantile="0.99",signal="queue_time"} 0.0' in text
    assert 'fleet_router_arrival_rate{model="m"}' in text
