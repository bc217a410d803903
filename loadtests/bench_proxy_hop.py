"""What one proxy hop costs: Fleet's router vs a FastAPI + httpx proxy vs no proxy.

Self-contained benchmark kept to justify the router's hot-path design (raw ASGI + aiohttp
client; see docs/router-performance.md). It starts, each in its own process:

* a fixed-response fake backend (aiohttp.web on uvloop) on two loopback ports, answering
  every `POST /v1/completions` with the same ~200-byte completion JSON;
* the proxy under test: (0) `vllm-router` (the Rust router on PyPI, `--policy power_of_two`,
  `RUST_LOG=warn`) over the two backend ports, or (a) Fleet's router (`python -m router`, uvicorn with uvloop and
  httptools; pool of the two backend ports, default policy), or (b) a FastAPI route that
  forwards with a plain `httpx.AsyncClient`, round-robin over the two ports (uvicorn with
  uvloop and httptools too), or (c) nothing: the load goes to the backend directly;
* a closed-loop load generator (aiohttp on uvloop): `--concurrency` workers each send a
  45-byte JSON POST, wait for the whole answer, and send the next, for `--seconds` after a
  one-second warm-up.

With `--stream-chunks N` every request asks for `"stream": true` and the backend answers with an
SSE stream of N token events, `--chunk-gap-ms` apart (an engine paces tokens; events sent all at
once would coalesce into one read and hide the per-chunk cost), then `data: [DONE]`; every proxy
relays the stream chunk by chunk, and the load generator reads it to the end.

For each target it prints requests per second, p50/p99 latency and the CPU time per
request of the proxy process (user + system time from /proc/PID/stat over the measured
window divided by the requests served in it), and the same for the backend. Everything
shares the machine's cores, so figures move from run to run; read the ratios.

Usage: python loadtests/bench_proxy_hop.py [--seconds 10] [--concurrency 8]
       [--targets router,fastapi-httpx,direct] [--stream-chunks 16 --chunk-gap-ms 2] [--migration-limit 0]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from fastapi import Request, Response  # module level: FastAPI resolves the handler's string annotations here

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a file in the role processes
from loadtests.procs import SimFleet, cpu_s, free_port, wait_http  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
REQUEST_BODY = b'{"model":"bench","prompt":"hello","max_tokens":8}'  # ~45 bytes, as in the reference run
RESPONSE_BODY = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 1700000000, "model": "bench",
    "choices": [{"index": 0, "text": " world, this is a fixed answer", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 8, "total_tokens": 9},
}, separators=(",", ":")).encode()  # fmt: skip
STREAM_REQUEST_BODY = b'{"model":"bench","prompt":"hello","max_tokens":16,"stream":true,"ignore_eos":true}'
STREAM_EVENT = (b'data: {"id":"cmpl-bench","object":"text_completion","created":1700000000,"model":"bench",'
                b'"choices":[{"index":0,"text":" token","logprobs":null,"finish_reason":null}]}\n\n')
ADMIN_TOKEN = "bench-admin-token"
TARGETS = ("router", "vllm-router", "fastapi-httpx", "direct", "bare-asgi")


# --- roles run in child processes -------------------------------------------------------


def role_backend(stream_chunks: int, chunk_gap_s: float) -> None:
    """Fixed-response backend on two free ports; prints `PORTS p1 p2`, runs until killed.
    Streamed requests get `stream_chunks` SSE events `chunk_gap_s` apart, then `[DONE]`."""
    import uvloop
    from aiohttp import web

    async def answer(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if b'"stream":true' not in body:
            return web.Response(body=RESPONSE_BODY, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(stream_chunks):
            await resp.write(STREAM_EVENT)
            await asyncio.sleep(chunk_gap_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", answer)
        app.router.add_get("/health", lambda request: web.Response(text=""))   # vllm-router probes it
        app.router.add_get("/v1/models", lambda request: web.json_response(
            {"object": "list", "data": [{"id": "bench", "object": "model"}]}))
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        ports = []
        for _ in range(2):
            site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
            await site.start()
            ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]
        print("PORTS", *ports, flush=True)
        await asyncio.Event().wait()

    uvloop.run(main())


def role_fastapi_httpx(backend_urls: list[str]) -> None:
    """FastAPI route + plain httpx.AsyncClient proxy, round-robin over the backend ports."""
    import httpx
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from starlette.background import BackgroundTask

    from router.http.server import ListeningServer

    app = FastAPI()
    urls = itertools.cycle([f"{u}/v1/completions" for u in backend_urls])
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    @app.post("/v1/completions")
    async def proxy(request: Request) -> Response:
        body = await request.body()
        if b'"stream":true' in body:
            upstream_request = client.build_request("POST", next(urls), content=body,
                                                    headers={"content-type": "application/json"})
            streamed = await client.send(upstream_request, stream=True)
            return StreamingResponse(streamed.aiter_raw(), status_code=streamed.status_code,
                                     media_type=streamed.headers.get("content-type"),
                                     background=BackgroundTask(streamed.aclose))
        upstream = await client.post(next(urls), content=body, headers={"content-type": "application/json"})
        return Response(content=upstream.content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"))  # fmt: skip

    config = uvicorn.Config(app, host="127.0.0.1", port=0, loop="uvloop", http="httptools", access_log=False,
                            log_level="warning")  # fmt: skip
    ListeningServer(config, lambda h, p: print(f"listening on http://{h}:{p}", flush=True)).run()


def role_bare_asgi(backend_urls: list[str]) -> None:
    """The floor: a raw ASGI app that forwards with aiohttp, round-robin, and does nothing
    else (no parsing, routing policy, metrics or retries), on uvicorn (uvloop, httptools)."""
    import aiohttp
    import uvicorn

    from router.http.server import ListeningServer

    urls = itertools.cycle([f"{u}/v1/completions" for u in backend_urls])
    session: list[aiohttp.ClientSession] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                session.append(aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)))
                await send({"type": "lifespan.startup.complete"})
            await session[0].close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        async with session[0].post(next(urls), data=b"".join(chunks),
                                   headers={"content-type": "application/json"}) as upstream:  # fmt: skip
            if upstream.content_type == "text/event-stream":
                await send({"type": "http.response.start", "status": upstream.status,
                            "headers": [(b"content-type", b"text/event-stream")]})
                async for chunk in upstream.content.iter_any():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
                return
            data = await upstream.read()
            headers = [(b"content-type", upstream.headers["content-type"].encode()),
                       (b"content-length", str(len(data)).encode())]  # fmt: skip
            await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
            await send({"type": "http.response.body", "body": data})

    config = uvicorn.Config(app, host="127.0.0.1", port=0, loop="uvloop", http="httptools", access_log=False,
                            log_level="warning", lifespan="on")  # fmt: skip
    ListeningServer(config, lambda h, p: print(f"listening on http://{h}:{p}", flush=True)).run()


def role_loadgen(urls: list[str], seconds: float, concurrency: int, request_body: bytes) -> None:
    """Closed-loop load: warm up 1 s, print `MEASURING`, run `seconds`, print a JSON result.
    Worker i sends to urls[i % len(urls)] (direct load spreads over the engines as a proxy does)."""
    import aiohttp
    import uvloop

    async def main() -> None:
        connector = aiohttp.TCPConnector(limit=concurrency)
        headers = {"Content-Type": "application/json"}
        async with aiohttp.ClientSession(connector=connector) as session:
            latencies_s: list[float] = []
            errors = 0
            measuring = False

            async def worker(i: int, deadline_s: float) -> None:
                nonlocal errors
                url = urls[i % len(urls)]
                while (start_s := time.perf_counter()) < deadline_s:
                    async with session.post(url, data=request_body, headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                    if measuring:
                        latencies_s.append(time.perf_counter() - start_s)
                        errors += not ok

            await asyncio.gather(*(worker(i, time.perf_counter() + 1.0) for i in range(concurrency)))
            measuring = True
            print("MEASURING", flush=True)
            began_s = time.perf_counter()
            await asyncio.gather(*(worker(i, began_s + seconds) for i in range(concurrency)))
            elapsed_s = time.perf_counter() - began_s
        latencies_s.sort()
        n = len(latencies_s)
        print(json.dumps({
            "requests": n, "errors": errors, "elapsed_s": elapsed_s,
            "p50_s": latencies_s[n // 2] if n else None,
            "p99_s": latencies_s[min(n - 1, int(n * 0.99))] if n else None,
        }), flush=True)  # fmt: skip

    uvloop.run(main())


# --- orchestration ----------------------------------------------------------------------


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})  # fmt: skip


def read_line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if prefix in line:
            return line.strip()
    raise RuntimeError(f"process {proc.args!r} exited (rc={proc.wait()}) before printing {prefix!r}")


def configure_router(base: str, backend_urls: list[str], migration_limit: int | None = None) -> None:
    doc: dict[str, Any] = {"endpoints": [{"id": f"backend-{i}", "url": u} for i, u in enumerate(backend_urls)]}
    if migration_limit is not None:
        doc["migration_limit"] = migration_limit
    request = urllib.request.Request(f"{base}/admin/v1/pools/bench", data=json.dumps(doc).encode(), method="PUT",
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                              "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=10) as resp:
        assert resp.status == 200


def run_target(target: str, backend_pids: list[int], backend_urls: list[str], args: argparse.Namespace
               ) -> dict[str, Any]:  # fmt: skip
    proxy: subprocess.Popen[str] | None = None
    try:
        base = ""
        if target == "router":
            proxy = spawn("-m", "router", "--host", "127.0.0.1", "--port", "0",
                          env={"FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})  # fmt: skip
            base = read_line(proxy, "listening on").rsplit(" ", 1)[1]
            configure_router(base, backend_urls, args.migration_limit)
        elif target == "vllm-router":
            port = free_port()
            proxy = subprocess.Popen(
                [str(Path(sys.executable).with_name("vllm-router")), "--host", "127.0.0.1", "--port", str(port),
                 "--policy", args.vllm_router_policy, "--log-level", "warning",
                 "--worker-urls", *backend_urls],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
            base = f"http://127.0.0.1:{port}"
            wait_http(f"{base}/health", proxy)
        elif target in ("fastapi-httpx", "bare-asgi"):
            proxy = spawn(__file__, "--role", target, "--backend-urls", ",".join(backend_urls))
            base = read_line(proxy, "listening on").rsplit(" ", 1)[1]
        load_urls = [f"{u}/v1/completions" for u in backend_urls] if proxy is None else [f"{base}/v1/completions"]
        loadgen = spawn(__file__, "--role", "loadgen", "--urls", ",".join(load_urls),
                        "--seconds", str(args.seconds), "--concurrency", str(args.concurrency),
                        "--stream-chunks", str(args.stream_chunks))  # fmt: skip
        read_line(loadgen, "MEASURING")
        proxy_cpu0 = cpu_s(proxy.pid) if proxy else 0.0
        backend_cpu0 = sum(map(cpu_s, backend_pids))
        result = json.loads(read_line(loadgen, "{"))
        proxy_cpu_s = cpu_s(proxy.pid) - proxy_cpu0 if proxy else None
        backend_cpu_s = sum(map(cpu_s, backend_pids)) - backend_cpu0
        loadgen.wait(timeout=30)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=30)
    n = result["requests"]
    return {
        "target": target,
        "req_s": n / result["elapsed_s"],
        "p50_ms": result["p50_s"] * 1e3,
        "p99_ms": result["p99_s"] * 1e3,
        "errors": result["errors"],
        "proxy_cpu_us": None if proxy_cpu_s is None else proxy_cpu_s / n * 1e6,
        "backend_cpu_us": backend_cpu_s / n * 1e6,
    }


LABELS = {
    "router": "Fleet router (raw ASGI + aiohttp, uvicorn uvloop/httptools)",
    "vllm-router": "vllm-router 0.1.17 (Rust, PyPI)",
    "fastapi-httpx": "FastAPI route + plain httpx.AsyncClient (uvicorn uvloop/httptools)",
    "direct": "backend directly (no proxy)",
    "bare-asgi": "floor: bare raw ASGI + aiohttp forwarder (no parsing, policy, metrics)",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per target (default 10)")
    parser.add_argument("--concurrency", type=int, default=8, help="closed-loop workers (default 8)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {TARGETS}")
    parser.add_argument("--migration-limit", type=int, default=None,
                        help="the router pool's migration_limit (default: the router's; 0 turns migration off)")
    parser.add_argument("--stream-chunks", type=int, default=0,
                        help="0: non-streamed requests (default); N: streamed, N SSE token events each")
    parser.add_argument("--chunk-gap-ms", type=float, default=2.0,
                        help="milliseconds between the backend's SSE events (default 2)")
    parser.add_argument("--vllm-router-policy", default="power_of_two",
                        help="policy of the vllm-router target (default power_of_two)")
    parser.add_argument("--backend", choices=("fixed", "sim"), default="fixed",
                        help="fixed: a fixed answer at once (default; the proxy is the only work); "
                             "sim: two SIMULATED vLLM replicas (fleet.enginesim) with --sim-profile timing")
    parser.add_argument("--sim-profile", default="h100-llama-8b", help="simulator profile of --backend sim")
    parser.add_argument("--role", choices=("backend", "fastapi-httpx", "bare-asgi", "loadgen"), help=argparse.SUPPRESS)
    parser.add_argument("--backend-urls", help=argparse.SUPPRESS)
    parser.add_argument("--urls", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.role == "backend":
        return role_backend(args.stream_chunks, args.chunk_gap_ms / 1e3)
    if args.role == "fastapi-httpx":
        return role_fastapi_httpx(args.backend_urls.split(","))
    if args.role == "bare-asgi":
        return role_bare_asgi(args.backend_urls.split(","))
    if args.role == "loadgen":
        return role_loadgen(args.urls.split(","), args.seconds, args.concurrency,
                            STREAM_REQUEST_BODY if args.stream_chunks else REQUEST_BODY)

    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; known: {', '.join(TARGETS)}")
    if args.backend == "sim":
        with SimFleet(2, profile=args.sim_profile, model="bench") as sims:
            rows = [run_target(t, sims.pids, sims.urls, args) for t in targets]
        answer = (f"two SIMULATED {args.sim_profile} replicas, "
                  + (f"{args.stream_chunks} streamed tokens" if args.stream_chunks else "8 tokens, not streamed"))
    else:
        backend = spawn(__file__, "--role", "backend", "--stream-chunks", str(args.stream_chunks),
                        "--chunk-gap-ms", str(args.chunk_gap_ms))
        try:
            ports = [int(p) for p in read_line(backend, "PORTS").split()[1:]]
            rows = [run_target(t, [backend.pid], [f"http://127.0.0.1:{p}" for p in ports], args) for t in targets]
        finally:
            backend.terminate()
            backend.wait(timeout=30)
        answer = (f"{args.stream_chunks} SSE events {args.chunk_gap_ms:g} ms apart" if args.stream_chunks
                  else f"{len(RESPONSE_BODY)}-byte response")
    print(f"\n{args.seconds:g} s per target, concurrency {args.concurrency}, {os.cpu_count()} CPUs, {answer}\n")
    print("| target | req/s | p50 / p99 | proxy CPU per request | backend CPU per request | errors |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        proxy_cpu = "—" if row["proxy_cpu_us"] is None else f"{row['proxy_cpu_us']:,.0f} µs"
        print(f"| {LABELS[row['target']]} | {row['req_s']:,.0f} | {row['p50_ms']:.2f} / {row['p99_ms']:.2f} ms "
              f"| {proxy_cpu} | {row['backend_cpu_us']:,.0f} µs | {row['errors']} |")  # fmt: skip


if __name__ == "__main__":
    main()
