"""Request migration against the engine SIMULATOR: two replicas in processes of their own behind an
in-process router; the replica serving a stream is SIGKILLed mid-stream, and the client's stream
goes on from the other replica to the number of tokens it asked for, with one `id` and no error
(router.request.migrate, router.request.proxy, fleet/enginesim's `continue_final_message`).

Waits are on conditions with a deadline, never on sleeps.
"""

from __future__ import annotations

import json
import os
import signal
from typing import Any

import aiohttp
import pytest

from loadtests.procs import SimFleet
from router.http.app import create_app
from tests.support.router import running_app
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.asyncio

TOKEN = "test-admin-token"
MODEL = "sim-model"
MAX_TOKENS = 400   # about 3 s at the profile's 7.2 ms per decode step
WAIT_S = 60.0


def events(body: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[len(b"data: "):]) for e in body.split(b"\n\n")
            if e.startswith(b"data: ") and e != b"data: [DONE]"]  # fmt: skip


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_stream_survives_the_sigkill_of_its_engine(path: str) -> None:
    chat = path.endswith("chat/completions")
    with SimFleet(2, processes=2, profile="h100-llama-8b", model=MODEL) as fleet:
        app = create_app(TOKEN)
        async with running_app(app) as base, aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(WAIT_S)) as c:
            pool = {"policy": "round-robin", "endpoints": [{"id": f"e{i}", "url": u} for i, u in enumerate(fleet.urls)]}
            async with c.put(f"/admin/v1/pools/{MODEL}", json=pool, headers={"Authorization": f"Bearer {TOKEN}"}) as r:
                assert r.status == 200
            prompt = {"messages": [{"role": "user", "content": "tell me a story"}]} if chat else {"prompt": "once upon"}
            body = {"model": MODEL, **prompt, "max_tokens": MAX_TOKENS, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            async with c.post(path, json=body) as resp:
                assert resp.status == 200
                head = await resp.content.readuntil(b"\n\n")
                for _ in range(20):   # the stream is well under way
                    head += await resp.content.readuntil(b"\n\n")
                live = app.pools.get(MODEL)
                assert live is not None
                serving = [i for i, e in enumerate(live.endpoints) if e.in_flight]
                assert len(serving) == 1
                os.kill(fleet.pids[serving[0]], signal.SIGKILL)
                rest = await resp.content.read()
            docs = events(head + rest)
            assert (head + rest).endswith(b"data: [DONE]\n\n")
            assert not any("error" in d for d in docs), rest[-400:]
            assert len({d["id"] for d in docs}) == 1
            token_events = [d for d in docs if d["choices"] and (d["choices"][0].get("text")
                            or d["choices"][0].get("delta", {}).get("content"))]  # fmt: skip
            assert len(token_events) == MAX_TOKENS
            assert docs[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            families = app.metrics.registry
            migrated = await async_wait_until(
                lambda: families.get_sample_value("fleet_router_migrations_total",
                                                  {"model": MODEL, "reason": "interrupted"}), 5.0,
                what="the migration counted")  # fmt: skip
            assert migrated == 1
