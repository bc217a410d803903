"""Router CPU per KV event batch: one `router.kv_subscriber.KvEventSubscriber` following a publisher
in another process, as a router follows an engine.

The publisher (a subprocess, so that its CPU is not counted) sends `--batches` batches at
`--rate` per second on vLLM's wire (`router.kv_events.encode_batch`, PUB frames topic/seq/payload):
each batch stores `--blocks` 16-token blocks continuing the previous batch's chain and, from the
11th batch on, evicts as many blocks with one `BlockRemoved` each, as vLLM reports evictions.
This process runs the subscriber on an asyncio loop and reports its own CPU time (all threads:
the event loop and libzmq's I/O thread) per batch and per block, between the first batch applied
and the last. What it isolates is the per-message cost (wake-ups, socket reads) against the
per-block cost (decode, index); docs/benchmarks.md, "Router CPU with KV events".

Usage:
    python -m loadtests.bench_kv_events [--batches 3000] [--blocks 1] [--rate 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time

import zmq
import zmq.asyncio

from router.kv_index import ExactIndex
from router.kv_subscriber import KvEventSubscriber
from router.spec import KvEventsSource

PUBLISHER = r'''
import random, sys, time
import zmq
from router.kv_events import BlockRemoved, BlockStored, batch_of, encode_batch
batches, blocks, rate = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
port = pub.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
sys.stdin.readline()   # the subscriber is connected
rng = random.Random(0)
parent = None
started = time.monotonic()
for seq in range(batches):
    hashes = [rng.getrandbits(63) for _ in range(blocks)]
    events = [BlockStored(hashes, parent, [rng.randrange(32000) for _ in range(16 * blocks)], 16, medium="GPU")]
    if seq > 10:
        events += [BlockRemoved([rng.getrandbits(63)], medium="GPU") for _ in range(blocks)]
    parent = hashes[-1]
    pub.send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(batch_of(events))])
    pause = started + (seq + 1) / rate - time.monotonic()
    if pause > 0:
        time.sleep(pause)
time.sleep(1.0)
'''


async def run(batches: int, blocks: int, rate: float) -> dict[str, float]:
    """Follow `batches` batches of `blocks` blocks at `rate`/s; CPU seconds of this process per batch."""
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, str(batches), str(blocks), str(rate)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    ctx = zmq.asyncio.Context()
    index = ExactIndex()
    try:
        port = int(proc.stdout.readline())
        source = KvEventsSource(publisher=f"tcp://127.0.0.1:{port}", topic="")
        task = asyncio.create_task(KvEventSubscriber("m", "e", source, index, ctx).run())
        await asyncio.sleep(1.0)   # connected and subscribed: a SUB misses what is sent before
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while index.last_seq("e") is None:
            await asyncio.sleep(0.001)
        cpu0, first = time.process_time(), index.last_seq("e")
        deadline = time.monotonic() + 60 + batches / rate
        while (index.last_seq("e") or 0) < batches - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        cpu_s = time.process_time() - cpu0
        done = (index.last_seq("e") or 0) - first
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)
    return {"batches": done, "cpu_us_per_batch": 1e6 * cpu_s / max(1, done),
            "cpu_us_per_block": 1e6 * cpu_s / max(1, done * blocks)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=1, help="blocks stored (and evicted) per batch")
    parser.add_argument("--rate", type=float, default=1000.0, help="batches per second")
    args = parser.parse_args()
    out = asyncio.run(run(args.batches, args.blocks, args.rate))
    print(f"{out['batches']:.0f} batches of {args.blocks} block(s) at {args.rate:g}/s: "
          f"{out['cpu_us_per_batch']:.1f} us CPU per batch, {out['cpu_us_per_block']:.1f} us per block")


if __name__ == "__main__":
    main()
