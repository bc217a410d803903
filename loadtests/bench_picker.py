"""The endpoint picker's round trip and CPU per pick, without engines: one picker process
(`python -m router.picker`) and one client in this process (`router.picker.client.PickerClient`,
the router's), asking `kv-aware` picks among `--endpoints` candidates for prompts of
`--prompt-tokens` token ids (the keys at 16-token blocks, as the router sends them).

Two phases: `--picks` picks one after the other (the round trip: p50 / p99, what one request
waits), then the same number `--concurrency` at a time (pipelined on the one connection: picks
per second, and the picker's CPU per pick from /proc). Every pick is finished right after its
answer, so the load stays flat. No KV events: the exact index is empty, the cost measured is
the wire, the loop and the policy.

Usage:
    python -m loadtests.bench_picker [--picks 2000] [--endpoints 8] [--prompt-tokens 12000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

from loadtests.procs import cpu_s, free_port
from loadtests.stats import summarize
from router.kv.prompt_blocks import RouteRequest, token_id_block_hashes
from router.picker.client import PickerClient


def start_picker() -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "router.picker", "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    line = proc.stdout.readline() if proc.stdout is not None else ""
    if not line.startswith("picker listening"):
        proc.kill()
        raise RuntimeError(f"the endpoint picker did not start: {line!r}")
    return proc, port


async def run(args: argparse.Namespace, port: int, pid: int) -> dict:
    client = PickerClient("127.0.0.1", port, deadline_s=5.0)
    endpoints = [f"sim-{i}" for i in range(args.endpoints)]
    client.put_pool("bench", "kv-aware", {e: None for e in endpoints})
    client.start()
    while not client.connected:
        await asyncio.sleep(0.01)
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(args.prompt_tokens)] for _ in range(16)]
    requests = [RouteRequest(block_hashes=tuple(token_id_block_hashes(p)), prompt_tokens=len(p), token_ids=p)
                for p in prompts]  # fmt: skip

    def never() -> int:
        raise RuntimeError("the picker did not answer within 5 s")

    async def one(i: int) -> float:
        start_s = time.perf_counter()
        _, ticket, _ = await client.pick("bench", endpoints, requests[i % len(requests)], never)
        rtt_s = time.perf_counter() - start_s
        if ticket is not None:
            ticket.finish()
        return rtt_s

    for i in range(50):   # warm-up: imports, first pool, allocator
        await one(i)
    rtts = [await one(i) for i in range(args.picks)]
    cpu0, started = cpu_s(pid), time.perf_counter()
    for start in range(0, args.picks, args.concurrency):
        await asyncio.gather(*(one(i) for i in range(start, min(args.picks, start + args.concurrency))))
    wall_s, cpu = time.perf_counter() - started, cpu_s(pid) - cpu0
    await client.close()
    return {"round_trip_ms": {k: 1e3 * v for k, v in summarize(rtts).items() if k in ("p50", "p90", "p99", "mean")},
            "pipelined_picks_per_s": args.picks / wall_s, "picker_cpu_ms_per_pick": 1e3 * cpu / args.picks,
            "pick_bytes": 48 + 8 * (len(requests[0].block_hashes) + args.prompt_tokens // 16)
            + sum(len(e) + 1 for e in endpoints)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--picks", type=int, default=2000)
    parser.add_argument("--endpoints", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=12000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    proc, port = start_picker()
    try:
        print(json.dumps(asyncio.run(run(args, port, proc.pid)), indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
