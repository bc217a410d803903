"""One `standby` run on a trace with a given standby-pool setting (`autoscaler.spec.StandbyPoolSpec`):
how the pool's defaults were chosen on Azure `code` and `conv` (docs/benchmarks.md, "Standby on a held-out
day (simulated)"). Same deployment, simulator and allowance (2) as `fleet simulate ... --policies standby
--standby-max 2`; prints one line: share within the TTFT target, p99 TTFT, replica-hours (of which
standby), scaling actions, wake-ups.

    python -m loadtests.standby_pool_sweep loadtests/traces/azure-llm-2023/conv.csv \\
        --initial 2 --initial-s 60 --half-life-s 900

``--initial none``: the deployment's maximum before any burst. ``--forecast`` runs
`standby-forecast` (``--history`` files prime it, as `fleet simulate --history`; ``--bound``:
`autoscaler.spec.ForecastSpec.bound`). How the held-out day's settings were tuned on day 3
(docs/benchmarks.md)::

    python -m loadtests.standby_pool_sweep /tmp/daily/day-3.jsonl --forecast --history /tmp/daily/day-1.jsonl \
        --history /tmp/daily/day-2.jsonl --forecast-ahead-s 3600 --bound upper
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

from autoscaler.spec import StandbyPoolSpec
from fleet.cli.common import load_or_exit
from fleet.tracesim.compare import config_from_deployment, contender, profile_of, run_one
from fleet.tracesim.traces import load_trace
from fleet.tracesim.workload import Workload, history_rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--deployment", default="examples/simulate-h100.yaml")
    ap.add_argument("--standby-max", type=int, default=2)
    ap.add_argument("--initial", default="2", help="starting pool (replicas) or 'none'")
    ap.add_argument("--initial-s", type=float, default=60.0)
    ap.add_argument("--half-life-s", type=float, default=900.0)
    ap.add_argument("--forecast-ahead-s", type=float, default=0.0)
    ap.add_argument("--floor-half-life-s", type=float, default=None,
                    help="standbyPool.floorHalfLifeSeconds (default: the spec's)")
    ap.add_argument("--forecast", action="store_true")
    ap.add_argument("--bound", choices=("point", "upper"), default=None, help="forecast.bound (default: the spec's)")
    ap.add_argument("--history", action="append", default=[])
    a = ap.parse_args()
    dep = load_or_exit([Path(a.deployment)])[0].deployment
    profile = profile_of(dep)
    base = config_from_deployment(dep, profile, standby_max=a.standby_max)
    if a.history:
        base = replace(base, history=history_rates([load_trace(p) for p in a.history]))
    cfg = contender(base, "standby-forecast" if a.forecast else "standby")
    pool = StandbyPoolSpec(initial_replicas=None if a.initial == "none" else int(a.initial),
                           initial_seconds=a.initial_s, half_life_seconds=a.half_life_s,
                           forecast_ahead_seconds=a.forecast_ahead_s)  # fmt: skip
    if a.floor_half_life_s is not None:
        pool = pool.model_copy(update={"floor_half_life_seconds": a.floor_half_life_s})
    update: dict[str, object] = {"standby_pool": pool}
    if a.bound is not None and cfg.autoscaling.forecast is not None:
        update["forecast"] = cfg.autoscaling.forecast.model_copy(update={"bound": a.bound})
    cfg = replace(cfg, autoscaling=cfg.autoscaling.model_copy(update=update))
    started = time.monotonic()
    s = run_one(cfg, Workload.from_trace(load_trace(a.trace), profile), None).summary()
    print(f"{Path(a.trace).parent.name}/{Path(a.trace).name} {cfg.name} initial={a.initial} initial_s={a.initial_s:g} half_life_s={a.half_life_s:g} "
          f"forecast_ahead_s={a.forecast_ahead_s:g} bound={a.bound or 'default'} "
          f"floor_half_life_s={pool.floor_half_life_seconds:g}: {s.within_slo:.2%} within, p99 {s.ttft_p99_s:.2f} s, "
          f"{s.replica_hours:.2f} replica-h ({s.standby_hours:.2f} standby), {s.scaling_actions} actions, "
          f"{s.wakes} wake-ups ({time.monotonic() - started:.0f} s wall)")  # fmt: skip


if __name__ == "__main__":
    main()
