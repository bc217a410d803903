"""A replica joining a loaded pool, in the trace simulator: where `kv-aware` sends new conversations.

`kv-aware` sends a new conversation to the endpoint whose engine has stored the fewest blocks
since the router first saw it (`router.kv.exact_index.ExactIndex.placed_blocks`; docs/routing.md, "New
conversations where the least was stored"). That count only grows, so a replica that joins late
starts far below the others. This script measures what that does: the pool starts with
``--replicas - 1`` simulated replicas, offered load sized for ``--replicas``, and one more replica
joins ``--join-s`` virtual seconds in (ready ``--startup-s`` later). It runs one router on the
engines' KV events (what any number of routers behind the endpoint picker decide alike, one
picker deciding for all) with `kv-aware` as shipped, and again
with new conversations placed by rendezvous hashing on the first block (the rule before, for
comparison: `kv-aware` with its new-conversation step switched off, a subclass), and prints per
row: p99 TTFT and prefix-cache hits over all requests and over those that arrived after the join,
and the joining replica's share of those requests (1 / ``--replicas`` is its fair share).

A simulator: virtual time, no HTTP, simulated engines (fleet/tracesim/engine.py).

Usage:
    python -m loadtests.sim_scale_up [--load 0.8] [--join-s 60] [--seed 0] [--start-s 600] [--window-s 300]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace
from pathlib import Path

from autoscaler.policy import ReplicaBounds, ScalingContext, ScalingDecision, ScalingPolicy
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.profiles import Profile, get_profile
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.results import SimResult, nearest_rank
from fleet.tracesim.traces import load_trace
from fleet.tracesim.workload import Workload, replica_capacity_per_s
from router.pools.policies import KvAware

TRACE = Path(__file__).resolve().parent / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"


class JoinAt(ScalingPolicy):
    """``bounds.initial`` replicas until `at_s` (virtual seconds), ``bounds.max`` from then on: this
    script's scale-up. Not registered (no ``name``), so it never shows among the policies a
    deployment may name; `run` puts it in place of the simulation's ``fixed`` policy."""

    default_interval_s = 1.0

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds, at_s: float) -> None:
        super().__init__(spec, bounds)
        self.at_s = at_s

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        n = self.bounds.max if ctx.now_s >= self.at_s else self.bounds.initial
        return self._decision(ctx, n, "scheduled", f"{n} replica(s) from {self.at_s} s")


class RendezvousNewConversations(KvAware):
    """`kv-aware` placing new conversations by rendezvous on the first block, as before the
    fewest-stored rule: the comparison row."""

    def _new_conversation(self, *args: object, **kwargs: object) -> None:
        return None


def simulate(label: str, policy: type[KvAware], workload: Workload, profile: Profile,
             args: argparse.Namespace) -> SimResult:  # fmt: skip
    """Replay `workload` through one router of `policy`, ``args.replicas - 1`` replicas and one
    more joining at ``args.join_s`` (ready ``args.startup_s`` later)."""
    cfg = SimConfig(profile=profile, autoscaling=AutoscalingSpec(policy="fixed"),
                    bounds=ReplicaBounds(args.replicas - 1, args.replicas, args.replicas - 1),
                    routing_policy="kv-aware", seed=args.seed, name=label, kv_events=True, warm_startup_s=args.startup_s,
                    cold_startup_s=args.startup_s)  # fmt: skip
    sim = Simulation(cfg, workload)
    sim.policy = JoinAt(cfg.autoscaling, cfg.bounds, args.join_s)
    sim.routings = [policy()]
    sim.routing = sim.routings[0]
    return sim.run()


def run(label: str, policy: type[KvAware], workload: Workload, profile: Profile, args: argparse.Namespace) -> dict:
    """One row (`simulate`): p99 TTFT and hits, over all requests and those after the join, and
    the joining replica's share of the latter."""
    result = simulate(label, policy, workload, profile, args)
    log = result.requests
    after = [i for i, a in enumerate(log.arrival_s) if a >= args.join_s]
    ttfts = sorted(log.first_token_s[i] - log.arrival_s[i] for i in after if not math.isnan(log.first_token_s[i]))
    joined = args.replicas - 1   # replica indices start at 0: the joining one is the last
    summary = result.summary()
    return {"row": label, "ttft_p99_s": summary.ttft_p99_s, "prefix_hit_rate": summary.prefix_hit_rate,
            "after_ttft_p99_s": nearest_rank(ttfts, 0.99) if ttfts else math.nan,
            "after_prefix_hit_rate": sum(log.cached_tokens[i] for i in after) / max(1, sum(log.prompt_tokens[i] for i in after)),
            "joined_share": sum(1 for i in after if log.replica[i] == joined) / max(1, len(after)),
            "after_requests": len(after), "failed": summary.failed}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=TRACE, help="Mooncake JSONL (default: the synthetic trace)")
    parser.add_argument("--start-s", type=float, default=600.0, help="window start, trace seconds")
    parser.add_argument("--window-s", type=float, default=300.0, help="window length, trace seconds")
    parser.add_argument("--replicas", type=int, default=8, help="replicas once the last has joined (>= 2)")
    parser.add_argument("--load", type=float, default=0.8, help="offered load / capacity of --replicas")
    parser.add_argument("--join-s", type=float, default=60.0, help="virtual seconds from the start to the join")
    parser.add_argument("--startup-s", type=float, default=5.0, help="seconds from the join to READY")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' token ids")
    args = parser.parse_args()
    if args.replicas < 2 or args.join_s < 0 or args.startup_s < 0:
        parser.error("--replicas must be >= 2, --join-s and --startup-s >= 0")
    profile = get_profile("h100-llama-8b").with_overrides(max_model_len=32768)
    base = Workload.from_trace(load_trace(args.trace).window(args.start_s, args.window_s), profile)
    speedup = args.load * args.replicas * replica_capacity_per_s(base.trace, profile) / base.trace.mean_rate_per_s()
    workload = replace(base, trace=base.trace.compressed(speedup), speedup=speedup)
    print(f"{args.trace.name} {args.start_s:g}+{args.window_s:g} s: {len(workload.requests)} requests, "
          f"{args.load:.0%} of {args.replicas} replicas, {args.replicas - 1} until {args.join_s:g} s (simulated)")
    print("| new conversations | p99 TTFT | hits | after the join: p99 TTFT | hits | the new replica's share |")
    print("|---|---|---|---|---|---|")
    for label, policy in (("fewest stored (kv-aware)", KvAware), ("rendezvous (before)", RendezvousNewConversations)):
        r = run(label, policy, workload, profile, args)
        print(f"| {label} | {r['ttft_p99_s']:.3f} s | {100 * r['prefix_hit_rate']:.2f}% | {r['after_ttft_p99_s']:.3f} s "
              f"| {100 * r['after_prefix_hit_rate']:.2f}% | {100 * r['joined_share']:.1f}% of {r['after_requests']} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
