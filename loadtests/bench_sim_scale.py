"""Hundreds of SIMULATED engine replicas on one small machine: start, health, load, cost.

Starts `--processes` processes of `fleet sim-engine --replicas N` (each replica on its own free
port, listed in a ports file), then:

1. waits until every replica answers `GET /health` and reports how long that took;
2. measures the idle CPU of the simulator processes over `--idle-s` seconds;
3. sends `--requests-per-replica` completion requests to every replica (half of them streamed,
   `--concurrency` in flight at once, prompts of 64-512 words, 16-64 output tokens) and
   reports successes, throughput, the CPU time the simulator processes used per request, and
   the scheduler's own TTFT from each replica's `/metrics`;
4. reports the resident memory (VmRSS) of every process, then stops them with SIGTERM.

Run it under the machine's heavy lock:

    flock /tmp/fleet-heavy.lock .venv/bin/python loadtests/bench_sim_scale.py --processes 4 --replicas 50

Everything shares the machine's cores with this script's load generator; the figures are what
this machine does, not a limit of the simulator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # also runs as a file
from loadtests.procs import cpu_s, rss_mib  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


async def wait_healthy(session: aiohttp.ClientSession, urls: list[str], timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    pending = set(urls)
    while pending and time.monotonic() < deadline:
        async def probe(u: str) -> str | None:
            try:
                async with session.get(f"{u}/health") as r:
                    return u if r.status == 200 else None
            except aiohttp.ClientError:
                return None
        ok = await asyncio.gather(*(probe(u) for u in pending))
        pending -= {u for u in ok if u}
        if pending:
            await asyncio.sleep(0.2)
    return len(urls) - len(pending)


async def one_request(session: aiohttp.ClientSession, url: str, rng: random.Random, model: str) -> bool:
    stream = rng.random() < 0.5
    body = {"model": model, "prompt": "tok " * rng.randint(64, 512), "max_tokens": rng.randint(16, 64),
            "ignore_eos": True, "stream": stream}  # fmt: skip
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                return False
            if stream:
                last = b""
                async for line in r.content:
                    if line.strip():
                        last = line.strip()
                return last == b"data: [DONE]"
            doc = await r.json()
            return doc["usage"]["completion_tokens"] == body["max_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return False


async def load(urls: list[str], per_replica: int, concurrency: int, model: str, seed: int) -> tuple[int, int, float]:
    rng = random.Random(seed)
    jobs = [u for u in urls for _ in range(per_replica)]
    rng.shuffle(jobs)
    sem = asyncio.Semaphore(concurrency)
    conn = aiohttp.TCPConnector(limit=concurrency, limit_per_host=4)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=120)) as s:
        async def run(u: str) -> bool:
            async with sem:
                return await one_request(s, u, rng, model)
        t0 = time.monotonic()
        results = await asyncio.gather(*(run(u) for u in jobs))
        return sum(results), len(results), time.monotonic() - t0


async def scheduler_ttft(urls: list[str]) -> tuple[float, int]:
    """Mean TTFT the replicas' own metrics report, and the number of requests it covers."""
    total = count = 0.0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        for u in urls:
            async with s.get(f"{u}/metrics") as r:
                for line in (await r.text()).splitlines():
                    if line.startswith("vllm:time_to_first_token_seconds_sum"):
                        total += float(line.rsplit(" ", 1)[1])
                    elif line.startswith("vllm:time_to_first_token_seconds_count"):
                        count += float(line.rsplit(" ", 1)[1])
    return (total / count if count else 0.0), int(count)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--processes", type=int, default=4)
    ap.add_argument("--replicas", type=int, default=50, help="Replicas per process.")
    ap.add_argument("--profile", default="h100-llama-8b")
    ap.add_argument("--requests-per-replica", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model = "sim-model"
    tmp = Path(tempfile.mkdtemp(prefix="sim-scale-"))
    procs: list[subprocess.Popen] = []
    t0 = time.monotonic()
    try:
        for k in range(args.processes):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fleet.cli", "sim-engine", "--replicas", str(args.replicas), "--profile",
                 args.profile, "--model-name", model, "--seed", str(k), "--ports-file", str(tmp / f"p{k}.json")],
                cwd=REPO, stdout=open(tmp / f"p{k}.log", "w"), stderr=subprocess.STDOUT, start_new_session=True,
            ))  # fmt: skip
        urls: list[str] = []
        for k, p in enumerate(procs):
            f = tmp / f"p{k}.json"
            while not f.exists():
                if p.poll() is not None:
                    print((tmp / f"p{k}.log").read_text())
                    raise SystemExit(f"process {k} exited with {p.returncode}")
                time.sleep(0.05)
            urls += json.loads(f.read_text())["urls"]

        async def health() -> int:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                return await wait_healthy(s, urls, 60)

        healthy = asyncio.run(health())
        up_s = time.monotonic() - t0
        print(f"{healthy}/{len(urls)} simulated replicas healthy on {len(set(urls))} ports in {up_s:.1f} s "
              f"({args.processes} processes x {args.replicas}, profile {args.profile}, {os.cpu_count()} cores)")
        rss_idle = [rss_mib(p.pid) for p in procs]
        c0 = [cpu_s(p.pid) for p in procs]
        time.sleep(args.idle_s)
        idle_cpu = sum(cpu_s(p.pid) for p in procs) - sum(c0)
        print(f"idle: {idle_cpu / args.idle_s * 100:.1f}% of one core for all {len(urls)} replicas; "
              f"RSS {sum(rss_idle):.0f} MiB in all ({', '.join(f'{r:.0f}' for r in rss_idle)} MiB per process, "
              f"{sum(rss_idle) / len(urls):.2f} MiB per replica)")
        c1 = [cpu_s(p.pid) for p in procs]
        ok, n, wall = asyncio.run(load(urls, args.requests_per_replica, args.concurrency, model, args.seed))
        busy_cpu = sum(cpu_s(p.pid) for p in procs) - sum(c1)
        rss_busy = [rss_mib(p.pid) for p in procs]
        ttft, counted = asyncio.run(scheduler_ttft(urls))
        print(f"load: {ok}/{n} requests OK in {wall:.1f} s ({n / wall:.0f} req/s, {args.concurrency} in flight, "
              f"half streamed); simulator CPU {busy_cpu:.1f} s = {busy_cpu / n * 1e3:.2f} ms per request; "
              f"RSS after {sum(rss_busy):.0f} MiB; mean TTFT in the replicas' metrics {ttft * 1e3:.1f} ms "
              f"over {counted} requests")
        return 0 if healthy == len(urls) and ok == n else 1
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        print(f"stopped; exit codes {[p.returncode for p in procs]}")


if __name__ == "__main__":
    sys.exit(main())
