"""Replay the hindsight-optimal schedule through the trace simulator: does the schedule its model
calls within the SLO keep it when the simulated replicas serve the trace?

`fleet.tracesim.hindsight` solves the cheapest replica count per interval on a model (one
replica's capacity at the SLO, arrivals per interval). This check hands that schedule to the
trace simulator (`fleet.tracesim.engine.Simulation`) as its scaling policy, in virtual time:
every interval it targets the most replicas the schedule holds from now until a start-up from
now (so a replica the schedule needs READY at t is started at t - startup, as the model pays
it), no standby. It prints the model's figures beside the simulator's (share within the TTFT
SLO, replica-hours). A simulated share well under the model's says the model is optimistic on
that trace (its per-interval capacity misses queues carried across intervals), so the optimum is
a lower bound there, not a schedule that keeps the SLO.

Run::

    python -m loadtests.hindsight_replay loadtests/traces/azure-llm-2023/code.csv -d examples/simulate-h100.yaml

SIMULATED: the engines are `fleet.enginesim` latency models, not vLLM.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from autoscaler.policy import ReplicaBounds, ScalingContext, ScalingDecision
from autoscaler.spec import AutoscalingSpec
from fleet.spec import load_deployments
from fleet.tracesim.compare import config_from_deployment, profile_of
from fleet.tracesim.engine import Simulation
from fleet.tracesim.hindsight import yardsticks
from fleet.tracesim.traces import load_trace
from fleet.tracesim.workload import Workload


@dataclass
class FollowSchedule:
    """A scaling policy that follows ``replicas`` (one count per ``interval_s``), starting each
    replica ``startup_s`` before the interval that needs it READY."""

    replicas: np.ndarray
    interval_s: float
    startup_s: float
    name: str = "hindsight-schedule"

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        k = min(len(self.replicas) - 1, int(ctx.now_s // self.interval_s + 1e-9))
        ahead = math.ceil(self.startup_s / self.interval_s - 1e-9)
        desired = int(self.replicas[k: k + ahead + 1].max())
        return ScalingDecision(ctx.now_s, ctx.desired, desired, "schedule", "", standby=0)

    def take_background(self) -> None:
        return None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("-d", "--deployment", type=Path, required=True)
    ap.add_argument("--within-slo", type=float, default=0.99)
    args = ap.parse_args(argv)
    dep = load_deployments([args.deployment])[0].deployment
    profile = profile_of(dep)
    base = config_from_deployment(dep, profile, standby_max=0)
    workload = Workload.from_trace(load_trace(args.trace), profile)
    sticks = yardsticks(workload, profile, base, args.within_slo)
    opt = sticks.optimum
    n0 = int(opt.replicas[: math.ceil(base.warm_startup_s / opt.demand.interval_s) + 1].max())
    cfg = replace(base, autoscaling=AutoscalingSpec(policy="fixed"), name="hindsight-schedule",
                  bounds=ReplicaBounds(0, max(base.bounds.max, int(opt.replicas.max())), n0))  # fmt: skip
    sim = Simulation(cfg, workload)
    sim.policy = FollowSchedule(opt.replicas, opt.demand.interval_s, base.warm_startup_s)  # type: ignore[assignment]
    s = sim.run().summary()
    print(f"{args.trace}: the model: {opt.replica_hours:.2f} replica-hours, {100 * opt.within_share:.2f}% within "
          f"{base.ttft_slo_s:g} s ({opt.starts} starts, one replica {opt.demand.capacity_per_s:.2f} req/s at the SLO); "
          f"replayed in the simulator: {s.replica_hours:.2f} replica-hours, {100 * s.within_slo:.2f}% within, "
          f"p99 TTFT {s.ttft_p99_s or float('nan'):.2f} s, {s.failed} failed")


if __name__ == "__main__":
    main()
