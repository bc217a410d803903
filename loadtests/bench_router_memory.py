"""Memory of Fleet's router over a long run: bounded, no per-request state retained.

Starts the fixed-response backend of `loadtests/bench_proxy_hop.py` (two loopback ports) and
Fleet's router (`python -m router`) in front of it, then drives closed-loop load for
`--seconds` while, every `--churn-every-s`, the pool is replaced with one endpoint renamed (as
a controller does when a replica is replaced), so per-endpoint state and metric series must be
dropped too. Every `--sample-every-s` it records the router's resident memory (VmRSS from
/proc) and the requests it has served (from `GET /admin/v1/pools`, summed over current and
retired endpoints). Prints the samples and the growth from the first sample after warm-up to
the last.

`--policy kv-aware --distinct-prompts` routes with the prefix-aware policy and gives every
request a prompt no other request shares (token ids, `--prompt-tokens` long), so the router's
prefix index sees new blocks on every request: its memory must stay flat all the same.

`--policy-stream N` measures the same state without HTTP, at a scale the live run cannot reach
on a small machine: N distinct prompts through `route_request` and a `kv-aware` pool of 8
endpoints in this process (the objects the router runs), reporting the index's entries and
the traced Python memory (tracemalloc) every N/10 prompts.

`--policy-stream N --kv-events` adds the engines' KV cache events: each of the 8 endpoints has
an engine-like prefix cache (`--engine-blocks` blocks of 16 tokens, LRU eviction; 27,000 is
the H100 8B-model profile of fleet/enginesim/profiles.py) that stores every prompt routed to it
and evicts the least recently used blocks beyond its size; each request's `BlockStored` and
`BlockRemoved` go through the wire codec (`router.kv.events.encode_batch` / `decode_batch`)
into the pool's `router.kv.exact_index.ExactIndex`, which `kv-aware` consults (every stream live).
`--kv-lose-removals` drops every `BlockRemoved` (a stream that loses them): the index is then
held by its own per-endpoint cap (`router.kv.exact_index.DEFAULT_MAX_BLOCKS_PER_ENDPOINT`).

Usage: python -m loadtests.bench_router_memory [--seconds 120] [--concurrency 32]
       python -m loadtests.bench_router_memory --policy kv-aware --distinct-prompts
       python -m loadtests.bench_router_memory --policy-stream 1000000
       python -m loadtests.bench_router_memory --policy-stream 1000000 --kv-events [--kv-lose-removals]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import urllib.request
from pathlib import Path

from loadtests.bench_proxy_hop import ADMIN_TOKEN, read_line, spawn

DISTINCT_LOADGEN = """
import asyncio, json, sys, time
import aiohttp
url, seconds, concurrency, n_tokens = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
async def main():
    sent = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def worker(i, deadline_s):
            nonlocal sent
            k = i
            while time.perf_counter() < deadline_s:
                base = 1_000_000 + k * n_tokens
                body = json.dumps({"model": "bench", "prompt": list(range(base, base + n_tokens)), "max_tokens": 8})
                async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
                    await resp.read()
                sent += 1
                k += concurrency
        print("MEASURING", flush=True)
        await asyncio.gather(*(worker(i, time.perf_counter() + seconds) for i in range(concurrency)))
    print(json.dumps({"requests": sent}), flush=True)
asyncio.run(main())
"""
"""A closed-loop load generator whose every request carries a prompt of distinct token ids."""


ENGINE_BLOCK_TOKENS = 16
"""Tokens per engine KV block in `--kv-events` (vLLM's default block size)."""


class EngineCache:
    """An engine's prefix cache as far as its KV events go: LRU blocks, chained hashes, events out.

    `run(ids)` caches a prompt's full blocks (those it holds become most recent, new ones are
    stored) and evicts the least recently used beyond `capacity_blocks`; it returns the batch of
    events that vLLM would publish for that step (`BlockStored` of the new blocks, then
    `BlockRemoved` of the evicted ones)."""

    def __init__(self, capacity_blocks: int, salt: int) -> None:
        from collections import OrderedDict

        self.capacity_blocks = capacity_blocks
        self.salt = salt
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def run(self, ids: list[int], ts: float):  # -> router.kv.events.EventBatch
        from router.kv.events import BlockRemoved, BlockStored, EventBatch

        size = ENGINE_BLOCK_TOKENS
        parent: int | None = None
        stored_parent: int | None = None
        first_new: int | None = None
        new: list[int] = []
        events: list = []
        for start in range(0, len(ids) - size + 1, size):
            h = hash((parent, self.salt, tuple(ids[start:start + size]))) & (2**64 - 1)
            if first_new is None:
                if h in self.blocks:   # a prefix hit
                    self.blocks.move_to_end(h)
                    parent = h
                    continue
                first_new, stored_parent = start, parent
            self.blocks[h] = None
            new.append(h)
            parent = h
        if first_new is not None:
            events.append(BlockStored(new, stored_parent, ids[first_new:first_new + len(new) * size], size,
                                      medium="GPU"))  # fmt: skip
        evicted = [self.blocks.popitem(last=False)[0] for _ in range(len(self.blocks) - self.capacity_blocks)]
        if evicted:
            events.append(BlockRemoved(evicted, medium="GPU"))
        return EventBatch(ts, events)


def policy_stream(n: int, prompt_tokens: int, trace_memory: bool, *, kv_events: bool = False,
                  engine_blocks: int = 27_000, lose_removals: bool = False) -> None:  # fmt: skip
    """`n` distinct prompts through `route_request` and a `kv-aware` pool of 8 endpoints, in
    process; prints the index's size, the process RSS and (with `trace_memory`, which slows
    every allocation) Python's traced memory every n/10 prompts. `kv_events`: the endpoints'
    engines publish KV events into the pool's exact index (module docstring)."""
    import tracemalloc

    from router.kv.events import EventBatch, decode_batch, encode_batch
    from router.kv.exact_index import ExactIndex
    from router.stats.metrics import RouterMetrics
    from router.pools.pool import Pool, PoolTable
    from router.kv.prompt_blocks import route_request
    from router.pools.spec import PoolSpec

    table = PoolTable(RouterMetrics(), wall_clock=time.time, clock=time.perf_counter)
    pool = table.put("bench", PoolSpec.model_validate(
        {"policy": "kv-aware", "endpoints": [{"id": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}"} for i in range(8)]}))
    index = pool.policy.index  # type: ignore[attr-defined]
    exact = ExactIndex()
    engines: dict[str, EngineCache] = {}
    seqs: dict[str, int] = {}
    if kv_events:
        pool = Pool(pool.model, pool.policy, pool.endpoints, pool.created_s, pool.shared, kv_view=exact)
        for i, endpoint in enumerate(pool.endpoints):
            exact.open(endpoint.id)
            engines[endpoint.id] = EngineCache(engine_blocks, salt=i)
            seqs[endpoint.id] = 0
    if trace_memory:
        tracemalloc.start()
    events_note = (f", KV events from 8 engine caches of {engine_blocks:,} blocks of {ENGINE_BLOCK_TOKENS} tokens"
                   f"{' (removals lost)' if lose_removals else ''} into the exact index (cap "
                   f"{exact.max_blocks_per_endpoint:,} blocks per endpoint)") if kv_events else ""  # fmt: skip
    print(f"\n{n:,} distinct prompts of {prompt_tokens} token ids through kv-aware (8 endpoints, "
          f"{index.capacity_blocks:,} blocks remembered per endpoint{events_note})\n")
    print("| prompts routed | index entries | distinct blocks | exact index entries | events applied "
          "| traced memory MiB | router RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    started = time.process_time()
    applied = 0
    engine_cpu_s = 0.0   # the engine caches' own work (not the router's)
    events_cpu_s = 0.0   # the router's: decode and apply the events
    for i in range(1, n + 1):
        base = 1_000_000 + i * prompt_tokens
        request = route_request({"prompt": list(range(base, base + prompt_tokens)), "max_tokens": 8})
        endpoint = pool.pick(request, 0.0)
        assert endpoint is not None
        endpoint.start(request.prefill_tokens)
        endpoint.finish(request.prefill_tokens, got_first_byte=False)
        if kv_events:
            t0 = time.process_time()
            batch = engines[endpoint.id].run(request.token_ids, float(i))  # type: ignore[arg-type]
            if lose_removals:
                batch = EventBatch(batch.ts, [e for e in batch.events if type(e).__name__ != "BlockRemoved"])
            payload = encode_batch(batch)
            t1 = time.process_time()
            applied += exact.apply(endpoint.id, decode_batch(payload), seqs[endpoint.id])
            seqs[endpoint.id] += 1
            t2 = time.process_time()
            engine_cpu_s += t1 - t0
            events_cpu_s += t2 - t1
        if i % max(1, n // 10) == 0:
            traced = f"{tracemalloc.get_traced_memory()[0] / 2**20:.1f}" if trace_memory else "—"
            print(f"| {i:,} | {len(index):,} | {index.distinct_blocks():,} | {len(exact):,} | {applied:,} | {traced} "
                  f"| {rss_mib(os.getpid()):.1f} |", flush=True)
    cpu_s = time.process_time() - started - engine_cpu_s - events_cpu_s
    print(f"\nCPU per prompt (body to RouteRequest, scoring with the exact match, recording; tracemalloc "
          f"{'on' if trace_memory else 'off'}; the JSON parse is not included): {1e6 * cpu_s / n:.0f} us")
    if kv_events:
        print(f"Router CPU per prompt for its events (decode and apply one batch, {applied / n:.1f} events): "
              f"{1e6 * events_cpu_s / n:.0f} us; the engine caches' own work (not the router's): "
              f"{1e6 * engine_cpu_s / n:.0f} us")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def admin(base: str, method: str, path: str, doc: dict | None = None) -> dict:
    data = json.dumps(doc).encode() if doc is not None else None
    request = urllib.request.Request(f"{base}{path}", data=data, method=method, headers={
        "Authorization": f"Bearer {ADMIN_TOKEN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.loads(resp.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="load duration (default 120)")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop workers (default 32)")
    parser.add_argument("--sample-every-s", type=float, default=10.0, help="seconds between samples (default 10)")
    parser.add_argument("--churn-every-s", type=float, default=5.0, help="seconds between endpoint renames (default 5)")
    parser.add_argument("--policy", default=None, help="routing policy of the pool (default: the router's default)")
    parser.add_argument("--distinct-prompts", action="store_true", help="every request carries its own prompt")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="token ids per distinct prompt (default 1024)")
    parser.add_argument("--policy-stream", type=int, metavar="N", help="N distinct prompts in process, no HTTP")
    parser.add_argument("--trace-memory", action="store_true", help="with --policy-stream: also tracemalloc")
    parser.add_argument("--kv-events", action="store_true",
                        help="with --policy-stream: engine caches publish KV events into the exact index")
    parser.add_argument("--engine-blocks", type=int, default=27_000,
                        help="with --kv-events: blocks of 16 tokens per engine cache (default 27,000)")
    parser.add_argument("--kv-lose-removals", action="store_true",
                        help="with --kv-events: drop every BlockRemoved (the index's own cap must hold it)")
    args = parser.parse_args()
    if args.policy_stream:
        policy_stream(args.policy_stream, args.prompt_tokens, args.trace_memory, kv_events=args.kv_events,
                      engine_blocks=args.engine_blocks, lose_removals=args.kv_lose_removals)  # fmt: skip
        return

    backend = spawn(__file__.replace("bench_router_memory", "bench_proxy_hop"), "--role", "backend")
    router = None
    loadgen = None
    try:
        ports = [int(p) for p in read_line(backend, "PORTS").split()[1:]]
        router = spawn("-m", "router", "--host", "127.0.0.1", "--port", "0", env={"FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
        base = read_line(router, "listening on").rsplit(" ", 1)[1]
        generation = 0

        def pool_doc() -> dict:
            return {**({"policy": args.policy} if args.policy else {}), "endpoints": [{"id": "stable", "url": f"http://127.0.0.1:{ports[0]}"},
                                  {"id": f"replica-{generation}", "url": f"http://127.0.0.1:{ports[1]}"}]}

        admin(base, "PUT", "/admin/v1/pools/bench", pool_doc())
        if args.distinct_prompts:
            loadgen = spawn("-c", DISTINCT_LOADGEN, f"{base}/v1/completions", str(args.seconds),
                            str(args.concurrency), str(args.prompt_tokens))
        else:
            loadgen = spawn(__file__.replace("bench_router_memory", "bench_proxy_hop"), "--role", "loadgen",
                            "--url", f"{base}/v1/completions", "--seconds", str(args.seconds),
                            "--concurrency", str(args.concurrency), "--stream-chunks", "0")
        read_line(loadgen, "MEASURING")
        retired = 0
        last_seen: dict[str, int] = {}
        samples: list[tuple[float, int, float]] = []
        start = time.monotonic()
        next_sample = start
        next_churn = start + args.churn_every_s
        while loadgen.poll() is None and time.monotonic() - start < args.seconds + 5:
            now = time.monotonic()
            pools = admin(base, "GET", "/admin/v1/pools")["pools"]
            for e in pools["bench"]["endpoints"]:
                last_seen[e["id"]] = e["requests_total"]
            if now >= next_churn:
                gone = f"replica-{generation}"
                retired += last_seen.pop(gone, 0)
                generation += 1
                admin(base, "PUT", "/admin/v1/pools/bench", pool_doc())
                next_churn += args.churn_every_s
            if now >= next_sample:
                samples.append((now - start, retired + sum(last_seen.values()), rss_mib(router.pid)))
                next_sample += args.sample_every_s
            time.sleep(0.2)
        result = json.loads(read_line(loadgen, "{"))
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    finally:
        for proc in (loadgen, router, backend):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)

    series = sum(1 for line in metrics.splitlines() if line.startswith("fleet_router_requests_total{"))
    kind = f"distinct {args.prompt_tokens}-token prompts" if args.distinct_prompts else "one fixed prompt"
    print(f"\npolicy {args.policy or 'default'}, {kind}: {args.seconds:g} s of closed-loop load, concurrency {args.concurrency}, "
          f"{result['requests']:,} requests, pool endpoint renamed every {args.churn_every_s:g} s ({generation} times)\n")
    print("| elapsed s | requests served | router RSS MiB |")
    print("|---|---|---|")
    for t, n, rss in samples:
        print(f"| {t:.0f} | {n:,} | {rss:.1f} |")
    if len(samples) >= 3:
        t1, n1, r1 = samples[1]
        t2, n2, r2 = samples[-1]
        print(f"\nRSS change from {n1:,} to {n2:,} requests: {r2 - r1:+.1f} MiB "
              f"({1024 * 1024 * (r2 - r1) / max(1, n2 - n1):+.2f} bytes per request)")
    print(f"fleet_router_requests_total series at the end: {series} "
          f"(endpoints ever in the pool: {generation + 2}, in it now: 2)")


if __name__ == "__main__":
    main()
