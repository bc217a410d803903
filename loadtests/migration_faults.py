"""Fault runs of the request path: engines that die, stop or break the protocol under 30 req/s of
streamed completions through one Fleet router, and what the clients saw.

Owns the runs, their report and a misbehaving engine (`--role bad-engine`, an aiohttp server in a
process of its own). The load is `loadtests.faultload.FaultLoad` (open loop, each stream checked
for `data: [DONE]`, an error event and its token events), the simulated replicas
`loadtests.procs.SimFleet` (one process per replica, so one can be signalled alone), the router
`python -m router` (its pool PUT through `loadtests.routing_faults.put_pool`). Nothing here is on a
request path; everything runs on loopback and ends by itself.

- **kill**: one of three replicas is `SIGKILL`ed a third of the way in. Its streams in flight are
  migrated (router.request.migrate): counted are failed and cut requests, streams short of their
  `max_tokens`, the router's `fleet_router_migrations_total` and the latency it added
  (`fleet_router_migration_seconds`), and the client's TTFT and end-to-end latency of the requests
  in flight at the kill against the others.
- **stop**: one replica is `SIGSTOP`ped for ``--stop-s`` (10 s) a third of the way in, then
  `SIGCONT`ed: its streams go silent and are cut by the idle guard, then migrated.
- **error-events**, **trickle**, **huge**: a third endpoint beside two replicas answers 200 with an
  error event inside every stream; or trickles a byte every 2 s after one event; or answers every
  request with a sized 100 MiB body (here the load also sends non-streamed requests, one every
  0.5 s; over the router's default `max_response_bytes` they are refused and retried elsewhere,
  and with ``--max-response-bytes 268435456`` relayed as they arrive). Counted: failed and cut
  requests (and how many came after the first ten seconds), the bad endpoint's ejections, and
  the router's RSS (start and largest, sampled every 0.5 s).

Usage (bounded: ``--seconds`` per run, default 60):
    .venv/bin/python -m loadtests.migration_faults [--runs kill,stop,error-events,trickle,huge] \\
        [--seconds 60] [--rate 30] [--json-out loadtests/results/migration-faults.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file in the engine's process
from loadtests.faultload import FaultLoad, Request  # noqa: E402
from loadtests.procs import SimFleet, free_port, rss_mib, wait_http  # noqa: E402
from loadtests.routing_faults import ADMIN_TOKEN, MODEL, scrape  # noqa: E402
from loadtests.routing_faults import put_pool as put_routing_pool  # noqa: E402
from loadtests.stats import summarize  # noqa: E402

RUNS = ("kill", "stop", "error-events", "trickle", "huge")
MIGRATION_SERIES = re.compile(r"^fleet_router_(migrations|unmigrated_streams|migration_seconds_(sum|count)|"
                              r"endpoint_ejections|retries)")  # fmt: skip
HUGE_BYTES = 100 * 1024 * 1024


# ----- the misbehaving engine (its own process) -------------------------------------------------


def token_event(text: str) -> bytes:
    doc = {"id": "cmpl-bad", "object": "text_completion", "created": 1, "model": MODEL,
           "choices": [{"index": 0, "text": text, "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def bad_engine(mode: str, port: int) -> None:
    """Serve `/v1/completions` misbehaving as `mode` on `port` until killed."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if mode == "huge" and not body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            resp.content_length = HUGE_BYTES
            await resp.prepare(request)
            head = b'{"id": "cmpl-huge", "choices": [{"index": 0, "text": "'
            block = b"x" * (1024 * 1024)
            await resp.write(head)
            left = HUGE_BYTES - len(head) - len(b'"}]}')
            while left > 0:
                await resp.write(block[:left])
                left -= len(block)
            await resp.write(b'"}]}')
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(token_event(" bad"))
        if mode == "error-events":
            await resp.write(b'data: {"error": {"message": "engine failed", "type": "InternalServerError", '
                             b'"code": 500}}\n\ndata: [DONE]\n\n')  # fmt: skip
        elif mode == "trickle":
            for _ in range(60):
                await asyncio.sleep(2.0)
                await resp.write(b" ")
        else:
            for _ in range(int(body.get("max_tokens") or 8) - 1):
                await resp.write(token_event(" word"))
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


@contextmanager
def bad_engine_process(mode: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--role", "bad-engine", "--mode", mode, "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(f"{url}/health", proc)
        yield url
    finally:
        proc.kill()
        proc.wait()


# ----- the router --------------------------------------------------------------------------------


@contextmanager
def router(urls: list[str], migration_limit: int | None = None,
           stream_limits: dict[str, Any] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})  # fmt: skip
    try:
        wait_http(f"{base}/health", proc)
        doc: dict[str, Any] = {"policy": "round-robin",
                               "endpoints": [{"id": f"e{i}", "url": u} for i, u in enumerate(urls)]}  # fmt: skip
        if migration_limit is not None:
            doc["migration_limit"] = migration_limit
        if stream_limits:
            doc["stream_limits"] = stream_limits
        put_routing_pool(base, doc)
        yield proc, base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


class RssSampler:
    """The RSS (MiB) of process `pid` every 0.5 s in a thread: `first` and `peak`."""

    def __init__(self, pid: int) -> None:
        self.pid, self.first, self.peak = pid, rss_mib(pid), rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _non_streamed_loop(base: str, stop: threading.Event, results: list[str]) -> None:
    """Non-streamed completions one every 0.5 s until `stop`; each body is read and dropped."""

    async def run() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            while not stop.is_set():
                try:
                    async with session.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "hi",
                                                                            "max_tokens": 8}) as r:  # fmt: skip
                        size = 0
                        async for chunk in r.content.iter_any():
                            size += len(chunk)
                        results.append(f"{r.status}:{size}")
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    results.append(type(err).__name__)
                await asyncio.sleep(0.5)

    asyncio.run(run())


# ----- the runs ------------------------------------------------------------------------------------


def _latencies(requests: list[Request]) -> dict[str, Any]:
    ok = [r for r in requests if r.outcome == "ok"]
    return {"ttft_s": summarize([r.first_byte_at_s - r.sent_at_s for r in ok if r.first_byte_at_s is not None]),
            "e2e_s": summarize([r.ended_at_s - r.sent_at_s for r in ok])}  # fmt: skip


def _outcomes(load: FaultLoad, max_tokens: int) -> dict[str, Any]:
    done = load.done
    return {"requests": len(done), "failed": len(load.failed), "cut": len(load.cut),
            "short": sum(1 for r in done if r.outcome == "ok" and r.token_events != max_tokens),
            "details": sorted({f"{r.outcome}: {r.detail}" for r in done if r.outcome != "ok"})}  # fmt: skip


def run_signal(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    """`kill` (SIGKILL replica 0) or `stop` (SIGSTOP it for ``--stop-s``, then SIGCONT)."""
    with SimFleet(3, profile=args.profile, model=MODEL, processes=3, seed=args.seed) as sims, \
            router(sims.urls) as (proc, base):  # fmt: skip
        with FaultLoad(base, MODEL, rate_per_s=args.rate, max_tokens=args.max_tokens) as load:
            time.sleep(args.seconds / 3)
            at_s = time.monotonic()
            pid = sims.pids[0]
            os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
            if kind == "stop":
                time.sleep(args.stop_s)
                os.kill(pid, signal.SIGCONT)
            time.sleep(max(0.0, args.seconds * 2 / 3 - (time.monotonic() - at_s)))
        metrics = scrape(base, MIGRATION_SERIES)
        during = [r for r in load.done if r.sent_at_s <= at_s <= (r.ended_at_s or at_s)]
        others = [r for r in load.done if r not in during]
        return {"run": kind, "seconds": args.seconds, "rate": args.rate, "max_tokens": args.max_tokens,
                **_outcomes(load, args.max_tokens), "metrics": metrics,
                "in_flight_at_fault": {"count": len(during), **_latencies(during)},
                "others": {"count": len(others), **_latencies(others)}}  # fmt: skip


def run_bad(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """A misbehaving third endpoint (`bad_engine`) beside two replicas."""
    limits = {"max_response_bytes": args.max_response_bytes} if args.max_response_bytes else None
    with SimFleet(2, profile=args.profile, model=MODEL, processes=2, seed=args.seed) as sims, \
            bad_engine_process(mode) as bad_url, \
            router([*sims.urls, bad_url], stream_limits=limits) as (proc, base):  # fmt: skip
        stop = threading.Event()
        sized: list[str] = []
        sized_thread = threading.Thread(target=_non_streamed_loop, args=(base, stop, sized), daemon=True)
        with RssSampler(proc.pid) as rss, FaultLoad(base, MODEL, rate_per_s=args.rate, max_tokens=args.max_tokens,
                                                    timeout_s=120) as load:  # fmt: skip
            began = time.monotonic()
            if mode == "huge":
                sized_thread.start()
            time.sleep(args.seconds)
            stop.set()
        if mode == "huge":
            sized_thread.join(timeout=150)
        late = [r for r in load.done if r.sent_at_s > began + 10 and r.outcome != "ok"]
        return {"run": mode, "seconds": args.seconds, "rate": args.rate, **_outcomes(load, args.max_tokens),
                "not_ok_after_10_s": len(late), "metrics": scrape(base, MIGRATION_SERIES),
                "router_rss_mib": {"start": round(rss.first, 1), "peak": round(rss.peak, 1)},
                "non_streamed": {"sent": len(sized), "not_200": sum(1 for s in sized if not s.startswith("200:")),
                                 "huge_relayed": sum(1 for s in sized if s.endswith(f":{HUGE_BYTES}"))}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="driver", choices=("driver", "bad-engine"))
    parser.add_argument("--mode", default="error-events", help="bad-engine: error-events, trickle or huge")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each run (default 60)")
    parser.add_argument("--rate", type=float, default=30.0, help="streamed requests per second (default 30)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--stop-s", type=float, default=10.0, help="how long the stop run SIGSTOPs (default 10)")
    parser.add_argument("--max-response-bytes", type=int, default=0,
                        help="the pool's max_response_bytes (default: the router's, 64 MiB, under the huge answers)")
    parser.add_argument("--profile", default="h100-llama-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-out", type=Path, default=None)
    args = parser.parse_args()
    if args.role == "bad-engine":
        bad_engine(args.mode, args.port)
        return
    results = []
    for run in args.runs.split(","):
        if run not in RUNS:
            parser.error(f"--runs: unknown run {run!r}; known: {', '.join(RUNS)}")
        result = run_signal(args, run) if run in ("kill", "stop") else run_bad(args, run)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
