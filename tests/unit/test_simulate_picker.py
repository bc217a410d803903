"""The trace simulator with an endpoint picker (SimConfig.picker, fleet.tracesim.picker): N
simulated routers ask one `router.picker.state.PickerState`, which alone reads the engines' KV
events and holds every router's load."""

from __future__ import annotations

import pytest

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.traces import Trace
from fleet.tracesim.workload import Workload
from tests.unit.test_simulate_load_signal import PREFILL, bursty, conversations


def simulate(trace: Trace, *, routers: int, picker: bool, kv_events: bool = True, delay_s: float = 0.0) -> Simulation:
    cfg = SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(4, 4, 4),
                    routing_policy="kv-aware", routers=routers, kv_events=kv_events, kv_events_delay_s=delay_s,
                    picker=picker)  # fmt: skip
    sim = Simulation(cfg, Workload.from_trace(trace, PREFILL))
    sim.run()
    assert not any(sim.log.failed)
    return sim


def placements(sim: Simulation) -> list[int]:
    return list(sim.log.replica)


def test_routers_asking_one_picker_place_as_one_router_does() -> None:
    """Same picks, whatever the number of routers: the picker decides them all, in arrival order;
    three routers on their own load place long prompts otherwise."""
    for trace in (conversations(), bursty()):
        one = simulate(trace, routers=1, picker=True)
        assert placements(simulate(trace, routers=3, picker=True)) == placements(one)
    alone = simulate(bursty(), routers=3, picker=False)
    assert placements(alone) != placements(one)


def test_the_picker_alone_reads_the_events_and_releases_every_pick() -> None:
    sim = simulate(conversations(), routers=2, picker=True, delay_s=0.02)
    assert len(sim.exact_indexes) == 1 and all(sim.exact_indexes[0].live(r.id) for r in sim.replicas)
    assert sim.picker is not None and sim.picker.state.in_flight() == 0
    held = sim.picker.state.pools["sim-model"].endpoints.values()
    assert all(e.in_flight == 0 and e.prefill_tokens == 0 for e in held)
    log = sim.log
    error = sum(abs(p - a) for p, a in zip(log.predicted_cached_tokens, log.cached_tokens)) / sum(log.prompt_tokens)
    assert error < 0.02   # the picker's view is the engines' own
    assert sim.config.params()["routing"]["picker"] is True


def test_one_picker_over_every_routers_load_spreads_long_prompts_as_one_router() -> None:
    def p99(sim: Simulation) -> float:
        ttfts = sorted(f - a for f, a in zip(sim.log.first_token_s, sim.log.arrival_s))
        return ttfts[int(0.99 * (len(ttfts) - 1))]

    with_picker = p99(simulate(bursty(), routers=2, picker=True, kv_events=False))
    alone = p99(simulate(bursty(), routers=2, picker=False, kv_events=False))
    assert with_picker < alone
    assert with_picker == pytest.approx(p99(simulate(bursty(), routers=1, picker=False, kv_events=False)), rel=0.05)


def test_a_picker_with_an_admission_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="picker"):
        SimConfig(profile=PREFILL, autoscaling=AutoscalingSpec(policy="fixed"), bounds=ReplicaBounds(1, 1, 1),
                  picker=True, max_concurrency_per_endpoint=4)
