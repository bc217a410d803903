"""The proxy feeds `kv-aware` what it needs: prompt blocks, session keys, and each endpoint's
queued prefill tokens until the first byte (router.request.prepare, router.request.attempt,
router.pools.pool). Real loopback sockets;
synchronisation by events, never by sleeping."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from tests.support.router import FakeEngine
from tests.support.waits import async_wait_until
from tests.unit.test_router_proxy import WAIT_S, put_pool, router

pytestmark = pytest.mark.asyncio

PROMPT = list(range(1000, 1000 + 320))   # 320 token ids = 5 router blocks


def body(prompt: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt, "max_tokens": 4, **extra}


async def test_prefill_tokens_count_until_the_first_byte_then_only_the_request() -> None:
    started = asyncio.Event()
    first = asyncio.Event()
    first_sent = asyncio.Event()
    finish = asyncio.Event()

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)       # headers go out at once, as vLLM's do: not a first token
        started.set()
        await first.wait()
        await resp.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        first_sent.set()
        await finish.wait()
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async with FakeEngine("e", handler=handler) as engine, router() as (app, client):
        await put_pool(client, "m", [{"id": "e", "url": engine.url}], policy="kv-aware")
        (state,) = app.pools.get("m").endpoints  # type: ignore[union-attr]

        async def call() -> str:
            async with client.post("/v1/completions", json=body(PROMPT, stream=True)) as resp:
                return await resp.text()

        task = asyncio.create_task(call())
        await asyncio.wait_for(started.wait(), WAIT_S)
        assert (state.in_flight, state.prefilling, state.prefill_tokens) == (1, 1, len(PROMPT))
        first.set()
        await asyncio.wait_for(first_sent.wait(), WAIT_S)

        await async_wait_until(lambda: not state.prefilling, WAIT_S, what="the prefill to be released")
        assert (state.in_flight, state.prefill_tokens) == (1, 0)
        finish.set()
        assert "[DONE]" in await asyncio.wait_for(task, WAIT_S)
        assert (state.in_flight, state.prefilling, state.prefill_tokens) == (0, 0, 0)


async def test_a_shared_prefix_and_a_session_each_keep_to_one_endpoint() -> None:
    async with FakeEngine("a") as a, FakeEngine("b") as b, FakeEngine("c") as c, router() as (app, client):
        await put_pool(client, "m", [{"id": n, "url": e.url} for n, e in (("a", a), ("b", b), ("c", c))],
                       policy="kv-aware")  # fmt: skip
        served = []
        for turn in range(6):      # a conversation: the same 320 ids, then a new question each turn
            async with client.post("/v1/completions", json=body(PROMPT + [turn] * 70)) as resp:
                served.append((await resp.json())["served_by"])
        assert len(set(served)) == 1
        by_session: dict[str, set[str]] = {}
        for i in range(24):        # short chat prompts: no shared block, only the session header
            session = f"s{i % 4}"
            chat = {"model": "m", "messages": [{"role": "user", "content": f"q{i}"}]}
            async with client.post("/v1/chat/completions", json=chat, headers={"x-session-id": session}) as resp:
                by_session.setdefault(session, set()).add((await resp.json())["served_by"])
        assert all(len(s) == 1 for s in by_session.values())


async def test_odd_prompts_are_still_proxied() -> None:
    async with FakeEngine("a") as a, router() as (app, client):
        await put_pool(client, "m", [{"id": "a", "url": a.url}], policy="kv-aware")
        for prompt in ({"x": 1}, [None, "x"], [[1, "a"]], 5):
            async with client.post("/v1/completions", json=body(prompt)) as resp:
                assert resp.status == 200, prompt
        (state,) = app.pools.get("m").endpoints  # type: ignore[union-attr]
        assert (state.requests_total, state.in_flight, state.prefilling, state.prefill_tokens) == (4, 0, 0, 0)
