"""The trace simulator's parallel runs: worker processes give the serial results (fleet.tracesim);
the rest of the simulator is in tests/unit/test_simulate.py."""

from __future__ import annotations

from dataclasses import replace

from autoscaler.spec import AutoscalingSpec
from fleet.tracesim.compare import contender, run_comparison
from fleet.tracesim.workload import (
    Workload,
)
import pytest
from fleet.controller.lifecycle import ReplicaStatus
from fleet.tracesim.replica import NodePool
from tests.unit.test_simulate import TINY, config, fleet_spec, simulate, trace_of  # the subject's helpers live in its unit file

# A small, slow replica: every step costs 50 ms, at most 4 requests in a batch. A request of
# 64 prompt tokens and 8 output tokens takes 8 steps; one replica completes ~10 requests/s.


def test_parallel_runs_give_the_serial_results() -> None:
    workload = Workload.from_trace(trace_of((20, 2.0), (20, 25.0), (60, 2.0)), TINY)
    configs = [replace(config(fleet_spec()), name="fleet"), contender(config(fleet_spec()), "kpa")]
    seen: list[tuple[int, int]] = []
    serial = run_comparison(configs, workload, jobs=1)
    parallel = run_comparison(configs, workload, jobs=2, progress=lambda i, now_s, done, total: seen.append((i, done)))
    assert [r.summary() for r in serial] == [r.summary() for r in parallel]
    assert {i for i, _ in seen} == {0, 1} and (0, len(workload.requests)) in seen


def test_the_same_inputs_give_the_same_result() -> None:
    runs = [simulate(config(fleet_spec()))[1] for _ in range(2)]
    a, b = runs
    assert a.summary() == b.summary()
    assert a.requests.end_s == b.requests.end_s and a.requests.replica == b.requests.replica
    assert [t.decision for t in a.ticks] == [t.decision for t in b.ticks]
    assert a.summary().scaling_actions > 0  # the run did something worth repeating


def test_a_burst_scales_up_and_the_replicas_come_back_down_after_it() -> None:
    sim, result = simulate(config(fleet_spec()))
    ups = [t for t in result.ticks if t.decision.desired > t.decision.previous]
    downs = [t for t in result.ticks if t.decision.desired < t.decision.previous]
    assert ups and 60.0 <= ups[0].at_s < 120.0, "the first scale-up comes during the burst"
    assert max(t.ready for t in result.ticks) >= 3
    assert downs and min(t.at_s for t in downs) > 120.0, "no scale-down before the burst is over"
    assert result.ticks[-1].desired == 1 and result.ticks[-1].ready == 1
    assert [r.status for r in sim.replicas].count(ReplicaStatus.READY) == 1
    assert all(r.status is ReplicaStatus.TERMINATED for r in sim.replicas[1:]), "every added replica stopped again"
    s = result.summary()
    _, alone = simulate(config(AutoscalingSpec(policy="fixed")))
    assert s.failed == 0 and s.within_slo > alone.summary().within_slo + 0.1, "the added replicas served the burst"
    # Cost: the one replica all along, plus each added one from placement to stop.
    expected_s = sum(r.cost_s(result.horizon_s) for r in sim.replicas)
    assert s.replica_hours == pytest.approx(expected_s / 3600) and s.replica_hours > result.horizon_s / 3600


def test_warm_and_cold_start_up_times_are_honoured() -> None:
    # Two warm node slots: the initial replica's and one more; every other new replica starts cold.
    sim, result = simulate(config(fleet_spec(), warm_nodes=2, warm_startup_s=10.0, cold_startup_s=40.0))
    kinds = {warm for _, warm, _ in result.startups}
    assert kinds == {True, False}, result.startups
    for replica_id, warm, seconds in result.startups:
        assert seconds == pytest.approx(10.0 if warm else 40.0), replica_id
    # No request reached a replica before it was READY.
    log = result.requests
    for r in sim.replicas[1:]:
        dispatched = [d for d, k in zip(log.dispatch_s, log.replica) if k == r.index]
        assert all(d >= r.ready_at_s - 1e-9 for d in dispatched), r
    # The policy learned the start-ups it saw (it was never told the modelled ones).
    assert sim.startup.estimate(next_warm=False).cold_s == pytest.approx(40.0)
    # A cold slot is warm once a replica on it became READY.
    pool = NodePool(warm=1)
    assert pool.take() == (0, True) and pool.take() == (1, False) and not pool.next_is_warm()
    pool.became_ready(1)
    pool.release(1)
    assert pool.next_is_warm() and pool.take() == (1, True)
