"""Routing policies inside the trace simulator: the same policy objects as the router, fed the
same `RouteRequest`s, with one or several routers; prefix-cache hits and the load the
endpoints' states carry (fleet.tracesim.engine with router.pools.policies)."""

from __future__ import annotations

from collections import Counter

import pytest

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.workload import Workload
from fleet.tracesim.traces import Trace, TraceRequest

# Prefill-bound replicas: 20 us per token (a 2,048-token prompt costs 41 ms), 8 ms per step.
PREFILL = Profile(
    name="test-prefill", model="tiny", hardware="none (unit tests)",
    config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16, num_gpu_blocks=4096,
                        max_model_len=8192),
    cost=StepCost(fixed_s=0.008, per_token_s=20e-6), typical_startup_s=0.0, notes="test profile",
)  # fmt: skip


N_CONV = 25   # not a multiple of the 4 replicas: round-robin does not keep a conversation by chance


def conversations(n_conv: int = N_CONV, turns: int = 6, gap_s: float = 0.05) -> Trace:
    """`n_conv` conversations whose turns interleave; turn t of a conversation repeats the
    conversation's first 4 + t blocks of 128 tokens and adds 100 tokens of its own."""
    reqs = []
    for step in range(n_conv * turns):
        conv, turn = step % n_conv, step // n_conv
        blocks = tuple(conv * 1000 + b for b in range(4 + turn))
        reqs.append(TraceRequest(step * gap_s, 128 * len(blocks) + 100, 4, None, blocks, 128))
    return Trace("conversations", tuple(reqs))


def run(policy: str, routers: int = 1, trace: Trace | None = None) -> Simulation:
    cfg = SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(4, 4, 4),
                    routing_policy=policy, routers=routers)  # fmt: skip
    sim = Simulation(cfg, Workload.from_trace(trace or conversations(), PREFILL))
    sim.run()
    return sim


@pytest.mark.parametrize("policy", ["round-robin", "latency-aware", "kv-aware"])
@pytest.mark.parametrize("routers", [1, 3])
def test_every_endpoint_state_is_back_to_idle_at_the_end(policy: str, routers: int) -> None:
    sim = run(policy, routers)
    assert sum(1 for f in sim.log.failed if f) == 0
    for replica in sim.replicas:
        assert len(replica.endpoints) == routers
        for e in replica.endpoints:
            assert (e.in_flight, e.prefilling, e.prefill_tokens) == (0, 0, 0)
    per_router = [sum(r.endpoints[k].requests_total for r in sim.replicas) for k in range(routers)]
    assert sum(per_router) == len(sim.log) and max(per_router) - min(per_router) <= 1   # requests in turn


def test_kv_aware_keeps_conversations_together_and_its_index_predicts_the_hits() -> None:
    rr, kv = run("round-robin"), run("kv-aware")
    assert kv.log.prefix_hit_rate() > rr.log.prefix_hit_rate() + 0.3
    predicted, actual = sum(kv.log.predicted_cached_tokens), sum(kv.log.cached_tokens)
    assert abs(predicted - actual) <= 0.05 * actual
    homes: dict[int, Counter] = {}
    for i, replica in enumerate(kv.log.replica):
        homes.setdefault(i % N_CONV, Counter())[replica] += 1
    at_home = sum(c.most_common(1)[0][1] for c in homes.values())
    assert at_home / len(kv.log) >= 0.9


def test_two_routers_agree_on_where_each_conversation_lives() -> None:
    """Each router sees only its own requests and keeps its own index; turns alternate between
    them, so every second turn arrives at a router that has never seen the conversation's
    previous turn. Rendezvous hashing on the first block sends it to the same replica anyway."""
    one, two = run("kv-aware", 1), run("kv-aware", 2)
    assert two.log.prefix_hit_rate() >= one.log.prefix_hit_rate() - 0.05
    homes: dict[int, Counter] = {}
    for i, replica in enumerate(two.log.replica):
        homes.setdefault(i % N_CONV, Counter())[replica] += 1
    at_home = sum(c.most_common(1)[0][1] for c in homes.values())
    assert at_home / len(two.log) >= 0.9


def test_a_shared_view_tells_every_router_of_every_placement() -> None:
    """With `shared_view` (what KV cache events would give each router) the second router's
    index knows where the first one put each turn, so its predictions match the engines'."""
    cfg = SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(4, 4, 4),
                    routing_policy="kv-aware", routers=2, shared_view=True)  # fmt: skip
    sim = Simulation(cfg, Workload.from_trace(conversations(), PREFILL))
    sim.run()
    a, b = (r.index for r in sim.routings)   # type: ignore[attr-defined]
    assert {e: a.blocks(e) for e in a.endpoints()} == {e: b.blocks(e) for e in b.endpoints()}
    predicted, actual = sum(sim.log.predicted_cached_tokens), sum(sim.log.cached_tokens)
    assert actual > 0 and abs(predicted - actual) <= 0.05 * actual
