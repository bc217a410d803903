"""What the peer channel costs an idle router: two Fleet routers in front of one `kv-aware` pool of
simulated engines, no traffic, first without peers and then each the other's peer (`--peers`),
each router's process CPU (all threads, `/proc/PID/stat`) over `--seconds` after `--settle-s`.

What it isolates is the channel's standing cost (heartbeats, timers), not the cost per request:
docs/benchmarks.md, "Router CPU: the peers' datagrams".

Usage:
    python -m loadtests.bench_peer_idle [--replicas 8] [--settle-s 10] [--seconds 30]
"""

from __future__ import annotations

import argparse
import time

from loadtests.bench_routing import start_router
from loadtests.procs import SimFleet, cpu_s, free_port


def idle_cpu_ms_per_s(urls: list[str], peers: bool, settle_s: float, seconds: float) -> list[float]:
    """Two routers over `urls` (each the other's peer if `peers`): each one's CPU in ms per second."""
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for i, port in enumerate(ports):
            proc, _ = start_router("fleet", "kv-aware", urls, port=port, peers=[bases[1 - i]] if peers else [])
            procs.append(proc)
        time.sleep(settle_s)
        before = [cpu_s(p.pid) for p in procs]
        time.sleep(seconds)
        return [1e3 * (cpu_s(p.pid) - b) / seconds for p, b in zip(procs, before)]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=8, help="simulated engines in the pool (default 8)")
    parser.add_argument("--settle-s", type=float, default=10.0, help="seconds before measuring (default 10)")
    parser.add_argument("--seconds", type=float, default=30.0, help="seconds measured (default 30)")
    args = parser.parse_args()
    with SimFleet(args.replicas, profile="h100-llama-8b", model="bench", processes=2, seed=0) as sims:
        for peers in (False, True):
            cpu = idle_cpu_ms_per_s(sims.urls, peers, args.settle_s, args.seconds)
            print(f"{'each the other' + chr(39) + 's peer' if peers else 'no peers'}: "
                  f"{', '.join(f'{c:.1f}' for c in cpu)} ms of CPU per second per router", flush=True)


if __name__ == "__main__":
    main()
