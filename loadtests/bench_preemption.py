"""Preemption benchmark: wall time of one `PreemptionPolicy.decide` call (fleet/placement/preemption.py)
on full clusters.

Synthetic clusters of 100, 1,000 and 10,000 nodes of 8 H100 80GB on NVSwitch, every GPU held by a
TP=1 replica of one low-priority deployment (80,000 victim candidates at 10,000 nodes, the worst
case: the candidate list is as long as it gets); a priority-100 deployment with no replica asks
for one replica of TP=1, TP=8, and four replicas of TP=2. Median of repeated calls, with the
victims each decision picks. Self-contained; prints the table docs/placement.md records.

Usage (hold the lock: timing-sensitive on a shared machine):
    flock /tmp/fleet-heavy.lock .venv/bin/python loadtests/bench_preemption.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections import Counter

from fleet.inventory import Gpu, Inventory, NodeInventory
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from fleet.placement.preemption import Holder, PreemptionPolicy, Standing
from fleet.placement.shapes import Assignment, ReplicaPlacement

H100 = "NVIDIA H100 80GB HBM3"
READY = 6   # `ReplicaStatus.READY`'s index: every candidate serves


def full_cluster(nodes: int) -> tuple[Inventory, list[Holder]]:
    inventory = Inventory(tuple(
        NodeInventory(f"n{k}", gpus=tuple(Gpu(i, f"n{k}-GPU-{i}", H100, 81559) for i in range(8)), cpu_cores=(0,),
                      nvlink_domains=(tuple(range(8)),)) for k in range(nodes)))  # fmt: skip
    holders = [Holder(f"batch-{k * 8 + i}", "batch", ReplicaPlacement((Assignment(f"n{k}", (f"n{k}-GPU-{i}",)),), H100),
                      READY, k * 8 + i) for k in range(nodes) for i in range(8)]  # fmt: skip
    return inventory, holders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--nodes", default="100,1000,10000")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print("| nodes | candidates | request | median ms | victims |")
    print("|---:|---:|---|---:|---:|")
    policy = PreemptionPolicy(get_strategy())
    for nodes in (int(n) for n in args.nodes.split(",")):
        inventory, holders = full_cluster(nodes)
        in_use = Counter(d for h in holders for d in h.placement.devices)
        standings = {"chat": Standing("chat", 100, False, 4, 0), "batch": Standing("batch", 0, False, 0, len(holders))}
        for tp, count in ((1, 1), (8, 1), (2, 4)):
            request = PlacementRequest(ReplicaShape(gpu_product=H100, tensor_parallel_size=tp), count, "chat")
            times, victims = [], 0
            for _ in range(args.repeat):
                start = time.perf_counter()
                decision = policy.decide(request, standings["chat"], inventory, in_use, holders, standings)
                times.append(time.perf_counter() - start)
                victims = len(decision.victims)
            print(f"| {nodes:,} | {len(holders):,} | {count} x TP={tp} | {statistics.median(times) * 1000:.1f} | "
                  f"{victims} |")


if __name__ == "__main__":
    main()
