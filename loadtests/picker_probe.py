"""Where late picks come from: the endpoint picker's and the routers' response times, sampled apart.

Owns `probe` and the command `python -m loadtests.picker_probe`, which `loadtests/bench_routing.py`
runs beside each ``+picker`` target (``--probe``) in a process of its own (so the replay's own
loop does not delay it). Every ``--interval-ms`` it times, on the same clock:

- a `PICK` of a pool the picker does not know (`router.picker.wire`; model `PROBE_MODEL`), which
  the picker declines at once without touching its state (`router.picker.state.PickerState.pick`):
  the round trip is the picker's event loop and the wire, without any router's loop;
- `GET /health` of each router, on a kept-alive connection: that router's event loop (and its HTTP
  parsing), without the picker.

A router's pick is late when its own loop, the wire or the picker's loop holds it past the
deadline; the two series say which one stalls, and how often, during the same run. On SIGTERM it
prints one JSON object: per series, the samples' count and their p50, p90, p99 and max in ms, and
the share over each of `OVER_MS`.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import socket
import sys
import time

from router.picker.wire import FrameReader, encode_pick

PROBE_MODEL = "picker-probe"
"""A model no pool is named: the picker answers its picks with no candidate (-1) and no state change."""
OVER_MS = (1.0, 5.0, 20.0)


def _percentiles(samples_ms: list[float]) -> dict:
    if not samples_ms:
        return {"n": 0}
    s = sorted(samples_ms)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))], 3)

    return {"n": len(s), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99), "max_ms": round(s[-1], 3),
            **{f"over_{o:g}_ms": round(sum(1 for x in s if x > o) / len(s), 4) for o in OVER_MS}}


def probe(picker: tuple[str, int], routers: list[tuple[str, int]], interval_s: float, stop: list[bool],
          samples: dict[str, list[float]] | None = None) -> dict:  # fmt: skip
    """Sample until `stop[0]` is set: {"picker": stats, "router HOST:PORT": stats, ...} (module
    docstring); each round trip in ms is appended to ``samples[name]`` as it is taken (a dict
    the caller may watch; None: a private one). Raises ConnectionError if the picker closes."""
    sock = socket.create_connection(picker)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    frames = FrameReader()
    conns = {f"router {h}:{p}": http.client.HTTPConnection(h, p, timeout=10) for h, p in routers}
    samples = {} if samples is None else samples
    samples.update({"picker": [], **{name: [] for name in conns}})
    ticket = 0
    while not stop[0]:
        started = time.perf_counter()
        ticket += 1
        sock.sendall(encode_pick(ticket, PROBE_MODEL, 0, None, ["probe"], (), (), 16))
        answered = False
        while not answered:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError("the endpoint picker closed the connection")
            answered = any(getattr(f, "ticket", None) == ticket for f in frames.feed(data))
        samples["picker"].append(1e3 * (time.perf_counter() - started))
        for name, conn in conns.items():
            t0 = time.perf_counter()
            conn.request("GET", "/health")
            conn.getresponse().read()
            samples[name].append(1e3 * (time.perf_counter() - t0))
        time.sleep(max(0.0, interval_s - (time.perf_counter() - started)))
    return {name: _percentiles(s) for name, s in samples.items()}


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.removeprefix("http://"), int(port)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--picker", required=True, help="HOST:PORT of the endpoint picker")
    parser.add_argument("--routers", default="", help="the routers' base URLs, comma-separated")
    parser.add_argument("--interval-ms", type=float, default=50.0)
    args = parser.parse_args()
    stop = [False]
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
    result = probe(_address(args.picker), [_address(u) for u in args.routers.split(",") if u],
                   args.interval_ms / 1000, stop)  # fmt: skip
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
