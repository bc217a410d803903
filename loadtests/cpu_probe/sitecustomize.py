"""Where a router's CPU goes with KV events: a probe for the `python -m router` processes that a
benchmark starts with this directory on ``PYTHONPATH`` (Python imports `sitecustomize` at start-up).

In a process whose command line runs ``router`` (any other process is left alone), it wraps these
with a counter of calls and of the calling thread's CPU time (`time.thread_time`), two seconds
after start-up (the modules are imported by then):

- ``tick``: `router.signals.drain_ticks.DrainTicks._tick`, the shared drain tick (includes what follows);
- ``read_in_order``: `KvEventSubscriber._read_in_order`, the socket reads of a drain (includes
  ``apply``);
- ``apply``: `KvEventSubscriber._apply`, one batch (includes ``decode`` and ``index_apply``);
- ``decode``: `router.kv.events.decode_batch` as the subscriber calls it (with its payload bytes);
- ``index_apply``: `router.kv.exact_index.ExactIndex.apply`;
- ``match``: `ExactIndex.match`; ``parse_request``: `router.request.asgi_io.parse_request` as the parse step
  (`router.request.parse`) calls it (the request body's JSON);
- ``gc<N>``: the cyclic garbage collector's collections of generation N (`gc.callbacks`: the
  collecting thread's CPU from start to stop), wherever they ran (inside the wrapped calls too).

Every 5 s it writes the totals, with the process's CPU time (`time.process_time`: all threads,
libzmq's I/O thread included) and each thread's (``thread <name> cpu_s``, from
``/proc/self/task/*/stat``: the loop's thread is ``python``, libzmq's I/O thread ``ZMQbg/IO/0``), to
``$FLEET_CPU_PROBE_DIR/router-<pid>.txt`` (default ``/tmp``).

With ``FLEET_CPU_PROBE_SKIP_DECODE=1`` the subscriber's `decode_batch` returns an empty batch
without decoding (its payload's bytes still counted): the router receives every batch, checks its
sequence and keeps its CRC-32 as always, but decodes and applies nothing. What such a router
spends over one without events is what receiving the engines' streams costs, before any block
is looked at (its routing then sees empty views: a measurement, never a way to run).
The wrappers cost ~1 us per call, counted inside the wrapped figures. Not for production: a
measuring aid for docs/benchmarks.md, "Router CPU with KV events".

Usage:
    PYTHONPATH=loadtests/cpu_probe .venv/bin/python -m loadtests.bench_routing --trace mooncake \\
        --load 0.8 --ttft-slo-s 2 --window-s 150 --start-s 600 --targets fleet:kv-aware@2+kv-events
    cat /tmp/router-*.txt
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

CPU_S: collections.Counter[str] = collections.Counter()
CALLS: collections.Counter[str] = collections.Counter()
PAYLOAD_BYTES = [0]


def _timed(label: str, fn: Callable) -> Callable:
    def timed(*args, **kwargs):
        start = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            CPU_S[label] += time.thread_time() - start
            CALLS[label] += 1
    return timed


_GC_START = [0.0]


def _gc_timed(phase: str, info: dict) -> None:
    if phase == "start":
        _GC_START[0] = time.thread_time()
    else:
        label = f"gc{info['generation']}"
        CPU_S[label] += time.thread_time() - _GC_START[0]
        CALLS[label] += 1


def _patch() -> None:
    time.sleep(2.0)
    import gc

    gc.callbacks.append(_gc_timed)
    import router.kv.exact_index as kv_index
    import router.signals.drain_ticks as drain_ticks
    import router.signals.kv_subscriber as kv_subscriber
    import router.request.parse as parse

    sub = kv_subscriber.KvEventSubscriber
    drain_ticks.DrainTicks._tick = _timed("tick", drain_ticks.DrainTicks._tick)
    sub._read_in_order = _timed("read_in_order", sub._read_in_order)
    sub._apply = _timed("apply", sub._apply)
    kv_index.ExactIndex.apply = _timed("index_apply", kv_index.ExactIndex.apply)
    kv_index.ExactIndex.match = _timed("match", kv_index.ExactIndex.match)
    parse.parse_request = _timed("parse_request", parse.parse_request)
    if os.environ.get("FLEET_CPU_PROBE_SKIP_DECODE") == "1":
        from router.kv.events import EventBatch

        decode = lambda payload: EventBatch(0.0, [], None)  # noqa: E731  (receipt only: nothing decoded)
    else:
        decode = _timed("decode", kv_subscriber.decode_batch)

    def decode_counted(payload: bytes):
        PAYLOAD_BYTES[0] += len(payload)
        return decode(payload)

    kv_subscriber.decode_batch = decode_counted


def _threads_cpu_s() -> collections.Counter[str]:
    """CPU seconds (user + system) of this process's threads, summed by thread name."""
    ticks = os.sysconf("SC_CLK_TCK")
    out: collections.Counter[str] = collections.Counter()
    for task in Path("/proc/self/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue   # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[name] += (int(fields[11]) + int(fields[12])) / ticks   # utime, stime (proc(5) fields 14, 15)
    return out


def _write_every(period_s: float, out: Path) -> None:
    while True:
        time.sleep(period_s)
        lines = [f"process_cpu_s {time.process_time():.3f}", f"payload_bytes {PAYLOAD_BYTES[0]}"]
        lines += [f"thread {name} cpu_s {cpu_s:.3f}" for name, cpu_s in sorted(_threads_cpu_s().items())]
        lines += [f"{label} cpu_s {CPU_S[label]:.3f} calls {CALLS[label]}" for label in sorted(CALLS)]
        out.write_text("\n".join(lines) + "\n")


if "router" in sys.orig_argv:
    _out = Path(os.environ.get("FLEET_CPU_PROBE_DIR", "/tmp")) / f"router-{os.getpid()}.txt"
    threading.Thread(target=_patch, daemon=True, name="cpu-probe-patch").start()
    threading.Thread(target=_write_every, args=(5.0, _out), daemon=True, name="cpu-probe-out").start()
