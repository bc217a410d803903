"""No request waits on a stalled engine (router.request.proxy and router.request.attempt with
router.request.deadline and router.pools.outlier): over real loopback sockets, a router in front of fake engines that hang after sending their response
head (as vLLM does when its engine core makes no progress) or answer 5xx, and in front of engine
SIMULATOR replicas one of which is stalled (its `stall` fault: no step, `/health` still 200)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.enginesim.runner import bind_socket
from fleet.enginesim.server import ReplicaSettings, SimReplica
from router.http.app import RouterApp, create_app
from tests.support.router import FakeEngine, running_app

pytestmark = pytest.mark.asyncio

TOKEN = "test-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 0.4


class Clock:
    """The router's clock: real time plus `skipped` seconds, so a test can jump over an ejection."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.skipped


@contextlib.asynccontextmanager
async def router(clock: Clock | None = None) -> AsyncIterator[tuple[RouterApp, aiohttp.ClientSession]]:
    app = create_app(TOKEN, clock=clock or Clock())
    async with running_app(app) as base, aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=10)) as c:
        yield app, c


async def put_pool(client: aiohttp.ClientSession, endpoints: list[tuple[str, str]], **pool: Any) -> None:
    doc = {"policy": "round-robin", "endpoints": [{"id": i, "url": u} for i, u in endpoints], **pool}
    async with client.put("/admin/v1/pools/m", json=doc, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()


async def open_sse(request: web.Request) -> web.StreamResponse:
    """A streamed reply's head, sent (200 text/event-stream, as vLLM sends it before its first token)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    return resp


class Hanging:
    """An engine that sends the response head (streamed: 200 text/event-stream, as vLLM does before
    its first token) and then nothing while `stalled`, and answers at once when not; counts the
    requests it got."""

    def __init__(self) -> None:
        self.stalled = True
        self.requests = 0
        self.done = asyncio.Event()   # set at the end of a test: hanging handlers return, cleanup is quick

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests += 1
        if body.get("stream"):
            resp = await open_sse(request)
            if not self.stalled:
                await resp.write(b'data: {"served_by": "hanging", "choices": []}\n\ndata: [DONE]\n\n')
                return resp
        await self.done.wait()
        return web.Response(status=499)


def value(app: RouterApp, name: str, **labels: str) -> float:
    if "endpoint" in labels and name != "fleet_router_endpoint_ejected":
        labels.setdefault("version", "")
    return app.metrics.registry.get_sample_value(name, labels) or 0.0


async def stream_text(resp: aiohttp.ClientResponse) -> str:
    return (await resp.read()).decode()


async def test_a_stalled_engine_is_retried_within_the_deadline_then_ejected_and_back_after() -> None:
    hang, clock = Hanging(), Clock()
    async with FakeEngine("a", handler=hang.handle) as a, FakeEngine("b") as b, router(clock) as (app, client):
        await put_pool(client, [("a", a.url), ("b", b.url)], first_token_timeout_s=DEADLINE_S,
                       outlier_detection={"consecutive_stalls": 2, "base_ejection_time_s": 30.0})  # fmt: skip
        took = []
        for _ in range(6):
            t0 = time.monotonic()
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
                text = await stream_text(r)
            took.append(time.monotonic() - t0)
            assert r.status == 200 and '"served_by": "b"' in text and text.endswith("data: [DONE]\n\n"), text
        # Round-robin sends requests 1 and 3 (of 1, 2, 3, ...) to a first: each waits the deadline and
        # goes to b; two stalls in a row eject a, and the rest go straight to b.
        assert hang.requests == 2
        assert max(took) < DEADLINE_S + 0.5 and sum(t > DEADLINE_S for t in took) == 2
        assert value(app, "fleet_router_first_token_timeouts_total", model="m", endpoint="a") == 2
        assert value(app, "fleet_router_retries_total", model="m") == 2
        assert value(app, "fleet_router_endpoint_ejections_total", model="m", endpoint="a", reason="stall") == 1
        async with client.get("/metrics") as resp:
            assert 'fleet_router_endpoint_ejected{endpoint="a",model="m"} 1.0' in await resp.text()
        async with client.get("/admin/v1/pools/m", headers=AUTH) as resp:
            listed = {e["id"]: e for e in (await resp.json())["endpoints"]}
        assert listed["a"]["ejected"] and listed["a"]["ejection_reason"] == "stall"
        assert listed["a"]["stalls_total"] == 2 and 29.0 < listed["a"]["ejected_for_s"] <= 30.0
        assert not listed["b"]["ejected"]
        # The engine recovers; once the ejection (30 s on the router's clock) and the slow start after it
        # (30 s: router.pools.outlier) are over, a gets its whole share again.
        hang.stalled = False
        clock.skipped += 60.0
        served = []
        for _ in range(4):
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
                served.append("hanging" if '"served_by": "hanging"' in await stream_text(r) else "b")
        assert served.count("hanging") == 2 and hang.requests == 4
        async with client.get("/metrics") as resp:
            assert 'fleet_router_endpoint_ejected{endpoint="a",model="m"} 0.0' in await resp.text()
        hang.done.set()


async def test_every_endpoint_stalled_gives_504_in_openai_shape_after_one_retry() -> None:
    hang_a, hang_b = Hanging(), Hanging()
    async with FakeEngine("a", handler=hang_a.handle) as a, FakeEngine("b", handler=hang_b.handle) as b, \
            router() as (app, client):
        await put_pool(client, [("a", a.url), ("b", b.url)], first_token_timeout_s=DEADLINE_S)
        t0 = time.monotonic()
        async with client.post("/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            doc = await r.json()
        took = time.monotonic() - t0
        assert r.status == 504
        assert doc["error"]["code"] == "first_token_timeout" and doc["error"]["type"] == "server_error"
        assert doc["error"]["param"] is None and "2 endpoint(s)" in doc["error"]["message"]
        assert 2 * DEADLINE_S <= took < 2 * DEADLINE_S + 0.5
        assert hang_a.requests == hang_b.requests == 1
        assert value(app, "fleet_router_rejected_requests_total", model="m", code="504") == 1
        hang_a.done.set()
        hang_b.done.set()


async def test_max_retries_zero_answers_504_after_the_first_deadline() -> None:
    hang_a, hang_b = Hanging(), Hanging()
    async with FakeEngine("a", handler=hang_a.handle) as a, FakeEngine("b", handler=hang_b.handle) as b, \
            router() as (_, client):
        await put_pool(client, [("a", a.url), ("b", b.url)], first_token_timeout_s=DEADLINE_S, max_retries=0)
        t0 = time.monotonic()
        async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
            assert r.status == 504
        assert DEADLINE_S <= time.monotonic() - t0 < 2 * DEADLINE_S
        assert hang_a.requests + hang_b.requests == 1
        hang_a.done.set()
        hang_b.done.set()


async def test_a_non_streamed_request_gets_its_decode_time_on_top_of_the_deadline() -> None:
    hang = Hanging()
    async with FakeEngine("a", handler=hang.handle) as a, FakeEngine("b") as b, router() as (_, client):
        await put_pool(client, [("a", a.url), ("b", b.url)], first_token_timeout_s=DEADLINE_S)
        took = []
        for _ in range(2):   # round-robin: one of them goes to a first
            t0 = time.monotonic()
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 1}) as r:
                doc = await r.json()
            took.append(time.monotonic() - t0)
            assert r.status == 200 and doc["served_by"] == "b"
        assert hang.requests == 1
        hang.done.set()
        assert DEADLINE_S + 0.2 <= max(took) < DEADLINE_S + 0.2 + 0.5   # + 1 token x 0.2 s (router.request.deadline)


async def test_a_5xx_is_retried_on_another_endpoint_and_relayed_in_openai_shape_when_it_cannot_be() -> None:
    vllm_500 = {"error": {"message": "EngineCore encountered an issue", "type": "InternalServerError",
                          "param": None, "code": 500}}  # fmt: skip
    calls = []

    async def failing(request: web.Request) -> web.Response:
        calls.append(1)
        return web.json_response(vllm_500, status=500)

    async with FakeEngine("a", handler=failing) as a, FakeEngine("b") as b, router() as (app, client):
        await put_pool(client, [("a", a.url), ("b", b.url)])
        for _ in range(2):
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200 and (await r.json())["served_by"] == "b"
        assert len(calls) == 1 and value(app, "fleet_router_retries_total", model="m") == 1
        await put_pool(client, [("a", a.url)])
        async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 500
            assert await r.json() == {"error": {"message": "EngineCore encountered an issue", "type": "server_error",
                                                "param": None, "code": "internal_error"}}  # fmt: skip
        await put_pool(client, [("a", a.url), ("b", b.url)], max_retries=0)
        statuses = set()
        for _ in range(2):
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                statuses.add(r.status)
        assert statuses == {200, 500}


async def test_five_5xx_in_a_row_eject_the_endpoint() -> None:
    async def failing(request: web.Request) -> web.Response:
        return web.json_response({"object": "error", "message": "boom", "type": "InternalServerError",
                                  "param": None, "code": 500}, status=500)  # fmt: skip

    async with FakeEngine("a", handler=failing) as a, FakeEngine("b") as b, router() as (app, client):
        await put_pool(client, [("a", a.url), ("b", b.url)])
        for _ in range(12):
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}) as r:
                assert r.status == 200
        assert value(app, "fleet_router_endpoint_ejections_total", model="m", endpoint="a", reason="5xx") == 1
        assert value(app, "fleet_router_requests_total", model="m", endpoint="a", code="500") == 5


async def test_gaps_between_tokens_shorter_than_the_deadline_pass_and_a_silent_stream_is_cut() -> None:
    gaps_s = [DEADLINE_S / 2, DEADLINE_S / 2, DEADLINE_S * 3]

    async def slow_stream(request: web.Request) -> web.StreamResponse:
        resp = await open_sse(request)
        gaps = gaps_s if (await request.json()).get("cut") else gaps_s[:2]
        for i, gap_s in enumerate(gaps):
            await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': str(i)}]})}\n\n".encode())
            await asyncio.sleep(gap_s)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with FakeEngine("a", handler=slow_stream) as a, router() as (app, client):
        await put_pool(client, [("a", a.url)], first_token_timeout_s=DEADLINE_S)
        async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
            text = await stream_text(r)
        assert r.status == 200 and text.count("data: ") == 3 and text.endswith("data: [DONE]\n\n")
        t0 = time.monotonic()
        async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True,
                                                         "cut": True}) as r:  # fmt: skip
            text = await stream_text(r)
        # Silent for longer than the deadline after it began: cut with an OpenAI error event, as vLLM
        # ends a stream that fails (the client had its first tokens: nothing is retried).
        assert r.status == 200 and '"code": "upstream_interrupted"' in text and text.endswith("data: [DONE]\n\n")
        assert time.monotonic() - t0 < DEADLINE_S * 3
        assert value(app, "fleet_router_first_token_timeouts_total", model="m", endpoint="a") == 0
        assert value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="a", reason="interrupted") == 1


async def test_a_client_slow_to_read_never_cuts_a_stream_the_engine_keeps_sending() -> None:
    """The engine sends 32 MB of events at once; the client takes the first and then reads nothing
    for three times the deadline, so the router waits on the client to drain its socket. The idle
    limit is the engine's silence, not the client's: the whole stream arrives and the endpoint
    is not blamed."""
    event = b"data: " + json.dumps({"choices": [{"index": 0, "text": "x" * (32 << 10)}]}).encode() + b"\n\n"

    async def flood(request: web.Request) -> web.StreamResponse:
        resp = await open_sse(request)
        for _ in range(1024):
            await resp.write(event)
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async with FakeEngine("a", handler=flood) as a, router() as (app, client):
        await put_pool(client, [("a", a.url)], first_token_timeout_s=DEADLINE_S)
        async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
            first = await r.content.readuntil(b"\n\n")
            await asyncio.sleep(DEADLINE_S * 3)           # the client, not reading (the stimulus, not a wait)
            rest = await r.content.read()
        text = (first + rest).decode()
        assert r.status == 200 and text.count("data: ") == 1025 and text.endswith("data: [DONE]\n\n")
        assert "upstream_interrupted" not in text
        assert value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="a", reason="interrupted") == 0


async def test_a_stream_silent_after_half_an_event_is_cut() -> None:
    """Half an event (held back by the relay until its end) and then silence: still the engine's
    silence, cut within the deadline, not waited out."""
    release = asyncio.Event()

    async def half_then_silence(request: web.Request) -> web.StreamResponse:
        resp = await open_sse(request)
        await resp.write(b'data: {"choices": [{"index": 0, "text": "0"}]}\n\n')
        await asyncio.sleep(DEADLINE_S / 4)               # a read of its own, after the first token
        await resp.write(b'data: {"choices": [{"index": 0, "te')
        await release.wait()
        return resp

    async with FakeEngine("a", handler=half_then_silence) as a, router() as (app, client):
        await put_pool(client, [("a", a.url)], first_token_timeout_s=DEADLINE_S)
        with contextlib.suppress(aiohttp.ClientPayloadError):
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": True}) as r:
                await r.read()
        assert value(app, "fleet_router_endpoint_errors_total", model="m", endpoint="a", reason="interrupted") == 1
        release.set()


# --- the engine simulator's stall fault, through the router ----------------------------------

FAST = Profile(
    name="test-fast", model="m", hardware="nothing (unit test)",
    config=EngineConfig(max_num_seqs=32, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=512,
                        max_model_len=1024),
    cost=StepCost(fixed_s=0.004, per_token_s=1e-5), typical_startup_s=0.0, notes="unit tests",
)  # fmt: skip


@contextlib.asynccontextmanager
async def sim_replicas(n: int) -> AsyncIterator[list[SimReplica]]:
    replicas = [SimReplica(ReplicaSettings(profile=FAST, served_model_name="m"), index=i) for i in range(n)]
    for r in replicas:
        await r.start(bind_socket("127.0.0.1", 0))
    try:
        yield replicas
    finally:
        for r in replicas:
            await r.close()


async def test_a_stalled_simulated_engine_under_load_fails_no_request_and_is_ejected() -> None:
    clock = Clock()
    async with sim_replicas(2) as (a, b), router(clock) as (app, client):
        urls = [f"http://127.0.0.1:{r.port}" for r in (a, b)]
        await put_pool(client, [("a", urls[0]), ("b", urls[1])], first_token_timeout_s=DEADLINE_S)
        async with client.post(f"{urls[0]}/sim/faults", json={"stall": True}) as r:
            assert (await r.json())["stall"] is True
        async with client.get(f"{urls[0]}/health") as r:
            assert r.status == 200   # stalled, and healthy to anyone who asks

        async def one() -> tuple[int, float, bool]:
            t0 = time.monotonic()
            async with client.post("/v1/chat/completions", json={
                    "model": "m", "messages": [{"role": "user", "content": "hello " * 10}], "max_tokens": 8,
                    "stream": True}) as r:
                first = None
                data = b""
                async for chunk in r.content.iter_any():
                    first = first if first is not None else time.monotonic() - t0
                    data += chunk
            return r.status, first or 0.0, data.rstrip().endswith(b"data: [DONE]")

        results = await asyncio.gather(*(one() for _ in range(16)))
        assert all(status == 200 and done for status, _, done in results), results
        assert max(first for _, first, _ in results) < DEADLINE_S + 0.5      # deadline + one retry
        state = a.model.stats()
        assert state.num_running + state.num_waiting == 0    # the router's give-ups aborted them there
        assert value(app, "fleet_router_endpoint_ejections_total", model="m", endpoint="a", reason="stall") == 1
        timeouts = value(app, "fleet_router_first_token_timeouts_total", model="m", endpoint="a")
        assert timeouts == sum(first > DEADLINE_S for _, first, _ in results) >= 2
        # Ejected: the next requests go to b at once.
        assert all(first < DEADLINE_S for _, first, _ in await asyncio.gather(*(one() for _ in range(6))))
        # Lifted, and the ejection and its slow start over: a serves again.
        async with client.post(f"{urls[0]}/sim/faults", json={"stall": False}) as r:
            assert (await r.json())["stall"] is False
        answered = a.answered
        clock.skipped += 60.0
        await asyncio.gather(*(one() for _ in range(6)))
        assert a.answered > answered
