"""The main job's two figures: replica time to READY, and the router's added latency.

Runs `fleet up` on examples/quickstart.yaml (real vLLM replicas, CPU build, tiny model; two as
shipped, `--replicas` to change) as a user would, and measures:

1. **Time to READY** per replica, from the controller's own records (`fleet status --json`):
   created -> launched -> `/health` passed -> warm-up passed (READY), in seconds.
2. **Added latency of the router**: the same streamed completion (`max_tokens` tokens,
   `ignore_eos`) sent by the same closed-loop client at a modest, fixed concurrency, either
   through the router or straight to an engine (round-robin over the two replicas). The two
   arms alternate in blocks so that drift in the shared machine's speed falls on both alike.
   Reported: TTFT (first SSE chunk) and end-to-end latency, p50 and p99, for each arm, and the
   difference router - direct, plus the router process's CPU seconds per request.

On a 2-core machine, two CPU engines keep both cores busy (vLLM's OpenMP threads spin), so the
router and the load generator wait for a core; `--replicas 1` leaves one core free and shows
the router's own cost apart from that contention.

Usage (from the repository root, with the environment of `.ci/venv.sh`):
    .venv/bin/python -m loadtests.bench_main_job [--replicas 2] [--requests 200] [--concurrency 2] [--max-tokens 16]
Prints a table and writes JSON with `--json-out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil
import yaml

from loadtests.procs import cpu_s, free_port
from loadtests.stats import percentile

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "examples" / "quickstart.yaml"


async def one_request(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, float]:
    """(TTFT s, end-to-end s) of one streamed completion read to its [DONE]."""
    start = time.perf_counter()
    first = None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {await resp.text()}")
        async for chunk in resp.content.iter_any():
            if first is None and chunk.strip():
                first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start


async def run_block(session, urls: list[str], n: int, concurrency: int, body: dict) -> list[tuple[float, float]]:
    """n requests by `concurrency` closed-loop workers; worker w always uses urls[w % len(urls)],
    so direct calls spread evenly over the engines, as the router's least-outstanding policy does."""
    results: list[tuple[float, float]] = []
    counter = iter(range(n))

    async def worker(w: int) -> None:
        for i in counter:
            results.append(await one_request(session, urls[w % len(urls)], body))

    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return results


async def measure_latency(router_url: str, engines: list[str], model: str, args) -> dict:
    body = {"model": model, "prompt": "The fleet manager places replicas", "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0.0}
    arms: dict[str, list[tuple[float, float]]] = {"direct": [], "router": []}
    router_cpu_s = 0.0
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await run_block(session, [router_url], 2 * args.concurrency, args.concurrency, body)   # warm connections
        await run_block(session, engines, 2 * args.concurrency, args.concurrency, body)
        block = args.block
        done = 0
        while done < args.requests:
            n = min(block, args.requests - done)
            arms["direct"] += await run_block(session, engines, n, args.concurrency, body)
            before = cpu_s(args.router_pid)
            arms["router"] += await run_block(session, [router_url], n, args.concurrency, body)
            router_cpu_s += cpu_s(args.router_pid) - before
            done += n
    out: dict = {"requests_per_arm": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens}
    for arm, samples in arms.items():
        ttft = [s[0] for s in samples]
        e2e = [s[1] for s in samples]
        out[arm] = {"ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
                    "e2e_p50_ms": 1e3 * percentile(e2e, 50), "e2e_p99_ms": 1e3 * percentile(e2e, 99),
                    "e2e_mean_ms": 1e3 * statistics.fmean(e2e)}
    out["added"] = {k: out["router"][k] - out["direct"][k] for k in out["direct"]}
    out["router_cpu_us_per_request"] = 1e6 * router_cpu_s / args.requests
    return out


def wait_ready(state_file: Path, proc: subprocess.Popen, n: int, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"fleet up exited with {proc.returncode}")
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            state = {}
        replicas = state.get("replicas", [])
        if sum(r["status"] == "READY" for r in replicas) >= n:
            return state
        time.sleep(0.5)
    sys.exit(f"replicas not READY within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200, help="requests per arm (default 200)")
    parser.add_argument("--concurrency", type=int, default=2, help="closed-loop clients (default 2)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    parser.add_argument("--block", type=int, default=20, help="requests per alternating block (default 20)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="replicas of the quickstart deployment (default 2, as shipped; 1 leaves a core "
                             "of this 2-core machine to the router and the client)")
    parser.add_argument("--json-out", type=Path, help="also write the figures as JSON here")
    args = parser.parse_args()

    from fleet.engines.tinymodel import make_tiny_model

    make_tiny_model(REPO / "examples" / "models" / "tiny-llama")
    state_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    spec = yaml.safe_load(QUICKSTART.read_text())
    spec["spec"]["replicas"] = {"min": args.replicas, "max": args.replicas}
    spec["spec"]["model"]["source"] = str(REPO / "examples" / "models" / "tiny-llama")
    spec_file = state_dir / "quickstart.yaml"
    spec_file.write_text(yaml.safe_dump(spec))
    port = free_port()
    out = open(state_dir / "fleet-up.out", "wb")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "up", str(spec_file), "--port", str(port),
                             "--state-dir", str(state_dir)], stdout=out, stderr=subprocess.STDOUT)
    try:
        state = wait_ready(state_dir / "state.json", proc, args.replicas, 600)
        wall_ready_s = time.monotonic() - started
        replicas = [r for r in state["replicas"] if r["status"] == "READY"]
        ttr = {
            r["id"]: {
                "launch_to_health_s": r["healthy_at_s"] - r["launched_at_s"],
                "warmup_s": r["warmup_passed_at_s"] - r["healthy_at_s"],
                "created_to_ready_s": r["warmup_passed_at_s"] - r["created_at_s"],
            }
            for r in replicas
        }
        args.router_pid = next(p.pid for p in psutil.Process(proc.pid).children()
                               if p.cmdline()[1:3] == ["-m", "router"])
        lat = asyncio.run(measure_latency(f"http://127.0.0.1:{port}", [r["endpoint"] for r in replicas],
                                          "tiny-llama", args))
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=180)

    print(f"Time to READY (fleet up -> all {args.replicas} replica(s) READY: {wall_ready_s:.1f} s wall)")
    print(f"{'replica':<14}{'launch->/health s':>19}{'warm-up s':>11}{'created->READY s':>18}")
    for rid, t in sorted(ttr.items()):
        print(f"{rid:<14}{t['launch_to_health_s']:>19.1f}{t['warmup_s']:>11.2f}{t['created_to_ready_s']:>18.1f}")
    print(f"\nRouter added latency: {args.requests} streamed completions per arm, {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}")
    print(f"{'arm':<8}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'e2e p50 ms':>12}{'e2e p99 ms':>12}")
    for arm in ("direct", "router", "added"):
        d = lat[arm]
        print(f"{arm:<8}{d['ttft_p50_ms']:>13.2f}{d['ttft_p99_ms']:>13.2f}{d['e2e_p50_ms']:>12.2f}{d['e2e_p99_ms']:>12.2f}")
    print(f"router CPU per request: {lat['router_cpu_us_per_request']:.0f} us")
    if args.json_out:
        args.json_out.write_text(json.dumps({"time_to_ready": ttr, "wall_ready_s": wall_ready_s, "latency": lat}, indent=1))


if __name__ == "__main__":
    main()
