"""Placement benchmarks: latency at scale, and placement quality against first-fit and an exact solver.

Self-contained; prints the figures that docs/placement.md records. Three parts:

1. Latency. Synthetic clusters of 1,000 and 10,000 nodes (8 GPUs each; H100 80GB on NVSwitch,
   A100 80GB on NVSwitch or in two NVLink islands of four, L40S on PCIe; a tenth of the H100/A100
   nodes with half their GPUs in MIG mode; 0.5% of GPUs unhealthy; zones, racks, network blocks),
   half of the devices already in use (nodes 0-100% used). Wall time of one `place_replicas` call placing one
   replica, and a batch of 1,000 replicas, for TP=2 H100, a 1g.10gb MIG slice and a TP=16 gang
   (one gang only: gangs are rare and scanned per gang). Median of repeated calls on the same
   inventory object, with the in-use map passed as a `DeviceUse` (what the controller passes:
   the kept index reads only what changed) and as a plain Counter (compared whole per call);
   and the first call on a fresh inventory object (tables and index built).
2. Quality at scale (1,000 nodes): one long random sequence of scale-ups and scale-downs of 15
   deployments (three each of TP 8, 4, 2 on H100 and TP 4, 2 on A100 80GB; each target a
   random walk over 0..cap, caps set so the mean demand is 95% or 110% of the GPUs) is replayed
   with each strategy, and with fleet on the same nodes stripped of zone/rack labels (the cost
   of spreading). Each event moves one deployment's target; the placer then tries to reach it
   (after a scale-down every deployment below its target asks again, longest waiting first, as
   the controller's next tick places every pending replica; scale-downs drain the replicas the
   strategy's `drain_order` names: the newest for first-fit, those freeing NVLink domains whole
   for fleet). Fleet's requests name the TP widths of the product's other deployments
   (`PlacementRequest.fill_shapes`, as the controller fills it: leftover-aware best fit);
   "fleet, other shapes unknown" leaves them out. Reported: replicas missing (target minus
   running, summed over events, over the sum of targets), the same for TP=8, placement requests rejected, NVLink domains with 8 free
   GPUs (room for TP=8; mean over samples every 10 events), and GPUs stranded: free healthy
   whole GPUs of a requested product in an NVLink domain whose free GPUs fit none of that
   product's requested shapes (mean over the same samples). MIG and TP=1 deployments are left
   out: every placement of them is as good as another.
3. Quality against an exact solver (20 and 50 nodes): the same kind of sequence; at a checkpoint
   every 20 events, OR-Tools CP-SAT computes the most replicas of the current targets that any
   placement could host on the cluster (an offline optimum: it may move running replicas, which
   online placers never do), then the fewest GPUs it leaves stranded; compared with the replicas
   each online strategy is missing at that moment.

Usage (hold the lock: it is CPU-heavy and timing-sensitive on a shared machine):
    flock /tmp/fleet-heavy.lock .venv/bin/python loadtests/bench_placement.py [--quick] [--seed 0]
The CP-SAT part needs `pip install 'inference-fleet[bench]'` (ortools) and is skipped, saying
so, without it.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet.inventory.model import Gpu, GpuHealth, Inventory, MigInstance, NodeInventory  # noqa: E402
from fleet.placement import DeviceUse, PlacementRequest, ReplicaPlacement, ReplicaShape, get_strategy  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"
L40S = "NVIDIA L40S"
MIG_GEOMETRIES = [   # valid on H100 80GB and A100 80GB (fleet.inventory.mig)
    [("3g.40gb", 0), ("3g.40gb", 4)],
    [("1g.10gb", s) for s in range(7)],
    [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)],
    [("4g.40gb", 0), ("3g.40gb", 4)],
]


def synthetic_cluster(n_nodes: int, seed: int = 0) -> Inventory:
    """``n_nodes`` 8-GPU nodes: 50% H100 (NVSwitch), 30% A100 80GB (60% NVSwitch, 40% two
    NVLink islands of four), 20% L40S (PCIe). 10% of H100/A100 nodes have GPUs 0-3 in MIG mode.
    Racks of 16 nodes, network blocks of 32, 4 zones; 0.5% of GPUs with uncorrected ECC errors."""
    rng = random.Random(seed)
    nodes = []
    for i in range(n_nodes):
        name = f"n{i:05d}"
        roll = rng.random()
        product, memory = (H100, 81559) if roll < 0.5 else (A100, 81920) if roll < 0.8 else (L40S, 46068)
        if product == L40S:
            domains: tuple = ()
        elif product == A100 and rng.random() < 0.4:
            domains = ((0, 1, 2, 3), (4, 5, 6, 7))
        else:
            domains = (tuple(range(8)),)
        mig = product != L40S and rng.random() < 0.1
        gpus = []
        for g in range(8):
            uuid = f"GPU-{name}-{g}"
            instances: tuple = ()
            if mig and g < 4:
                geometry = rng.choice(MIG_GEOMETRIES)
                instances = tuple(MigInstance(f"MIG-{name}-{g}-{j}", p, uuid, s) for j, (p, s) in enumerate(geometry))
            health = GpuHealth(ecc_uncorrected=1) if rng.random() < 0.005 else GpuHealth()
            gpus.append(Gpu(g, uuid, product, memory, mig_enabled=bool(instances), mig_instances=instances, health=health))
        if mig:   # MIG GPUs leave the NVLink domain to the whole GPUs
            domains = tuple(tuple(x for x in d if x >= 4) for d in domains if any(x >= 4 for x in d))
        rack = i // 16
        nodes.append(NodeInventory(
            name, tuple(gpus), nvlink_domains=domains, zone=f"z{rack % 4}", rack=f"r{rack}",
            network_block=f"b{i // 32}",
        ))
    return Inventory(tuple(nodes))


def random_load(inv: Inventory, seed: int = 1) -> Counter[str]:
    """Devices already in use: each node is 0, 25, 50, 75 or 100% used (uniformly), its
    devices picked at random; half of all devices on average, some nodes empty."""
    rng = random.Random(seed)
    held: Counter[str] = Counter()
    for n in inv.nodes:
        level = rng.choice([0.0, 0.25, 0.5, 0.75, 1.0])
        for g in n.gpus:
            for device in ([m.uuid for m in g.mig_instances] if g.mig_enabled else [g.uuid]):
                if rng.random() < level:
                    held[device] += 1
    return held


# ----- 1. latency ---------------------------------------------------------------------------------

def timed(fn, repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def latency(sizes: list[int], repeats_one: int, repeats_batch: int) -> None:
    print("\n## 1. Latency of one place_replicas call (median wall time)\n")
    print("| nodes | GPUs | request | fleet, in-use map a DeviceUse | fleet, a plain Counter | first-fit | "
          "placed (fleet) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    cases = [
        ("1 replica, TP=2 H100", ReplicaShape(gpu_product=H100, tensor_parallel_size=2), 1, repeats_one),
        ("1,000 replicas, TP=2 H100", ReplicaShape(gpu_product=H100, tensor_parallel_size=2), 1000, repeats_batch),
        ("1 replica, MIG 1g.10gb", ReplicaShape(gpu_product=H100, mig_profile="1g.10gb"), 1, repeats_one),
        ("1,000 replicas, MIG 1g.10gb", ReplicaShape(gpu_product=H100, mig_profile="1g.10gb"), 1000, repeats_batch),
        ("1 gang, TP=16 H100 (2 nodes)", ReplicaShape(gpu_product=H100, tensor_parallel_size=16), 1, repeats_batch),
        ("1 replica, TP=2, product chosen", ReplicaShape(tensor_parallel_size=2), 1, repeats_one),
    ]
    for n in sizes:
        inv = synthetic_cluster(n)
        held = random_load(inv)
        use = DeviceUse(held)
        get_strategy("fleet").place_replicas(PlacementRequest(cases[0][1]), inv, use)   # the first call builds tables
        for label, shape, count, repeats in cases:
            row = []
            placed = 0
            for name, in_use in (("fleet", use), ("fleet", held), ("first-fit", held)):
                strategy = get_strategy(name)
                request = PlacementRequest(shape, count=count, deployment="bench",   # what the controller fills
                                           fill_shapes=(2, 4, 8) if shape.mig_profile is None else ())
                seconds, plan = timed(lambda: strategy.place_replicas(request, inv, in_use), repeats)
                row.append(seconds)
                if name == "fleet":
                    placed = len(plan.placements)
            print(f"| {n:,} | {inv.gpu_count():,} | {label} | {fmt_s(row[0])} | {fmt_s(row[1])} | {fmt_s(row[2])} "
                  f"| {placed:,} |")
            sys.stdout.flush()
        first = synthetic_cluster(n)     # a fresh inventory object: tables and index built on this call
        t0 = time.perf_counter()
        get_strategy("fleet").place_replicas(PlacementRequest(cases[0][1]), first, DeviceUse(held))
        print(f"| {n:,} | {first.gpu_count():,} | first call on a new Inventory object, 1 replica TP=2 H100 | "
              f"{fmt_s(time.perf_counter() - t0)} | | | |")


def fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


# ----- 2. and 3. quality --------------------------------------------------------------------------

@dataclass(frozen=True)
class Deployment:
    name: str
    shape: ReplicaShape
    cap: int            # most replicas its target may reach


KINDS = [(H100, 8), (H100, 4), (H100, 2), (A100, 4), (A100, 2)]


def workload(inv: Inventory, load: float) -> list[Deployment]:
    """15 deployments: three each of TP 8, 4, 2 on H100 and TP 4, 2 on A100 80GB. Targets move
    uniformly over 0..cap, so the mean demand is ``load`` times the product's healthy whole GPUs
    (split evenly over its deployments)."""
    gpus = Counter(g.product for n in inv.nodes for g in n.gpus if not g.mig_enabled and g.health.healthy)
    deps = []
    for product, tp in KINDS:
        kinds = sum(1 for p, _ in KINDS if p == product)
        for j in range(3):
            cap = max(1, round(2 * load * gpus[product] / kinds / 3 / tp))
            name = f"{product.split()[1].lower()}-tp{tp}-{j}"
            deps.append(Deployment(name, ReplicaShape(gpu_product=product, tensor_parallel_size=tp), cap))
    return deps


def target_sequence(deps: list[Deployment], events: int, seed: int) -> list[tuple[int, int]]:
    """(deployment index, new target) per event: a bounded random walk per deployment."""
    rng = random.Random(seed)
    targets = [0] * len(deps)
    out = []
    for _ in range(events):
        i = rng.randrange(len(deps))
        step = max(1, deps[i].cap // 6)
        delta = rng.choice([-1, 1]) * rng.randint(1, step)
        targets[i] = max(0, min(deps[i].cap, targets[i] + delta))
        out.append((i, targets[i]))
    return out


@dataclass
class Run:
    strategy: str
    asked: int = 0                 # replica placements asked (a missing replica is asked again at its next event)
    rejected: int = 0
    wanted: Counter = field(default_factory=Counter)     # tp -> sum over events of target replicas
    missing: Counter = field(default_factory=Counter)    # tp -> sum over events of replicas missing
    stranded: list[int] = field(default_factory=list)
    free_domains_8: list[int] = field(default_factory=list)
    missing_at: dict[int, int] = field(default_factory=dict)      # checkpoint event -> replicas missing
    seconds: float = 0.0

    def unmet(self, tp: int | None = None) -> str:
        keys = [tp] if tp else list(self.wanted)
        return pct(sum(self.missing[k] for k in keys), sum(self.wanted[k] for k in keys))


def replay(inv: Inventory, deps: list[Deployment], sequence: list[tuple[int, int]], strategy_name: str,
           sample_every: int = 10, checkpoints: set[int] | None = None, drain: bool = True,
           retry: bool = True, fill: bool = True) -> Run:
    """Replay ``sequence`` with one strategy. ``drain``: scale-downs drain the replicas the
    strategy's `drain_order` names (else the newest). ``retry``: after a scale-down, every
    deployment below its target asks again, longest waiting first, as the controller's next tick
    places every PENDING replica (else a missing replica is asked again at its own next event).
    ``fill``: each request names the TP widths of the product's other deployments
    (`PlacementRequest.fill_shapes`, as the controller fills it)."""
    strategy = get_strategy(strategy_name)
    live: list[list[ReplicaPlacement]] = [[] for _ in deps]
    targets = [0] * len(deps)
    held: Counter[str] = DeviceUse()
    run = Run(strategy_name)
    min_tp = _min_tp(deps)
    short_since: dict[int, int] = {}          # deployment -> step its shortfall began
    fill_shapes = [tuple(sorted({o.shape.tensor_parallel_size for o in deps
                                 if o is not d and o.shape.gpu_product == d.shape.gpu_product})) if fill else ()
                   for d in deps]

    def scale_up(i: int, step: int, counted: bool) -> None:
        dep, have = deps[i], live[i]
        want = targets[i] - len(have)
        if want <= 0:
            short_since.pop(i, None)
            return
        t0 = time.perf_counter()
        plan = strategy.place_replicas(PlacementRequest(dep.shape, count=want, deployment=dep.name,
                                                        existing=tuple(have), fill_shapes=fill_shapes[i]),
                                       inv, held)
        run.seconds += time.perf_counter() - t0
        for p in plan.placements:
            held.update(p.devices)
        have.extend(plan.placements)
        if counted:
            run.asked += want
            run.rejected += want - len(plan.placements)
        if len(have) < targets[i]:
            short_since.setdefault(i, step)
        else:
            short_since.pop(i, None)

    for step, (i, target) in enumerate(sequence, 1):
        targets[i] = target
        have = live[i]
        if target > len(have):
            scale_up(i, step, counted=True)
        elif len(have) > target:
            short_since.pop(i, None)
            gone = set(strategy.drain_order(have, len(have) - target, inv, held)) if drain else set(
                range(target, len(have)))                             # newest first
            for j in gone:
                for d in have[j].devices:
                    held[d] -= 1
                    if held[d] <= 0:
                        del held[d]
            have[:] = [p for j, p in enumerate(have) if j not in gone]
            if retry:
                for k in sorted(short_since, key=short_since.get):
                    scale_up(k, step, counted=False)
        for d, t, lv in zip(deps, targets, live):
            run.wanted[d.shape.tensor_parallel_size] += t
            run.missing[d.shape.tensor_parallel_size] += max(0, t - len(lv))
        if step % sample_every == 0:
            run.stranded.append(stranded(inv, held, min_tp))
            run.free_domains_8.append(free_domains(inv, held, 8))
        if checkpoints and step in checkpoints:
            run.missing_at[step] = sum(max(0, t - len(lv)) for t, lv in zip(targets, live))
    return run


def free_domains(inv: Inventory, held: Counter[str], size: int) -> int:
    """NVLink domains with at least ``size`` free healthy whole GPUs: room for the largest shape."""
    return sum(1 for n in inv.nodes for dom in n.domains
               if sum(1 for g in dom if not g.mig_enabled and g.health.healthy and not held[g.uuid]) >= size)


def _min_tp(deps: list[Deployment]) -> dict[str, int]:
    out: dict[str, int] = {}
    for d in deps:
        if d.shape.mig_profile is None:
            out[d.shape.gpu_product] = min(out.get(d.shape.gpu_product, 99), d.shape.tensor_parallel_size)
    return out


def stranded(inv: Inventory, held: Counter[str], min_tp: dict[str, int]) -> int:
    """Free healthy whole GPUs of a requested product whose NVLink domain's free GPUs fit no
    requested shape of that product."""
    count = 0
    for n in inv.nodes:
        for dom in n.domains:
            free = [g for g in dom if not g.mig_enabled and g.health.healthy and not held[g.uuid]]
            if free and free[0].product in min_tp and len(free) < min_tp[free[0].product]:
                count += len(free)
    return count


def quality_at_scale(nodes: int, events: int, loads: list[float], seed: int) -> None:
    inv = synthetic_cluster(nodes, seed)
    print(f"\n## 2. Quality at scale: {nodes:,} nodes ({inv.gpu_count():,} GPUs), 15 deployments, "
          f"{events:,} scale events\n")
    print("| mean demand | strategy | replicas missing (time avg) | TP=8 missing | placements rejected | "
          "free 8-GPU domains (mean) | stranded GPUs (mean) | placer time |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    # The same nodes without zone and rack labels: what spreading over failure domains costs.
    unlabelled = Inventory(tuple(dataclasses.replace(n, zone=None, rack=None) for n in inv.nodes))
    for load in loads:
        deps = workload(inv, load)
        sequence = target_sequence(deps, events, seed + 1)
        for name, cluster, drain, fill in (("fleet", inv, True, True), ("fleet, other shapes unknown", inv, True, False),
                                           ("fleet, newest drained", inv, False, True), ("first-fit", inv, True, False),
                                           ("fleet, no zone/rack labels", unlabelled, True, True)):
            r = replay(cluster, deps, sequence, name.split(",")[0], drain=drain, fill=fill)
            print(f"| {load:.0%} | {name} | {r.unmet()} | {r.unmet(8)} | {r.rejected:,} of {r.asked:,} "
                  f"({pct(r.rejected, r.asked)}) | {statistics.mean(r.free_domains_8):.1f} | "
                  f"{statistics.mean(r.stranded):.1f} | {r.seconds:.1f} s |")
            sys.stdout.flush()


def pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def cpsat_optimum(inv: Inventory, deps: list[Deployment], targets: list[int], time_limit_s: float) -> tuple[int, int, str]:
    """(most replicas of ``targets`` any placement hosts on the empty cluster, GPUs that
    solution leaves stranded, solver status). Whole-GPU replicas take TP GPUs of one NVLink
    domain; MIG replicas one instance of the profile."""
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    min_tp = _min_tp(deps)
    per_dep: list[list] = [[] for _ in deps]
    strand_terms = []
    stranded_const = 0
    for n in inv.nodes:
        for dom in n.domains:
            healthy = [g for g in dom if not g.mig_enabled and g.health.healthy]
            if not healthy:
                continue
            product = healthy[0].product
            used = []
            for i, d in enumerate(deps):
                t = d.shape.tensor_parallel_size
                if d.shape.mig_profile is None and d.shape.gpu_product == product and t <= len(healthy) and targets[i]:
                    x = model.NewIntVar(0, len(healthy) // t, f"x{i}_{n.name}_{dom[0].index}")
                    per_dep[i].append(x)
                    used.append(t * x)
            if not used:
                stranded_const += len(healthy) if len(healthy) < min_tp.get(product, 0) else 0
                continue
            model.Add(sum(used) <= len(healthy))
            if product in min_tp:
                free = model.NewIntVar(0, len(healthy), "")
                model.Add(free == len(healthy) - sum(used))
                ok = model.NewBoolVar("")
                model.Add(free >= min_tp[product]).OnlyEnforceIf(ok)
                s = model.NewIntVar(0, len(healthy), "")
                model.Add(s >= free - len(healthy) * ok)
                strand_terms.append(s)
        for g in n.gpus:
            if not (g.mig_enabled and g.health.healthy):
                continue
            for profile, k in Counter(m.profile for m in g.mig_instances).items():
                ys = []
                for i, d in enumerate(deps):
                    if d.shape.mig_profile == profile and d.shape.gpu_product == g.product and targets[i]:
                        ys.append(model.NewIntVar(0, k, ""))
                        per_dep[i].append(ys[-1])
                if len(ys) > 1:
                    model.Add(sum(ys) <= k)
    placed = []
    for i, xs in enumerate(per_dep):
        if xs:
            model.Add(sum(xs) <= targets[i])
            placed.extend(xs)
    model.Maximize(10_000 * sum(placed) - sum(strand_terms))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = 2
    status = solver.Solve(model)
    total = int(sum(solver.Value(x) for x in placed))
    return total, stranded_const + int(sum(solver.Value(s) for s in strand_terms)), solver.StatusName(status)


def quality_vs_exact(sizes: list[int], events: int, every: int, loads: list[float], seed: int, time_limit_s: float) -> None:
    try:
        import ortools  # noqa: F401
    except ImportError:
        print("\n## 3. Quality against CP-SAT: skipped (ortools not installed: pip install 'inference-fleet[bench]')")
        return
    print(f"\n## 3. Quality against an exact solver (CP-SAT offline optimum), {events} events, checkpoint every {every}\n")
    print("| nodes | GPUs | mean demand | checkpoints | replicas wanted (sum) | missing: fleet | missing: fleet, other "
          "shapes unknown | missing: fleet, newest drained | missing: first-fit | missing: CP-SAT optimum | proven optimal | "
          "stranded: fleet / fleet, other shapes unknown / first-fit / optimum (sum) | solver time |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, load in [(n, load) for n in sizes for load in loads]:
        inv = synthetic_cluster(n, seed)
        deps = workload(inv, load)
        sequence = target_sequence(deps, events, seed + 1)
        points = set(range(every, events + 1, every))
        runs = {name: replay(inv, deps, sequence, name, sample_every=every, checkpoints=points)
                for name in ("fleet", "first-fit")}
        newest = replay(inv, deps, sequence, "fleet", sample_every=every, checkpoints=points, drain=False)
        unknown = replay(inv, deps, sequence, "fleet", sample_every=every, checkpoints=points, fill=False)
        targets = [0] * len(deps)
        wanted = missing_opt = strand_opt = optimal = 0
        t0 = time.perf_counter()
        for step, (i, target) in enumerate(sequence, 1):
            targets[i] = target
            if step in points:
                best, strand, status = cpsat_optimum(inv, deps, targets, time_limit_s)
                wanted += sum(targets)
                missing_opt += sum(targets) - best
                strand_opt += strand
                optimal += status == "OPTIMAL"
        f, ff = runs["fleet"], runs["first-fit"]
        print(f"| {n} | {inv.gpu_count()} | {load:.0%} | {len(points)} | {wanted:,} | {sum(f.missing_at.values()):,} | "
              f"{sum(unknown.missing_at.values()):,} | {sum(newest.missing_at.values()):,} | "
              f"{sum(ff.missing_at.values()):,} | {missing_opt:,} | {optimal}/{len(points)} | "
              f"{sum(f.stranded)} / {sum(unknown.stranded)} / {sum(ff.stranded)} / {strand_opt} | "
              f"{time.perf_counter() - t0:.1f} s |")
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Smaller runs (a smoke test, not the figures).")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parts", default="1,2,3", help="Which parts to run, e.g. 1,3.")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    print(f"# bench_placement: Python {platform.python_version()} on {platform.machine()}, "
          f"{len(__import__('os').sched_getaffinity(0))} CPU(s); seed {args.seed}"
          + (" (--quick)" if args.quick else ""))
    started = time.perf_counter()
    if "1" in parts:
        latency([200, 1000] if args.quick else [1000, 10_000], repeats_one=3 if args.quick else 9,
                repeats_batch=1 if args.quick else 3)
    if "2" in parts:
        quality_at_scale(200 if args.quick else 1000, 300 if args.quick else 2000, [0.95, 1.1], args.seed)
    if "3" in parts:
        quality_vs_exact([20] if args.quick else [20, 50], 100 if args.quick else 600, 25 if args.quick else 20,
                         [0.95, 1.1], args.seed, time_limit_s=5.0 if args.quick else 10.0)
    print(f"\n(total {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
