"""How close to the hindsight-optimal schedule can any online policy come? Bounds from an ORACLE
that knows the trace's true future arrivals at a resolution a forecaster could have.

`fleet.tracesim.hindsight` solves the cheapest schedule that keeps the SLO knowing every
arrival (replica counts per TTFT-SLO interval, 2 s). A policy learns the future only through a
forecast, at best of the arrival rate per bucket of some seconds. This benchmark measures, in
the same model (one replica's capacity at the SLO, each start paying the warm start-up, each
stop a drain), what knowing more or less buys, per bucket of ``--resolution-s`` seconds:

- ``optimum at r``: the hindsight optimum whose count changes only every r seconds
  (`fleet.tracesim.hindsight.solve` with ``block``): a fleet acting at that resolution with
  every arrival known. Still clairvoyant within a bucket (it knows how many fall in each 2 s).
- ``rate oracle at r``: a policy told each bucket's true arrival count ahead and nothing finer;
  it holds ``ceil(headroom x count / (capacity x r))`` replicas through the bucket (at least
  ``spec.replicas.min``), started and stopped as cheaply as those counts allow (`rate_oracle`).
  With headroom 1 it holds the bucket's mean rate (the share within the SLO says what a burst
  inside the bucket costs); the headroom it needs to keep ``--within-slo`` is found by bisection
  (the oracle is told that too).

Run::

    python -m loadtests.oracle_bound loadtests/traces/azure-llm-2023/code.csv -d examples/simulate-h100.yaml

``--replay`` also runs the rate oracle's schedule through the trace simulator as its scaling
policy (as `loadtests.hindsight_replay` replays the optimum), bisecting the headroom the
simulator needs: its queues serve within the SLO requests the model counts missed, so the
model's headroom is an upper bound (each step one simulation: seconds for an Azure hour,
minutes for a day). MODELLED / SIMULATED: the engines are `fleet.enginesim` latency models, not vLLM.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.spec import load_deployments
from fleet.tracesim.compare import config_from_deployment, profile_of
from fleet.tracesim.engine import Simulation
from fleet.tracesim.hindsight import Demand, Schedule, Yardsticks, schedule_of, solve, yardsticks
from fleet.tracesim.traces import load_trace
from fleet.tracesim.workload import Workload
from loadtests.hindsight_replay import FollowSchedule

HEADROOM_STEPS = 14
"""Bisection steps on the rate oracle's headroom (between 1 and `MAX_HEADROOM`)."""
MAX_HEADROOM = 16.0


def rate_oracle(demand: Demand, block: int, headroom: float, low: int, startup_s: float, drain_s: float) -> np.ndarray:
    """Replicas per interval of a policy told each bucket of ``block`` intervals' arrival count:
    at least ``ceil(headroom x count / (capacity x bucket seconds))`` (and ``low``) through the
    bucket, with the cheapest starts and stops that hold it (`solve` on those counts: a replica
    is kept through a gap shorter than a start-up and a drain, as a policy that sees a start-up
    ahead would keep it)."""
    t_count = len(demand.arrivals)
    starts = np.arange(0, t_count, block)
    count = np.add.reduceat(demand.arrivals, starts)
    seconds = np.add.reduceat(demand.seconds, starts)
    need = np.repeat(np.maximum(low, np.ceil(headroom * count / (demand.capacity_per_s * seconds) - 1e-9)),
                     block)[:t_count]  # fmt: skip
    floor = Demand(demand.interval_s, demand.seconds, need * demand.capacity_per_s * demand.seconds,
                   demand.capacity_per_s)  # fmt: skip
    return solve(floor, startup_s, min_replicas=low, drain_s=drain_s).replicas


@dataclass(frozen=True)
class OracleRow:
    resolution_s: float
    blocked: Schedule
    mean_rate: Schedule
    headroom: float
    kept: Schedule


def bound(demand: Demand, startup_s: float, drain_s: float, low: int, share: float, resolution_s: float) -> OracleRow:
    """The three figures of one resolution (module docstring)."""
    block = max(1, round(resolution_s / demand.interval_s))
    blocked = solve(demand, startup_s, min_replicas=low, miss_budget=1 - share, drain_s=drain_s, block=block)

    def at(headroom: float) -> Schedule:
        return schedule_of(demand, rate_oracle(demand, block, headroom, low, startup_s, drain_s), startup_s, drain_s)

    mean_rate = at(1.0)
    lo, hi = 1.0, MAX_HEADROOM
    if mean_rate.within_share >= share:
        hi = 1.0
    for _ in range(HEADROOM_STEPS if hi > 1.0 else 0):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if at(mid).within_share >= share else (mid, hi)
    return OracleRow(block * demand.interval_s, blocked, mean_rate, hi, at(hi))


def replay(trace: Path, dep_path: Path, replicas: np.ndarray, interval_s: float) -> dict[str, float]:
    """``replicas`` (per ``interval_s``) through the trace simulator as its scaling policy."""
    dep = load_deployments([dep_path])[0].deployment
    profile = profile_of(dep)
    base = config_from_deployment(dep, profile, standby_max=0)
    workload = Workload.from_trace(load_trace(trace), profile)
    n0 = int(replicas[: math.ceil(base.warm_startup_s / interval_s) + 1].max())
    cfg = replace(base, autoscaling=AutoscalingSpec(policy="fixed"), name="rate-oracle",
                  bounds=ReplicaBounds(0, max(base.bounds.max, int(replicas.max())), n0))  # fmt: skip
    sim = Simulation(cfg, workload)
    sim.policy = FollowSchedule(replicas, interval_s, base.warm_startup_s)  # type: ignore[assignment]
    s = sim.run().summary()
    return {"replica_hours": s.replica_hours, "within_slo": s.within_slo, "ttft_p99_s": s.ttft_p99_s or math.nan}


def replay_bisect(trace: Path, dep_path: Path, demand: Demand, row: OracleRow, sticks: Yardsticks, low: int,
                  share: float, steps: int) -> dict[str, float]:  # fmt: skip
    """The rate oracle of ``row``'s resolution replayed in the simulator at the lowest headroom
    (``steps`` bisection steps between 1 and the model's, which the model keeps) at which the
    simulator keeps ``share``: the model counts misses the simulator's queues serve in time."""
    block = max(1, round(row.resolution_s / demand.interval_s))

    def run(headroom: float) -> dict[str, float]:
        reps = rate_oracle(demand, block, headroom, low, sticks.startup_s, sticks.drain_s)
        return {"headroom": headroom, **replay(trace, dep_path, reps, demand.interval_s)}

    best = run(row.headroom)
    lo, hi = 1.0, row.headroom
    for _ in range(steps if best["within_slo"] >= share else 0):
        mid = (lo + hi) / 2
        out = run(mid)
        if out["within_slo"] >= share:
            hi, best = mid, out
        else:
            lo = mid
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", type=Path, nargs="+")
    ap.add_argument("-d", "--deployment", type=Path, required=True)
    ap.add_argument("--within-slo", type=float, default=0.99)
    ap.add_argument("--resolution-s", type=float, nargs="+", default=[10.0, 60.0])
    ap.add_argument("--replay", action="store_true", help="replay each rate oracle in the simulator, bisecting the "
                    "headroom the simulator needs to keep --within-slo")  # fmt: skip
    ap.add_argument("--replay-steps", type=int, default=4, help="bisection steps of --replay (each one simulation)")
    ap.add_argument("--json", type=Path, help="write every figure here")
    args = ap.parse_args(argv)
    dep = load_deployments([args.deployment])[0].deployment
    profile = profile_of(dep)
    base = config_from_deployment(dep, profile, standby_max=0)
    out = []
    for trace in args.traces:
        workload = Workload.from_trace(load_trace(trace), profile)
        sticks = yardsticks(workload, profile, base, args.within_slo)
        opt = sticks.optimum
        row: dict[str, object] = {"trace": str(trace), "requests": opt.requests, "drain_s": sticks.drain_s,
                                  "optimum": opt.to_dict()}  # fmt: skip
        print(f"{trace}: optimum {opt.replica_hours:.2f} replica-hours ({opt.starts} starts, "
              f"{100 * opt.within_share:.2f}% by the model; drain {sticks.drain_s:.1f} s)", flush=True)
        for r in args.resolution_s:
            b = bound(opt.demand, sticks.startup_s, sticks.drain_s, base.bounds.min, args.within_slo, r)
            figures = {
                "optimum_at_r": {**b.blocked.to_dict(), "x_optimum": b.blocked.replica_s / opt.replica_s},
                "rate_oracle_mean": {**b.mean_rate.to_dict(), "x_optimum": b.mean_rate.replica_s / opt.replica_s},
                "rate_oracle_kept": {**b.kept.to_dict(), "headroom": b.headroom,
                                     "x_optimum": b.kept.replica_s / opt.replica_s},
            }  # fmt: skip
            print(f"  r={r:g} s: optimum at r {figures['optimum_at_r']['x_optimum']:.2f}x; rate oracle at the mean "
                  f"{100 * b.mean_rate.within_share:.2f}% within, {figures['rate_oracle_mean']['x_optimum']:.2f}x; "
                  f"keeping {100 * args.within_slo:g}%: headroom {b.headroom:.2f}, "
                  f"{figures['rate_oracle_kept']['x_optimum']:.2f}x", flush=True)  # fmt: skip
            if args.replay:
                figures["rate_oracle_replayed"] = sim = replay_bisect(trace, args.deployment, opt.demand, b, sticks,
                                                                      base.bounds.min, args.within_slo,
                                                                      args.replay_steps)  # fmt: skip
                print(f"    replayed: headroom {sim['headroom']:.2f}: {100 * sim['within_slo']:.2f}% within, "
                      f"{sim['replica_hours']:.2f} replica-hours ({sim['replica_hours'] / opt.replica_hours:.2f}x), "
                      f"p99 TTFT {sim['ttft_p99_s']:.2f} s", flush=True)  # fmt: skip
            row[f"r{r:g}s"] = figures
        out.append(row)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
