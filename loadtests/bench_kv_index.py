"""The endpoint picker's KV hot paths in one process, without sockets: decoding and applying KV
event batches, matching a prompt, and the index's memory over many distinct prompts.

What `loadtests/bench_kv_events.py` measures live (CPU per batch over ZMQ, wake-ups included),
this measures for the part that grows with blocks: `router.kv.events.decode_batch` and
`router.kv.exact_index.ExactIndex.apply` over pre-encoded payloads, batches of the same size as
that benchmark's publisher sends (each stream stores a new prompt of `--blocks` 16-token blocks
per batch and, once it holds `--engine-blocks` blocks, evicts as many of its oldest, a prompt's
last block first, with one `BlockRemoved` each, as vLLM reports evictions: `payloads`), round-robin over `--streams` endpoints. It reports CPU
microseconds per batch and per block, and so CPU milliseconds per second at `--rate` batches/s
(over all streams), for:

* ``--impl fleet`` (default): `ExactIndex` with the per-block loops selected at import
  (`router.kv.index_ops.SELECTED`: compiled where router/kv/_kvindex.c is built); ``--impl
  fleet-python`` forces the Python loops (`index_ops.PYTHON`);
* ``--impl dynamo``: `dynamo._core.RadixTree` of PyPI's `ai-dynamo-runtime` (compiled Rust, in its
  own venv: it is no dependency of Fleet's), fed the same decoded batches as Dynamo's own vLLM
  adapter feeds it: per `BlockStored`, each block's local hash (`compute_block_hash_for_seq` over
  its tokens) and its engine hash in one JSON `KvCacheEvent`; the engine hashes of consecutive
  `BlockRemoved` events in one removal (its best case: one call per run of removals).

``--query N`` also times N prompt matches of 64 prompts whose first half one stream holds:
`ExactIndex.match` over the prompt's token ids (Dynamo: `compute_block_hash_for_seq`, then
`RadixTree.find_matches`), or with ``--keys`` over the keys a router computed (`PromptKeys`, as the
picker receives them; Dynamo: the local hashes), their computation not timed.
``--profile`` prints the cProfile of the ingest (top functions by own time). ``--prompts N``
measures memory instead: N distinct prompts of `--prompt-blocks` blocks stored round-robin on the
8 endpoints, each endpoint evicting beyond `--engine-blocks`; RSS and the index's entries every N/10.

Usage:
    python -m loadtests.bench_kv_index --blocks 55 --rate 56 [--streams 8] [--batches 4000] [--impl fleet|fleet-python|dynamo]
    python -m loadtests.bench_kv_index --blocks 10 --rate 480 --query 2000 --profile
    python -m loadtests.bench_kv_index --prompts 1000000 [--impl fleet-python]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import random
import sys
import time

from router.kv.events import BlockRemoved, BlockStored, EventBatch, batch_of, decode_batch, encode_batch

BLOCK_TOKENS = 16


def payloads(batches: int, blocks: int, streams: int, engine_blocks: int, seed: int = 0) -> list[tuple[int, bytes]]:
    """(stream, payload) of `batches` batches round-robin over `streams`: each batch stores one new
    prompt of `blocks` blocks from the root and, once its stream holds more than `engine_blocks`,
    evicts whole older prompts, oldest first and each from its last block back (a leaf before its
    parent, as vLLM's free queue releases a finished request's blocks), one `BlockRemoved` each."""
    rng = random.Random(seed)
    held: list[collections.deque] = [collections.deque() for _ in range(streams)]
    sizes = [0] * streams
    out = []
    for n in range(batches):
        k = n % streams
        hashes = [rng.getrandbits(63) for _ in range(blocks)]
        tokens = [rng.randrange(32000) for _ in range(BLOCK_TOKENS * blocks)]
        events: list = [BlockStored(hashes, None, tokens, BLOCK_TOKENS, medium="GPU")]
        held[k].append(hashes)
        sizes[k] += blocks
        while sizes[k] > engine_blocks:
            oldest = held[k].popleft()
            sizes[k] -= len(oldest)
            events.extend(BlockRemoved([h], medium="GPU") for h in reversed(oldest))
        out.append((k, encode_batch(batch_of(events))))
    return out


class FleetIngest:
    """Decode and apply into an `ExactIndex`, every stream open (LIVE)."""

    def __init__(self, streams: int, loops: str | None) -> None:
        from router.kv import index_ops
        from router.kv.exact_index import ExactIndex
        if loops is not None:
            index_ops.SELECTED = index_ops.IMPLEMENTATIONS[loops]   # prompt_keys (--keys) chains with it too
        self.index = ExactIndex()
        self.loops = self.index.ops.name
        self.ids = [f"e{k}" for k in range(streams)]
        for e in self.ids:
            self.index.open(e)

    def apply(self, stream: int, payload: bytes) -> None:
        self.index.apply(self.ids[stream], decode_batch(payload))

    def prepare(self, token_ids: list[int], keys: bool) -> object:
        """What the picker is asked with: the prompt's keys (chained by the router) or its token ids."""
        if keys:
            from router.kv.prompt_keys import prompt_keys
            return prompt_keys(token_ids, BLOCK_TOKENS)
        return token_ids

    def query(self, prompt: object) -> dict:
        return self.index.match(prompt)


class DynamoIngest:
    """Decode (the same codec), then one JSON `KvCacheEvent` per event into Dynamo's `RadixTree`."""

    def __init__(self, streams: int) -> None:
        from dynamo._core import RadixTree, compute_block_hash_for_seq
        self.tree = RadixTree()
        self.local_hashes = compute_block_hash_for_seq
        self.event_id = 0
        self.failed = 0

    def apply(self, stream: int, payload: bytes) -> None:
        removed: list[int] = []   # consecutive removals go in one event: its best case
        for event in decode_batch(payload).events:
            if type(event) is BlockRemoved:
                removed.extend(event.block_hashes)
                continue
            if removed:
                self._send(stream, {"removed": {"block_hashes": removed}})
                removed = []
            if type(event) is BlockStored:
                local = self.local_hashes(event.token_ids, event.block_size)
                self._send(stream, {"stored": {"parent_hash": event.parent_block_hash,
                                               "blocks": [{"block_hash": h, "tokens_hash": t}
                                                          for h, t in zip(event.block_hashes, local)]}})  # fmt: skip
            else:
                self._send(stream, "cleared")
        if removed:
            self._send(stream, {"removed": {"block_hashes": removed}})

    def _send(self, stream: int, data: object) -> None:
        self.event_id += 1
        try:
            self.tree.apply_event(stream, json.dumps({"event_id": self.event_id, "data": data}).encode())
        except RuntimeError:   # a removal of a block it does not hold (it says so, and skips it)
            self.failed += 1

    def prepare(self, token_ids: list[int], keys: bool) -> list[int] | tuple[int, ...]:
        """The prompt's local block hashes (a list: the frontend computed them, `--keys`), or its
        token ids (a tuple: hashed in `query`)."""
        return self.local_hashes(token_ids, BLOCK_TOKENS) if keys else tuple(token_ids)

    def query(self, prompt: list[int] | tuple[int, ...]) -> dict:
        hashes = self.local_hashes(list(prompt), BLOCK_TOKENS) if type(prompt) is tuple else prompt
        return self.tree.find_matches(hashes).scores


def make(impl: str, streams: int):
    if impl == "dynamo":
        return DynamoIngest(streams)
    return FleetIngest(streams, "python" if impl == "fleet-python" else None)


def ingest(args: argparse.Namespace) -> None:
    work = payloads(args.batches, args.blocks, args.streams, args.engine_blocks)
    target = make(args.impl, args.streams)
    warm = len(work) // 4   # the first quarter fills the engines' caches: removals start
    for stream, payload in work[:warm]:
        target.apply(stream, payload)
    timed = work[warm:]
    profiler = cProfile.Profile() if args.profile else None
    cpu0 = time.process_time()
    if profiler is not None:
        profiler.enable()
    for stream, payload in timed:
        target.apply(stream, payload)
    if profiler is not None:
        profiler.disable()
    cpu_s = time.process_time() - cpu0
    per_batch_us = 1e6 * cpu_s / len(timed)
    print(f"{label(target, args)}: {len(timed)} batches of {args.blocks} stored + {args.blocks} evicted blocks on {args.streams} "
          f"stream(s): {per_batch_us:.1f} us CPU per batch, {per_batch_us / args.blocks:.2f} us per block stored "
          f"(and one evicted); at {args.rate:g} batches/s: {per_batch_us * args.rate / 1000:.2f} ms CPU per second"
          f"{' (under cProfile)' if profiler else ''}")  # fmt: skip
    if getattr(target, "failed", 0):
        print(f"{args.impl}: {target.failed} events refused (removal of a block it did not hold)")
    if profiler is not None:
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(14)
    if args.query:
        query(target, args)


def label(target, args: argparse.Namespace) -> str:
    """The implementation measured, as the figures name it."""
    return f"fleet ({target.loops} loops)" if isinstance(target, FleetIngest) else args.impl


def query(target, args: argparse.Namespace) -> None:
    """Match prompts of `--query-blocks` blocks: the first half a live chain's own tokens is not
    known here, so half of each prompt is stored first on one stream, then matched."""
    rng = random.Random(1)
    prompts = []
    for n in range(args.query):
        ids = [rng.randrange(32000) for _ in range(BLOCK_TOKENS * args.query_blocks)]
        prompts.append(ids)
    # store each prompt's first half on one stream (a chain from the root), as an engine would
    stored = []
    for n, ids in enumerate(prompts[:64]):
        half = ids[:BLOCK_TOKENS * (args.query_blocks // 2)]
        hashes = [rng.getrandbits(63) for _ in range(len(half) // BLOCK_TOKENS)]
        stored.append((n % args.streams, encode_batch(batch_of([BlockStored(hashes, None, half, BLOCK_TOKENS)]))))
    for stream, payload in stored:
        target.apply(stream, payload)
    asked = [target.prepare(ids, args.keys) for ids in prompts[:64]]   # the router's part, not timed
    cpu0 = time.process_time()
    hits = 0
    for n in range(args.query):
        hits += bool(target.query(asked[n % 64]))
    cpu_s = time.process_time() - cpu0
    print(f"{label(target, args)}: {args.query} matches of {args.query_blocks}-block prompts ({args.query_blocks // 2} held)"
          f"{' by keys (chained by the router, not timed)' if args.keys else ' by token ids'}: {1e6 * cpu_s / args.query:.1f} us CPU per match ({hits} hit)")
    if args.claims and isinstance(target, FleetIngest):
        claims(target, asked, args)


def claims(target: FleetIngest, asked: list, args: argparse.Namespace) -> None:
    """``--claims``: what a pick claims of its prompt at the endpoint holding its first half
    (`ExactIndex.expect`: the other half's keys claimed), each claim then withdrawn (a late pick
    moved elsewhere, `PickerState.placed`) so that the next one claims anew."""
    index = target.index
    claim_s = withdraw_s = 0.0
    for n in range(args.query):
        endpoint = target.ids[n % 64 % args.streams]
        cpu0 = time.process_time()
        keys = index.expect(endpoint, asked[n % 64], until_s=1e9, now_s=0.0)
        cpu1 = time.process_time()
        index.withdraw(endpoint, keys)
        claim_s += cpu1 - cpu0
        withdraw_s += time.process_time() - cpu1
    print(f"{label(target, args)}: {args.query} claims of {args.query_blocks}-block prompts at the endpoint holding "
          f"their first half: {1e6 * claim_s / args.query:.1f} us CPU per claim, "
          f"{1e6 * withdraw_s / args.query:.1f} us per withdrawal")


def memory(args: argparse.Namespace) -> None:
    """RSS and entries while `--prompts` distinct prompts are stored and evicted (8 endpoints)."""
    streams = 8
    target = make(args.impl, streams)
    rng = random.Random(2)
    held = [collections.deque() for _ in range(streams)]
    every = max(1, args.prompts // 10)
    print(f"| prompts | index entries | RSS MiB |\n|---|---|---|\n| 0 | 0 | {rss_mib():.1f} |")
    next_hash = 1
    for n in range(args.prompts):
        k = n % streams
        hashes = list(range(next_hash, next_hash + args.prompt_blocks))
        next_hash += args.prompt_blocks
        ids = [rng.randrange(32000) for _ in range(BLOCK_TOKENS * args.prompt_blocks)]
        events: list = [BlockStored(hashes, None, ids, BLOCK_TOKENS)]
        held[k].extend(hashes)
        if len(held[k]) > args.engine_blocks:
            evicted = [held[k].popleft() for _ in range(len(held[k]) - args.engine_blocks)]
            events.append(BlockRemoved(evicted))
        target.apply(k, encode_batch(EventBatch(0.0, events)))
        if (n + 1) % every == 0:
            entries = f"{len(target.index):,}" if isinstance(target, FleetIngest) else "n/a"
            print(f"| {n + 1:,} | {entries} | {rss_mib():.1f} |", flush=True)


def rss_mib() -> float:
    """This process's resident memory (VmRSS, /proc/self/status), MiB."""
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("fleet", "fleet-python", "dynamo"), default="fleet")
    parser.add_argument("--batches", type=int, default=4000)
    parser.add_argument("--blocks", type=int, default=55, help="blocks stored (and evicted) per batch")
    parser.add_argument("--rate", type=float, default=56.0, help="batches per second over all streams (for the ms/s figure)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--engine-blocks", type=int, default=4096, help="blocks an engine holds before it evicts")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--query", type=int, default=0, help="prompt matches to time after the ingest")
    parser.add_argument("--query-blocks", type=int, default=750, help="blocks per matched prompt (12k tokens)")
    parser.add_argument("--keys", action="store_true", help="match by PromptKeys (the picker's wire) instead of token ids")
    parser.add_argument("--claims", action="store_true",
                        help="after the matches, time the claims of the same prompts (fleet only)")
    parser.add_argument("--prompts", type=int, default=0, help="measure memory over this many distinct prompts instead")
    parser.add_argument("--prompt-blocks", type=int, default=8)
    args = parser.parse_args(argv)
    for name in ("batches", "blocks", "streams", "engine_blocks", "query_blocks", "prompt_blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    (memory if args.prompts else ingest)(args)


if __name__ == "__main__":
    main()
