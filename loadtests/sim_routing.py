"""Routing policies compared in the trace simulator: virtual time, no HTTP, deterministic.

Each row replays one trace window through a fixed fleet of `--replicas` simulated replicas
(`fleet.tracesim.engine.Simulation`, autoscaling `fixed`) with one routing policy: the very
policy objects of `router.pools.policies` that the router runs, fed `RouteRequest`s built by the
router's own `route_request` from the token-id prompts the engine models get. Load is set as
`loadtests/bench_routing.py` sets it: one replica's capacity on the window's request mix is
measured with the engine model, and arrivals are compressed so the fleet runs at `--load`.

A policy may carry parameters for tuning: `kv-aware:load_bound=2,decode_token_weight=0`.
`--routers N` puts N independent routers in front of the pool, taking requests in turn, each
with its own policy object and its own view of the endpoints (`SimConfig.routers`).
`--load-signals` runs each policy once per load signal (`SimConfig.load_signal`: what each
router knows of the load the others sent): `own`, `engine:100` (the engines' waiting and
running requests sampled every 100 ms), `engine-prefill:100` (plus their queued prefill
tokens). `--picker` has every router ask one endpoint picker, which holds every router's load.
`--kv-events` has every
router's `kv-aware` match prompts against the engines' own KV cache events
(`SimConfig.kv_events`) instead of its approximate index.

Reported per row: TTFT p50 / p99, share within `--ttft-slo-s`, the prefix-cache hit rate
(prompt tokens found in the engines' prefix caches / prompt tokens), and, for `kv-aware`, how
well its prefix index predicted those hits: predicted cached tokens / actual ones, and the
prediction error (sum over requests of |predicted - actual| cached tokens / prompt tokens).
This is a SIMULATOR: engines are `fleet.enginesim` latency models.

Usage:
    python -m loadtests.sim_routing --trace loadtests/traces/mooncake-fast25/synthetic_trace.jsonl \\
        --max-model-len 32768 --load 0.8 --policies round-robin,least-outstanding,latency-aware,kv-aware
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.profiles import get_profile
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.results import nearest_rank
from fleet.tracesim.workload import Workload, jitter_arrivals, replica_capacity_per_s
from fleet.tracesim.traces import load_trace
from router.pools.policies import make_policy


def make_variant(spec: str):
    """`name` or `name:key=value,...` -> (label, factory of a fresh policy object)."""
    name, _, params = spec.partition(":")
    kwargs: dict[str, float] = {}
    for item in filter(None, params.split(",")):
        key, _, value = item.partition("=")
        kwargs[key] = float(value) if "." in value or "e" in value else int(value)
    if not kwargs:
        return spec, lambda: make_policy(name)
    cls = type(make_policy(name))
    return spec, lambda: cls(**kwargs)


def parse_signal(spec: str) -> tuple[str, float]:
    """`name` or `name:interval_ms` -> (load signal, interval in seconds; default 100 ms)."""
    name, _, ms = spec.partition(":")
    return name, float(ms) / 1000 if ms else 0.1


def run_row(label: str, factory, workload: Workload, args, profile, signal: str = "own") -> dict:
    load_signal, interval_s = parse_signal(signal)
    cfg = SimConfig(profile=profile, autoscaling=AutoscalingSpec(policy="fixed"),
                    bounds=ReplicaBounds(args.replicas, args.replicas, args.replicas),
                    routing_policy=label.partition(":")[0], ttft_slo_s=args.ttft_slo_s, seed=args.seed,
                    name=label, routers=args.routers, shared_view=args.shared_view,
                    load_signal=load_signal, load_interval_s=interval_s, kv_events=args.kv_events,
                    kv_events_delay_s=args.kv_events_delay_ms / 1000, picker=args.picker)  # fmt: skip
    sim = Simulation(cfg, workload)
    sim.routings = [factory() for _ in range(args.routers)]
    sim.routing = sim.routings[0]
    started = time.perf_counter()
    result = sim.run()
    wall_s = time.perf_counter() - started
    s = result.summary()
    log = result.requests
    actual = sum(log.cached_tokens)
    predicted = sum(log.predicted_cached_tokens)
    error = sum(abs(p - a) for p, a in zip(log.predicted_cached_tokens, log.cached_tokens))
    e2e_s = sorted(e - a for a, e in zip(log.arrival_s, log.end_s) if not math.isnan(e))
    e2e_p50_s = nearest_rank(e2e_s, 0.5) if e2e_s else math.nan
    return {"policy": label, "load_signal": signal, "routers": args.routers, "kv_events": args.kv_events,
            "picker": args.picker, "ttft_p50_s": s.ttft_p50_s, "ttft_p99_s": s.ttft_p99_s,
            "e2e_p50_s": e2e_p50_s, "within_slo": s.within_slo,
            "prefix_hit_rate": s.prefix_hit_rate, "predicted_over_actual_hits": predicted / actual if actual else None,
            "prediction_error": error / sum(log.prompt_tokens), "failed": s.failed, "wall_s": wall_s}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="Azure CSV, Fleet JSONL or Mooncake JSONL")
    parser.add_argument("--start-s", type=float, default=0.0, help="window start, trace seconds")
    parser.add_argument("--window-s", type=float, help="window length, trace seconds (default: all)")
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--profile", default="h100-llama-8b")
    parser.add_argument("--max-model-len", type=int, help="override the profile's max_model_len")
    parser.add_argument("--load", type=float, default=0.8, help="offered load / fleet capacity")
    parser.add_argument("--routers", type=int, default=1)
    parser.add_argument("--shared-view", action="store_true",
                        help="every router learns every placement (what KV cache events would tell it)")
    parser.add_argument("--kv-events", action="store_true",
                        help="the engines' KV cache events reach every router's exact index (SimConfig.kv_events)")
    parser.add_argument("--kv-events-delay-ms", type=float, default=0.0,
                        help="delay from an engine step to its events' arrival at the routers")
    parser.add_argument("--picker", action="store_true",
                        help="the routers ask one endpoint picker (SimConfig.picker; it runs the policy by name, "
                             "without the parameters a policy of --policies carries)")
    parser.add_argument("--load-signals", default="own",
                        help="comma-separated load signals, each `name[:interval_ms]`: own, engine, engine-waiting, "
                             "engine-prefill (SimConfig.load_signal)")
    parser.add_argument("--ttft-slo-s", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=0, help="the prompts' token ids, and the arrival jitter's draw")
    parser.add_argument("--arrival-jitter-ms", type=float, default=0.0,
                        help="delay each arrival by a uniform draw below this (ms, seeded by --seed), so close "
                             "arrivals may swap as in a live replay; 0 (default): the trace's order")
    parser.add_argument("--policies", default="round-robin,least-outstanding,latency-aware,kv-aware",
                        help="comma-separated; ';' separates policies that carry parameters")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()

    profile = get_profile(args.profile).with_overrides(max_model_len=args.max_model_len)
    base = Workload.from_trace(load_trace(args.trace).window(args.start_s, args.window_s), profile)
    capacity = replica_capacity_per_s(base.trace, profile)
    speedup = args.load * args.replicas * capacity / base.trace.mean_rate_per_s()
    trace = jitter_arrivals(base.trace.compressed(speedup), args.arrival_jitter_ms / 1000, args.seed)
    workload = replace(base, trace=trace, speedup=speedup)
    print(f"{args.trace.name}: {len(workload.requests)} requests ({base.clipped} clipped to {profile.config.max_model_len} "
          f"tokens), one replica {capacity:.3f} req/s saturated, speedup x{speedup:.3f} -> "
          f"{workload.trace.mean_rate_per_s():.2f} req/s on {args.replicas} replicas ({args.load:.0%} load), "
          f"{args.routers} router(s){', shared view' if args.shared_view else ''}"
          f"{', KV events' if args.kv_events else ''}", flush=True)
    specs = args.policies.split(";") if ";" in args.policies else args.policies.split(",")
    rows = []
    print("| policy | load signal | TTFT p50 | TTFT p99 | e2e p50 | within SLO | prefix hit rate | predicted / actual hits | prediction error "
          "| failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for spec, signal in [(p, sig) for p in filter(None, specs) for sig in args.load_signals.split(",")]:
        label, factory = make_variant(spec)
        row = run_row(label, factory, workload, args, profile, signal)
        rows.append(row)
        ratio = row["predicted_over_actual_hits"]
        print(f"| {label} | {signal} | {row['ttft_p50_s']:.3f} s | {row['ttft_p99_s']:.3f} s | {row['e2e_p50_s']:.2f} s | {100 * row['within_slo']:.1f}% "
              f"| {100 * row['prefix_hit_rate']:.1f}% | {'-' if ratio is None else f'{ratio:.2f}'} "
              f"| {100 * row['prediction_error']:.1f}% | {row['failed']} |",
              flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps({"trace": str(args.trace), "args": vars(args) | {"trace": str(args.trace),
                                            "json_out": str(args.json_out)}, "speedup": speedup,
                                             "capacity_per_s": capacity, "rows": rows}, indent=1))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
