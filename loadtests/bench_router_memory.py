"""Memory of Fleet's router over a long run: bounded, no per-request state retained.

Starts the fixed-response backend of `loadtests/bench_proxy_hop.py` (two loopback ports) and
Fleet's router (`python -m router`) in front of it, then drives closed-loop load for
`--seconds` while, every `--churn-every-s`, the pool is replaced with one endpoint renamed (as
a controller does when a replica is replaced), so per-endpoint state and metric series must be
dropped too. Every `--sample-every-s` it records the router's resident memory (VmRSS from
/proc) and the requests it has served (from `GET /admin/v1/pools`, summed over current and
retired endpoints). Prints the samples and the growth from the first sample after warm-up to
the last.

Usage: python -m loadtests.bench_router_memory [--seconds 120] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path

from loadtests.bench_proxy_hop import ADMIN_TOKEN, read_line, spawn


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
    args = parser.parse_args()

    backend = spawn(__file__.replace("bench_router_memory", "bench_proxy_hop"), "--role", "backend")
    router = None
    loadgen = None
    try:
        ports = [int(p) for p in read_line(backend, "PORTS").split()[1:]]
        router = spawn("-m", "router", "--host", "127.0.0.1", "--port", "0", env={"FLEET_ROUTER_ADMIN_TOKEN": ADMIN_TOKEN})
        base = read_line(router, "listening on").rsplit(" ", 1)[1]
        generation = 0

        def pool_doc() -> dict:
            return {"endpoints": [{"id": "stable", "url": f"http://127.0.0.1:{ports[0]}"},
                                  {"id": f"replica-{generation}", "url": f"http://127.0.0.1:{ports[1]}"}]}

        admin(base, "PUT", "/admin/v1/pools/bench", pool_doc())
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
    print(f"\n{args.seconds:g} s of closed-loop load, concurrency {args.concurrency}, "
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
