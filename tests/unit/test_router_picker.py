"""Two routers in front of one endpoint picker (router.request.proxy step 5 with `Pool.picker`,
router.picker): the picker decides every first pick over both routers' load, each request's
ticket is released when it ends, and a router whose picker is gone picks for itself without
failing a request. Real loopback sockets; waits on conditions, never on sleeps."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from router.picker.service import PickerService
from tests.support.router import FakeEngine
from tests.support.waits import async_wait_until
from tests.unit.test_router_proxy import WAIT_S, put_pool, router

pytestmark = pytest.mark.asyncio

PROMPT = list(range(2000, 2000 + 256))


def picks(app, outcome: str) -> float:
    value = app.metrics.registry.get_sample_value("fleet_router_picker_picks_total", {"outcome": outcome})
    return value or 0.0


async def test_two_routers_pick_through_the_picker_and_fall_back_without_it() -> None:
    service = PickerService()
    await service.start("127.0.0.1", 0)
    try:
        async with contextlib.AsyncExitStack() as stack:
            engines = [await stack.enter_async_context(FakeEngine(f"e{i}")) for i in range(2)]
            routers = [await stack.enter_async_context(router(picker=("127.0.0.1", service.port))) for _ in range(2)]
            for app, client in routers:
                app.picker.deadline_s = WAIT_S   # this test checks the path, not the 5 ms deadline
                await put_pool(client, "m", [{"id": e.name, "url": e.url} for e in engines], policy="kv-aware")
            await async_wait_until(
                lambda: all(app.picker.connected for app, _ in routers) and "m" in service.state.pools,
                WAIT_S, what="both routers connected and the pool reached the picker")

            async def ask(k: int, i: int) -> int:
                body = {"model": "m", "prompt": [i, *PROMPT], "max_tokens": 4, "stream": i % 2 == 0}
                async with routers[k][1].post("/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status

            assert await asyncio.gather(*(ask(i % 2, i) for i in range(8))) == [200] * 8
            assert [picks(app, "answered") for app, _ in routers] == [4, 4]
            await async_wait_until(lambda: service.state.in_flight() == 0, WAIT_S, what="every ticket finished")
            held = service.state.pools["m"].endpoints.values()
            assert sum(e.requests_total for e in held) == 8
            assert all((e.in_flight, e.prefilling, e.prefill_tokens) == (0, 0, 0) for e in held)

            await service.close()
            await async_wait_until(lambda: not any(app.picker.connected for app, _ in routers), WAIT_S,
                                   what="the routers saw the picker go")
            assert await asyncio.gather(*(ask(i % 2, i) for i in range(4))) == [200] * 4
            assert [picks(app, "unreachable") for app, _ in routers] == [2, 2]
    finally:
        await service.close()
