"""The locustfile runs headless against an OpenAI-shaped server and reports TTFT and TPOT as
their own rows, measured on the stream as it arrives (loadtests/locustfile.py)."""

from __future__ import annotations

import asyncio
import csv
import json
import os
import sys
from pathlib import Path

import pytest
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
GAP_S = 0.03          # between streamed tokens
TOKENS = 8


async def completions(request: web.Request) -> web.Response:
    await request.json()
    return web.json_response({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}]})


async def chat(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(TOKENS):
        event = {"id": "c", "choices": [{"index": 0, "delta": {"content": f"t{i}"}}]}
        await resp.write(f"data: {json.dumps(event, separators=(',', ':'))}\n\n".encode())
        await asyncio.sleep(GAP_S)
    usage = {"id": "c", "choices": [], "usage": {"completion_tokens": TOKENS}}
    await resp.write(f"data: {json.dumps(usage, separators=(',', ':'))}\n\ndata: [DONE]\n\n".encode())
    return resp


async def run_locust(tmp_path: Path, env: dict[str, str], seconds: int = 6) -> tuple[dict, str]:
    """Locust headless with two users for ``seconds`` against the fake server: (its stats rows by
    (type, name), its output)."""
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "locust", "-f", str(REPO / "loadtests" / "locustfile.py"), "--headless",
            "-u", "2", "-r", "2", "-t", f"{seconds}s", "--host", host, "--csv", str(tmp_path / "run"),
            "--only-summary", env={**os.environ, **env}, cwd=REPO,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=90)
    finally:
        await runner.cleanup()
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    return rows, out.decode(errors="replace")


@pytest.mark.timeout(120)
async def test_locust_reports_ttft_and_tpot_measured_on_the_stream(tmp_path: Path) -> None:
    rows, text = await run_locust(tmp_path, {"FLEET_WAIT_S": "0.05"})
    for key in (("POST", "completions"), ("POST", "chat (stream)"), ("METRIC", "TTFT"), ("METRIC", "TPOT"),
                ("METRIC", "E2E (stream)")):
        assert key in rows, (key, sorted(rows), text[-2000:])
        assert int(rows[key]["Request Count"]) > 0 and int(rows[key]["Failure Count"]) == 0, rows[key]
    ttft_ms = float(rows[("METRIC", "TTFT")]["Median Response Time"])
    tpot_ms = float(rows[("METRIC", "TPOT")]["Median Response Time"])
    whole_ms = float(rows[("METRIC", "E2E (stream)")]["Median Response Time"])
    # First token long before the end (not buffered), and TPOT close to the server's token gap.
    assert whole_ms >= TOKENS * GAP_S * 1e3 * 0.9, whole_ms
    assert ttft_ms < whole_ms / 2, (ttft_ms, whole_ms)
    assert 0.5 * GAP_S * 1e3 <= tpot_ms <= 4 * GAP_S * 1e3, tpot_ms


@pytest.mark.timeout(120)
async def test_a_user_rate_sends_a_steady_load_of_users_times_rate(tmp_path: Path) -> None:
    # 2 users at 1 request/s for 6 s: about 12 requests; with the 0.05 s think time alone the same
    # users send over 30 (each request takes about 0.25 s).
    rows, text = await run_locust(tmp_path, {"FLEET_WAIT_S": "0.05", "FLEET_USER_RATE": "1"})
    sent = sum(int(r["Request Count"]) for (kind, _), r in rows.items() if kind == "POST")
    assert 6 <= sent <= 16, (sent, text[-2000:])
