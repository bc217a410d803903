"""What each simulated router knows of the load the others sent (SimConfig.load_signal): the
engines' load sampled through `router.signals.engine_load.EngineLoadView`; the engines' KV cache
events read by every router's exact index (fleet.tracesim.engine); and a claim seen by every
router through the endpoint picker (SimConfig.picker)."""

from __future__ import annotations

import pytest

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.traces import Trace, TraceRequest
from fleet.tracesim.workload import Workload

PREFILL = Profile(
    name="test-prefill", model="tiny", hardware="none (unit tests)",
    config=EngineConfig(max_num_seqs=64, max_num_batched_tokens=2048, block_size=16, num_gpu_blocks=4096,
                        max_model_len=8192),
    cost=StepCost(fixed_s=0.008, per_token_s=20e-6), typical_startup_s=0.0, notes="test profile",
)  # fmt: skip


def bursty(n: int = 120, gap_s: float = 0.01) -> Trace:
    """Long unique prompts arriving faster than one replica prefills them: where they land matters."""
    return Trace("bursty", tuple(TraceRequest(i * gap_s, 2000 + 37 * (i % 11), 8, None, (i,), 2000)
                                 for i in range(n)))  # fmt: skip


def config(signal: str = "own", interval_s: float = 0.1, routers: int = 2) -> SimConfig:
    return SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(4, 4, 4),
                     routing_policy="kv-aware", routers=routers, load_signal=signal, load_interval_s=interval_s)  # fmt: skip


def run(signal: str = "own", interval_s: float = 0.1, routers: int = 2) -> Simulation:
    sim = Simulation(config(signal, interval_s, routers), Workload.from_trace(bursty(), PREFILL))
    sim.run()
    assert not any(sim.log.failed)
    return sim


@pytest.mark.parametrize("signal", ["engine", "engine-prefill"])
def test_engine_samples_reach_every_router(signal: str) -> None:
    sim = run(signal, 0.05)
    assert all(e.others_until_s > 0 for r in sim.replicas for e in r.endpoints)
    assert sim.config.params()["routing"]["load_signal"] == signal


def test_bad_load_signals_are_refused() -> None:
    with pytest.raises(ValueError, match="load_signal"):
        config("gossip")
    with pytest.raises(ValueError, match="load_signal must be one of own, engine, engine-waiting, engine-prefill"):
        config("peers")
    with pytest.raises(ValueError, match="load_interval_s"):
        config("engine", 0.0)


def conversations(n_conv: int = 25, turns: int = 6, gap_s: float = 0.05) -> Trace:
    """Turn t of a conversation repeats its first 4 + t blocks of 128 tokens and adds 100 of its own."""
    reqs = []
    for step in range(n_conv * turns):
        conv, turn = step % n_conv, step // n_conv
        blocks = tuple(conv * 1000 + b for b in range(4 + turn))
        reqs.append(TraceRequest(step * gap_s, 128 * len(blocks) + 100, 4, None, blocks, 128))
    return Trace("conversations", tuple(reqs))


@pytest.mark.parametrize("delay_s", [0.0, 0.02])
def test_every_router_reads_the_engines_kv_events(delay_s: float) -> None:
    def prediction_error(kv_events: bool) -> float:
        cfg = SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(4, 4, 4),
                        routing_policy="kv-aware", routers=2, kv_events=kv_events, kv_events_delay_s=delay_s)  # fmt: skip
        sim = Simulation(cfg, Workload.from_trace(conversations(), PREFILL))
        sim.run()
        if kv_events:   # one index per router, each fed the same batches
            assert len(sim.exact_indexes) == 2 and len(sim.exact_indexes[0]) == len(sim.exact_indexes[1]) > 0
            assert all(sim.exact_indexes[0].live(r.id) for r in sim.replicas)
        log = sim.log
        return sum(abs(p - a) for p, a in zip(log.predicted_cached_tokens, log.cached_tokens)) / sum(log.prompt_tokens)

    approximate, exact = prediction_error(False), prediction_error(True)
    assert approximate > 0.1   # two routers guess where the other put a conversation
    assert exact < 0.02        # the engines' account: what the engine finds, but for a batch in flight


@pytest.mark.parametrize("picker", [True, False])
def test_a_routers_claim_reaches_the_other_router_through_the_picker(picker: bool) -> None:
    """One replica, requests alternating between the routers: a first prompt through router 0
    warms the views (its events teach the engine's block size, which a claim needs); then a prompt
    through router 1, and the same prompt through router 0 50 ms later, before the engine's events
    (0.5 s late) show it stored. Through the picker (one view, every router's claims) router 0's
    pick expects the whole prompt cached; each router on its own expects nothing."""
    warm = TraceRequest(0.0, 256, 4, None, (7, 8), 128)
    first = TraceRequest(2.0, 1024, 4, None, tuple(range(100, 108)), 128)
    second = TraceRequest(2.05, 1024, 4, None, tuple(range(100, 108)), 128)
    cfg = SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(1, 1, 1),
                    routing_policy="kv-aware", routers=2, kv_events=True, kv_events_delay_s=0.5, picker=picker)  # fmt: skip
    sim = Simulation(cfg, Workload.from_trace(Trace("claims", (warm, first, second)), PREFILL))
    sim.run()
    log = sim.log
    assert not any(log.failed) and log.predicted_cached_tokens[1] == 0
    assert log.predicted_cached_tokens[2] == (1024 if picker else 0)
