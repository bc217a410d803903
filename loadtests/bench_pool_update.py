"""How long the router takes to create, replace and delete a large pool, and whether it keeps serving.

Starts Fleet's router (`python -m router`, port 0) in a child process, then for each size in
`--sizes` sends, through the admin API:

1. `PUT /admin/v1/pools/bench` with N endpoints (`e0` .. `eN-1`; the URLs are never contacted),
2. `PUT` again with every endpoint renamed (`r0` .. `rN-1`): a full replacement, so every
   endpoint of the old pool leaves it and its metric series must go,
3. `GET /metrics` (a scrape: one `fleet_router_requests_in_flight` series per endpoint) and
   `GET /admin/v1/pools` (the listing a controller polls),
4. `DELETE /admin/v1/pools/bench`.

It prints the wall time of each call (client side: request sent until answer read), and, from a
thread that sends `GET /health` every 10 ms during the calls, the slowest `/health` answer seen
while the admin calls ran: how long the pool update kept the router from serving. An admin call
that takes longer than `--timeout-s` is reported as such and the run stops (the router is
killed).

Replacing or deleting a pool costs time linear in its endpoints (a leaving endpoint's metric
series are removed by key, never by scanning every series); docs/benchmarks.md ("The router under
hostile input and large pools") has today's figures.

Usage: python -m loadtests.bench_pool_update [--sizes 1000,10000] [--timeout-s 120]
"""

from __future__ import annotations

import argparse
import http.client
import json
import threading
import time
from urllib.parse import urlsplit

from loadtests.bench_proxy_hop import ADMIN_TOKEN, read_line, spawn


class HealthProbe(threading.Thread):
    """GET /health every `every_s` on its own connection; keeps (sent_s, latency_s) samples."""

    def __init__(self, host: str, port: int, every_s: float = 0.01) -> None:
        super().__init__(daemon=True)
        self.host, self.port, self.every_s = host, port, every_s
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=300)
        while not self.stop.is_set():
            sent_s = time.perf_counter()
            try:
                conn.request("GET", "/health")
                conn.getresponse().read()
            except OSError:  # the router was stopped (end of run, or an admin call timed out)
                return
            self.samples.append((sent_s, time.perf_counter() - sent_s))
            time.sleep(self.every_s)
        conn.close()

    def worst_between(self, start_s: float, end_s: float) -> float:
        """Slowest /health answer among probes sent in [start_s, end_s] (seconds)."""
        return max((lat for sent, lat in self.samples if start_s <= sent <= end_s), default=0.0)


def admin_call(host: str, port: int, method: str, path: str, body: bytes | None, timeout_s: float) -> float:
    """Send one admin request on a fresh connection; return its wall time (s). Raises on non-200.
    The body is encoded beforehand, so that the probe thread of this process is not kept from
    the GIL while the call is timed."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    start_s = time.perf_counter()
    conn.request(method, path, body=body, headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                                   "Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    data = resp.read()
    elapsed_s = time.perf_counter() - start_s
    conn.close()
    if resp.status != 200:
        raise RuntimeError(f"{method} {path}: HTTP {resp.status}: {data[:300]!r}")
    return elapsed_s


def pool_doc(n: int, prefix: str) -> dict:
    return {"endpoints": [{"id": f"{prefix}{i}", "url": f"http://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:8000"}
                          for i in range(n)]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="comma-separated pool sizes (default 1000,10000)")
    parser.add_argument("--timeout-s", type=float, default=120.0, help="give up on one admin call after this")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    router = spawn("-m", "router", "--host", "127.0.0.1", "--port", "0", env={"FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
    try:
        base = read_line(router, "listening on").rsplit(" ", 1)[1]
        parts = urlsplit(base)
        host, port = parts.hostname or "127.0.0.1", parts.port or 80
        probe = HealthProbe(host, port)
        probe.start()
        print(f"{'endpoints':>9}  {'step':<8} {'admin call':>11} {'slowest /health meanwhile':>26}")
        for n in sizes:
            bodies = [json.dumps(pool_doc(n, prefix)).encode() for prefix in ("e", "r")]
            for step, method, path, body in (
                ("create", "PUT", "/admin/v1/pools/bench", bodies[0]),
                ("replace", "PUT", "/admin/v1/pools/bench", bodies[1]),
                ("scrape", "GET", "/metrics", None),
                ("list", "GET", "/admin/v1/pools", None),
                ("delete", "DELETE", "/admin/v1/pools/bench", None),
            ):
                start_s = time.perf_counter()
                try:
                    elapsed_s = admin_call(host, port, method, path, body, args.timeout_s)
                except TimeoutError:
                    print(f"{n:>9}  {step:<8} {'> %.0f s' % args.timeout_s:>11}  (no answer; stopping)")
                    return
                time.sleep(0.05)  # let a probe sent during the call come back
                worst_s = probe.worst_between(start_s, start_s + elapsed_s)
                print(f"{n:>9}  {step:<8} {elapsed_s * 1000:>8.1f} ms {worst_s * 1000:>23.1f} ms", flush=True)
        probe.stop.set()
    finally:
        router.kill()
        router.wait()


if __name__ == "__main__":
    main()
