"""The open-loop trace replayer: dispatch at trace times regardless of earlier requests (on fake
time), exact token-id prompts with shared prefixes, TTFT/TPOT measurement over real SSE, and
errors recorded instead of aborting the run (loadtests.replay)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from aiohttp import web

from fleet.tracesim.traces import Trace, TraceRequest
from loadtests.replay import HttpSender, Outcome, PromptBuilder, main, replay, summarize_run
from tests.support.router import dead_endpoint
from tests.support.fakes import FakeClock
from tests.support.waits import async_wait_until


async def test_requests_go_out_at_trace_times_even_while_earlier_ones_hang() -> None:
    clock = FakeClock(start_s=50.0)
    trace = Trace("t", tuple(TraceRequest(s, 10, 4) for s in (0.0, 1.0, 1.0, 3.5)))
    release = asyncio.Event()
    dispatched: list[tuple[int, float]] = []
    in_flight_seen: list[int] = []

    async def send(i: int, r: TraceRequest) -> Outcome:
        dispatched.append((i, clock() - 50.0))
        await release.wait()                     # the server answers nothing until the end
        return Outcome(status=200, ttft_s=0.5, e2e_s=1.5, output_tokens=r.output_tokens)

    async def sleep(seconds: float) -> None:     # as on a real loop: ready tasks run before time passes
        await asyncio.sleep(0)
        clock.advance(seconds)

    task = asyncio.create_task(replay(trace, send, clock, sleep,
                                      on_progress=lambda sent, done, n: in_flight_seen.append(n)))
    # a closed-loop replayer would never get there: it waits on the answers, held until the end
    await async_wait_until(lambda: len(dispatched) == 4, 10, interval_s=0, what="four requests dispatched")
    assert dispatched == [(0, 0.0), (1, 1.0), (2, 1.0), (3, 3.5)]   # open loop: no waiting on answers
    assert in_flight_seen[-1] == 4
    release.set()
    records = await task
    assert [r.sent_s for r in records] == [0.0, 1.0, 1.0, 3.5]
    assert [r.scheduled_s for r in records] == [0.0, 1.0, 1.0, 3.5]
    assert all(r.ok and r.tpot_s == pytest.approx((1.5 - 0.5) / 3) for r in records)


async def test_a_late_replayer_records_its_own_lag() -> None:
    clock = FakeClock(start_s=0.0)
    trace = Trace("t", (TraceRequest(0.0, 1, 1), TraceRequest(0.1, 1, 1)))

    async def slow_send(i: int, r: TraceRequest) -> Outcome:
        return Outcome(status=200, ttft_s=0.01, e2e_s=0.01, output_tokens=1)

    async def sleep(seconds: float) -> None:     # the event loop wakes the replayer 0.3 s late
        clock.advance(seconds + 0.3)

    records = await replay(trace, slow_send, clock, sleep)
    assert records[1].sent_s - records[1].scheduled_s == pytest.approx(0.3)
    assert summarize_run(records)["send_lag_s"]["max"] == pytest.approx(0.3)


async def test_a_failing_sender_is_recorded_and_the_replay_goes_on() -> None:
    trace = Trace("t", tuple(TraceRequest(0.0, 1, 1) for _ in range(3)))

    async def send(i: int, r: TraceRequest) -> Outcome:
        if i == 1:
            raise RuntimeError("boom")
        return Outcome(status=200, ttft_s=0.1, e2e_s=0.1, output_tokens=1)

    records = await replay(trace, send)
    assert [r.ok for r in records] == [True, False, True]
    assert records[1].error == "RuntimeError: boom"
    s = summarize_run(records, ttft_slo_s=0.2)
    assert (s["succeeded"], s["failed"]) == (2, 1)
    assert s["within_ttft_slo"] == pytest.approx(2 / 3)        # a failure is an SLO miss


def test_prompts_have_exact_lengths_and_share_only_declared_prefix_blocks() -> None:
    b = PromptBuilder(seed=3, vocab_size=100, min_token_id=10)
    a = b.prompt(0, TraceRequest(0.0, 40, 1, prefix_blocks=(7,)))
    c = b.prompt(1, TraceRequest(0.0, 50, 1, prefix_blocks=(7, 8)))
    d = b.prompt(2, TraceRequest(0.0, 40, 1))
    assert (len(a), len(c), len(d)) == (40, 50, 40)
    assert a[:16] == c[:16] and a[16:32] != c[16:32] and a[:16] != d[:16]
    assert all(10 <= t < 100 for t in a + c + d)
    assert b.prompt(0, TraceRequest(0.0, 40, 1, prefix_blocks=(7,))) == a          # deterministic
    assert len(b.prompt(0, TraceRequest(0.0, 4000, 1), clip_tokens=900)) == 900


class SseEngine:
    """aiohttp server streaming vLLM-shaped completion events, with a final usage event."""

    def __init__(self, tokens: int = 5, status: int = 200) -> None:
        self.tokens, self.status = tokens, status
        self.bodies: list[dict] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.json_response({"error": {"message": "overloaded"}}, status=self.status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = min(self.tokens, body["max_tokens"])
        for i in range(n):
            event = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": f" t{i}"}]}
            await resp.write(f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode())
            await asyncio.sleep(0.001)
        usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}}
        await resp.write(f"data: {json.dumps(usage, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()


async def test_http_sender_measures_streams_and_sends_exact_token_prompts() -> None:
    engine = SseEngine(tokens=6)
    trace = Trace("t", (TraceRequest(0.0, 40, 6, prefix_blocks=(1,)), TraceRequest(0.01, 33, 4, prefix_blocks=(1,))))
    async with engine as url, HttpSender(url, "m", PromptBuilder()) as sender:
        records = await replay(trace, sender)
    assert [len(b["prompt"]) for b in engine.bodies] == [40, 33] or [len(b["prompt"]) for b in engine.bodies] == [33, 40]
    first, second = sorted(engine.bodies, key=lambda b: len(b["prompt"]), reverse=True)
    assert first["prompt"][:16] == second["prompt"][:16]
    assert first["ignore_eos"] is True and first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert [r.output_tokens for r in records] == [6, 4]
    for r in records:
        assert r.ok and 0 < r.ttft_s <= r.e2e_s and r.tpot_s is not None


async def test_http_errors_and_refused_connections_are_recorded() -> None:
    sock, dead_url = dead_endpoint()
    trace = Trace("t", (TraceRequest(0.0, 5, 2),))
    try:
        async with SseEngine(status=503) as url, HttpSender(url, "m", PromptBuilder()) as sender:
            busy = await replay(trace, sender)
        async with HttpSender(dead_url, "m", PromptBuilder()) as sender:
            refused = await replay(trace, sender)
    finally:
        sock.close()
    assert busy[0].status == 503 and busy[0].error.startswith("HTTP 503")
    assert refused[0].status is None and "ClientConnectorError" in refused[0].error


async def test_command_line_replays_a_trace_file_and_writes_json(tmp_path: Path, capsys) -> None:
    trace_file = tmp_path / "t.jsonl"
    trace_file.write_text("".join(json.dumps({"timestamp_s": i * 0.01, "prompt_tokens": 8, "output_tokens": 3}) + "\n"
                                  for i in range(5)))
    out = tmp_path / "run.json"
    async with SseEngine(tokens=3) as url:
        code = await asyncio.to_thread(main, [str(trace_file), "--url", url, "--model", "m", "--speedup", "2",
                                              "--ttft-slo-s", "5", "--json-out", str(out)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["succeeded"] == 5 and doc["summary"]["within_ttft_slo"] == 1.0
    assert [r["scheduled_s"] for r in doc["requests"]] == pytest.approx([0.0, 0.005, 0.01, 0.015, 0.02])
    assert "5 requests, 5 ok, 0 failed" in capsys.readouterr().out


def test_command_line_rejects_a_bad_trace(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp_s": 0}\n')
    assert main([str(bad), "--url", "http://127.0.0.1:9", "--model", "m"]) == 2
    assert "bad.jsonl:1 prompt_tokens: required field is missing" in capsys.readouterr().err
