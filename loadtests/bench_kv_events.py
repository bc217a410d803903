"""Router CPU per KV event batch: one `router.signals.kv_subscriber.KvEventSubscriber` following a publisher
in another process, as a router follows an engine.

The publisher (a subprocess, so that its CPU is not counted) sends `--batches` batches on vLLM's
wire (`router.kv.events.encode_batch`, PUB frames topic/seq/payload), spread round-robin over
`--streams` PUB sockets (one per simulated engine), `--rate` per second on each: each batch stores
`--blocks` 16-token blocks continuing its stream's chain and, once a stream holds 4,096 blocks,
evicts its oldest as many with one `BlockRemoved` each, as vLLM reports evictions (so removals
find their block, as they do live). This process runs one subscriber per stream on an asyncio
loop, sharing one `DrainTicks` as a router's do, and reports its own CPU time (all threads: the
event loop and libzmq's I/O thread) per batch and per block, between the first batch applied and
the last. What it isolates is the per-message cost (wake-ups, socket reads) against the
per-block cost (decode, index); docs/benchmarks.md, "Router CPU with KV events".

``--one-socket`` measures a receive path the router does not have, to size it before building it
(docs/routing.md, "What it does not do"): each stream publishes under its endpoint's topic, and one SUB
socket connected to every publisher is drained on a `DRAIN_INTERVAL_S` loop timer, each message
sequence-checked, its CRC-32 kept, decoded and applied by topic: no monitor sockets, no task per
stream, no replay (a gap raises).

``--idle-s S`` measures the other end: the subscribers connected to publishers that send nothing
for S seconds (CPU milliseconds per second of this process: wake-ups, heartbeats, libzmq's I/O
thread), what quiet engines cost the endpoint picker.

Usage:
    python -m loadtests.bench_kv_events [--batches 3000] [--blocks 1] [--rate 1000] [--streams 1] [--one-socket] \\
        [--drain-interval-ms 20]
    python -m loadtests.bench_kv_events --idle-s 20 --streams 8
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
import zlib
from collections.abc import Callable

import zmq
import zmq.asyncio

from router.kv.events import decode_batch
from router.kv.exact_index import ExactIndex, StreamState
from router.signals.drain_ticks import DRAIN_INTERVAL_S, DrainTicks
from router.signals.kv_subscriber import RCVHWM, KvEventSubscriber
from router.pools.spec import KvEventsSource

PUBLISHER = r'''
import collections, random, sys, time
import zmq
from router.kv.events import BlockRemoved, BlockStored, batch_of, encode_batch
batches, blocks, rate, streams = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
hold_s = float(sys.argv[5]) if len(sys.argv) > 5 else 1.0   # connected, silent, after the last batch
ctx = zmq.Context()
pubs = [ctx.socket(zmq.PUB) for _ in range(streams)]
print(" ".join(str(pub.bind_to_random_port("tcp://127.0.0.1")) for pub in pubs), flush=True)
sys.stdin.readline()   # the subscribers are connected
rng = random.Random(0)
parents = [None] * streams
held = [collections.deque() for _ in range(streams)]
started = time.monotonic()
for n in range(batches):
    k, seq = n % streams, n // streams
    hashes = [rng.getrandbits(63) for _ in range(blocks)]
    events = [BlockStored(hashes, parents[k], [rng.randrange(32000) for _ in range(16 * blocks)], 16, medium="GPU")]
    held[k].extend(hashes)
    while len(held[k]) > 4096:
        events.append(BlockRemoved([held[k].popleft()], medium="GPU"))
    parents[k] = hashes[-1]
    pubs[k].send_multipart([b"", seq.to_bytes(8, "big"), encode_batch(batch_of(events))])
    pause = started + (seq + 1) / rate - time.monotonic()
    if pause > 0:
        time.sleep(pause)
time.sleep(hold_s)
'''


PUBLISHER_TOPICS = PUBLISHER.replace('pubs[k].send_multipart([b""', 'pubs[k].send_multipart([f"e{k}".encode()')
"""The publisher, each stream under its endpoint's topic (``e0``, ``e1``, ...): `--one-socket`."""


def _one_socket(ctx: zmq.asyncio.Context, index: ExactIndex, ports: list[int],
                errors: list[Exception]) -> Callable[[], None]:  # fmt: skip
    """Start draining one SUB socket connected to every port on a loop timer; returns its stop. A
    gap stops the draining and is put in `errors` (the run then fails)."""
    owner = ctx.socket(zmq.SUB)   # kept open until the stop: the shadow below does not own it
    sub = zmq.Socket.shadow(owner.underlying)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, RCVHWM)
    for port in ports:
        sub.connect(f"tcp://127.0.0.1:{port}")
    last: dict[bytes, int] = {}
    crc: dict[bytes, int] = {}
    events, pollin = int(zmq.EVENTS), int(zmq.POLLIN)
    loop = asyncio.get_running_loop()
    timer: list[asyncio.TimerHandle] = []

    def tick() -> None:
        while sub.getsockopt(events) & pollin:
            topic, seq_frame, payload = sub.recv_multipart(zmq.NOBLOCK)
            seq = int.from_bytes(seq_frame, "big")
            if topic in last and seq != last[topic] + 1:
                errors.append(RuntimeError(f"gap on {topic!r}: {last[topic]} then {seq}"))
                return
            last[topic] = seq
            crc[topic] = zlib.crc32(payload)
            index.apply(topic.decode(), decode_batch(payload), seq)
        timer[:] = [loop.call_later(DRAIN_INTERVAL_S, tick)]

    def stop() -> None:
        timer[0].cancel()
        owner.close(linger=0)

    timer.append(loop.call_later(DRAIN_INTERVAL_S, tick))
    return stop


async def run(batches: int, blocks: int, rate: float, streams: int = 1, *, one_socket: bool = False,
              drain_interval_s: float = DRAIN_INTERVAL_S) -> dict[str, float]:
    """Follow `batches` batches of `blocks` blocks at `rate`/s on each of `streams` streams (with
    `one_socket`, the design probe of the module docstring), the subscribers draining every
    `drain_interval_s` (a router's `DRAIN_INTERVAL_S`; the endpoint picker's is
    `router.picker.service.DRAIN_INTERVAL_S`); CPU seconds of this process per batch."""
    publisher = PUBLISHER_TOPICS if one_socket else PUBLISHER
    proc = subprocess.Popen([sys.executable, "-c", publisher, str(batches), str(blocks), str(rate), str(streams)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    ctx = zmq.asyncio.Context()
    index = ExactIndex()
    ticks = DrainTicks(drain_interval_s)
    ids = [f"e{k}" for k in range(streams)]
    last = (batches - 1) // streams   # the first stream's last seq

    def applied() -> int:
        return sum((index.last_seq(e) or 0) for e in ids)

    tasks: list[asyncio.Task[None]] = []
    stop: Callable[[], None] | None = None
    errors: list[Exception] = []
    try:
        ports = [int(p) for p in proc.stdout.readline().split()]
        if one_socket:
            for e in ids:
                index.open(e)
            stop = _one_socket(ctx, index, ports, errors)
        else:
            tasks = [asyncio.create_task(KvEventSubscriber("m", e, KvEventsSource(publisher=f"tcp://127.0.0.1:{port}",
                                                                                  topic=""), index, ctx, ticks=ticks).run())
                     for e, port in zip(ids, ports)]  # fmt: skip
        await asyncio.sleep(1.0)   # connected and subscribed: a SUB misses what is sent before
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while index.last_seq(ids[0]) is None:
            await asyncio.sleep(0.001)
        cpu0, main0, first = time.process_time(), time.thread_time(), applied()
        deadline = time.monotonic() + 60 + batches / rate
        while (index.last_seq(ids[0]) or 0) < last and time.monotonic() < deadline and not errors:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)   # the other streams' last batches
        cpu_s, main_s = time.process_time() - cpu0, time.thread_time() - main0
        done = applied() - first
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if errors:
            raise errors[0]
    finally:
        if stop is not None:
            stop()
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)
    return {"batches": done, "cpu_us_per_batch": 1e6 * cpu_s / max(1, done),
            "loop_us_per_batch": 1e6 * main_s / max(1, done),
            "cpu_us_per_block": 1e6 * cpu_s / max(1, done * blocks)}  # fmt: skip


async def idle(streams: int, idle_s: float) -> tuple[float, int]:
    """CPU milliseconds per second of this process while `streams` subscribers follow publishers
    (in another process) that stay connected and silent for `idle_s` seconds, and how many of the
    streams were connected at the end (LIVE, or REBUILDING: a publisher without a replay socket
    leaves the view partial until the subscriber's rebuild time)."""
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, "0", "1", "1", str(streams), str(idle_s + 5)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    ctx = zmq.asyncio.Context()
    index = ExactIndex()
    ticks = DrainTicks()
    tasks: list[asyncio.Task[None]] = []

    def connected() -> int:
        return sum(index.state(f"e{k}") in (StreamState.LIVE, StreamState.REBUILDING) for k in range(streams))

    try:
        ports = [int(p) for p in proc.stdout.readline().split()]
        tasks = [asyncio.create_task(KvEventSubscriber("m", f"e{k}", KvEventsSource(publisher=f"tcp://127.0.0.1:{port}",
                                                                                    topic=""), index, ctx, ticks=ticks).run())
                 for k, port in enumerate(ports)]  # fmt: skip
        proc.stdin.write("go\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 10
        while connected() < streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)   # past the quiet ticks: each subscriber sleeps on its socket
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(idle_s)
        ms_per_s = 1e3 * (time.process_time() - cpu0) / (time.monotonic() - wall0)
        return ms_per_s, connected()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--blocks", type=int, default=1, help="blocks stored (and evicted) per batch")
    parser.add_argument("--rate", type=float, default=1000.0, help="batches per second on each stream (the publisher paces each stream's seq)")
    parser.add_argument("--streams", type=int, default=1, help="publishers (engines), each followed by a subscriber")
    parser.add_argument("--one-socket", action="store_true",
                        help="a design probe: one SUB socket for all streams, the endpoint in the topic (module docstring)")
    parser.add_argument("--drain-interval-ms", type=float, default=DRAIN_INTERVAL_S * 1e3,
                        help=f"the subscribers' shared drain tick (default {DRAIN_INTERVAL_S * 1e3:g}, a router's; "
                             "the endpoint picker drains every 50)")
    parser.add_argument("--idle-s", type=float, default=0.0,
                        help="measure idle CPU instead: subscribers on silent publishers for this many seconds")
    args = parser.parse_args()
    if args.idle_s > 0:
        ms_per_s, live = asyncio.run(idle(args.streams, args.idle_s))
        print(f"{args.streams} quiet stream(s) ({live} connected) for {args.idle_s:g} s: {ms_per_s:.2f} ms CPU per second")
        return
    out = asyncio.run(run(args.batches, args.blocks, args.rate, args.streams, one_socket=args.one_socket,
                          drain_interval_s=args.drain_interval_ms / 1e3))
    print(f"{'one socket: ' if args.one_socket else ''}{out['batches']:.0f} batches of {args.blocks} block(s) at {args.rate:g}/s on each of {args.streams} stream(s): "
          f"{out['cpu_us_per_batch']:.1f} us CPU per batch ({out['loop_us_per_batch']:.1f} us on the event loop's "
          f"thread, the rest libzmq's I/O thread), {out['cpu_us_per_block']:.1f} us per block")


if __name__ == "__main__":
    main()
