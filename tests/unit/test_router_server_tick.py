"""The router's uvicorn server turns its own loop once a second, not ten times, and still stops as
soon as it is asked (router/http/server.py `TickingServer`, `SERVER_TICK_S`): from its loop, from
another thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from router.http import server as server_module
from router.http.server import ListeningServer, uvicorn_config
from tests.support.waits import async_wait_until


async def _app(scope, receive, send):   # a minimal ASGI app: lifespan and a 204
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send({"type": "http.response.start", "status": 204, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _server(ticks: list[int]) -> ListeningServer:
    server = ListeningServer(uvicorn_config(_app, "127.0.0.1", 0, loop="auto"), lambda host, port: None)
    on_tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        return await on_tick(counter)

    server.on_tick = counted   # type: ignore[method-assign]
    return server


@pytest.mark.parametrize("stop", ["loop", "thread"])
async def test_the_server_stops_at_once_though_its_loop_turns_rarely(monkeypatch, stop):
    monkeypatch.setattr(server_module, "SERVER_TICK_S", 60.0)   # only the wake can end the wait in time
    ticks: list[int] = []
    server = _server(ticks)
    task = asyncio.create_task(server.serve())
    await async_wait_until(lambda: server.started and ticks, what="the server started")
    started_s = time.monotonic()
    if stop == "loop":
        server.should_exit = True
    else:
        threading.Thread(target=setattr, args=(server, "should_exit", True)).start()
    await asyncio.wait_for(task, 10)
    assert time.monotonic() - started_s < 5.0   # far under the 60 s turn
    assert len(ticks) == 2   # the first turn, and the one the exit woke


async def test_every_turn_refreshes_the_date_header(monkeypatch):
    monkeypatch.setattr(server_module, "SERVER_TICK_S", 0.01)
    ticks: list[int] = []
    server = _server(ticks)
    task = asyncio.create_task(server.serve())
    try:
        await async_wait_until(lambda: len(ticks) >= 4, what="four turns of the server's loop")
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
    assert all(counter % 10 == 0 for counter in ticks)   # uvicorn refreshes the date on every 10th count
