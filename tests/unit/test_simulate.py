"""The trace simulator on small synthetic traces: determinism, scale-up on a burst and back down,
warm and cold start-up times, drain semantics, the fixed baseline, the router's admission, and
the summary metrics on a hand-checked case (fleet.tracesim). Parallel runs in worker processes:
tests/integration/test_simulate.py."""

from __future__ import annotations

import math

import pytest

from autoscaler.policy import ReplicaBounds, ScalingDecision
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.tracesim.compare import COMPARE, contender
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.results import RequestLog, SimResult, TickRecord
from fleet.tracesim.workload import (
    FleetSizing,
    Workload,
    jitter_arrivals,
    replica_capacity_per_s,
    scale_rate,
)
from fleet.tracesim.traces import Trace, TraceRequest

# A small, slow replica: every step costs 50 ms, at most 4 requests in a batch. A request of
# 64 prompt tokens and 8 output tokens takes 8 steps; one replica completes ~10 requests/s.
TINY = Profile(
    name="test-tiny", model="tiny", hardware="none (unit tests)",
    config=EngineConfig(max_num_seqs=4, max_num_batched_tokens=512, block_size=16, num_gpu_blocks=512,
                        max_model_len=4096),
    cost=StepCost(fixed_s=0.05), typical_startup_s=0.0, notes="test profile",
)  # fmt: skip


def trace_of(*phases: tuple[float, float], prompt: int = 64, output: int = 8) -> Trace:
    """Evenly spaced arrivals: ``(seconds, requests per second)`` per phase, one after another."""
    out, t0 = [], 0.0
    for seconds, rate in phases:
        n = round(seconds * rate)
        out += [TraceRequest(t0 + i / rate, prompt, output) for i in range(n)]
        t0 += seconds
    return Trace("synthetic", tuple(out))


BURST = trace_of((60, 2.0), (60, 30.0), (600, 2.0))   # quiet minute, a 60 s burst at ~3 replicas' worth, quiet


def fleet_spec(**kw: object) -> AutoscalingSpec:
    """Fleet's policy on short windows, so a test hour is a few simulated minutes."""
    return AutoscalingSpec(**{"window_seconds": 10, "interval_seconds": 2, "scale_down_stabilization_seconds": 60,
                              "trend_window_seconds": 20, "warm_startup_seconds": 10, **kw})  # type: ignore[arg-type]


ONE_TO_SIX = ReplicaBounds(1, 6, 1)


def config(spec: AutoscalingSpec, bounds: ReplicaBounds = ONE_TO_SIX, **kw: object) -> SimConfig:
    return SimConfig(TINY, spec, bounds, **{"warm_startup_s": 10.0, "cold_startup_s": 40.0, **kw})  # type: ignore[arg-type]


def simulate(cfg: SimConfig, trace: Trace = BURST) -> tuple[Simulation, SimResult]:
    sim = Simulation(cfg, Workload.from_trace(trace, TINY))
    return sim, sim.run()


def keda_drain_config(**kw: object) -> SimConfig:
    """KEDA on engine waiting, scaling down at once: drains happen while long requests run."""
    spec = AutoscalingSpec(policy="keda-queue", scale_down_stabilization_seconds=0, max_scale_down_rate=1000)
    return config(spec, ReplicaBounds(1, 4, 1), **kw)


# One 15 s request a second (300 steps of 50 ms): about 15 in flight, so KEDA keeps asking for
# 4 replicas while engines queue, and drops to 1 whenever no engine has a waiting request, draining
# replicas that still run requests.
LONG = trace_of((120, 1.0), output=300)


def test_a_draining_replica_finishes_its_requests_and_nothing_fails() -> None:
    sim, result = simulate(keda_drain_config(), LONG)
    drained = [r for r in sim.replicas if r.drain_s is not None]
    assert drained, "the scenario must drain a replica"
    log = result.requests
    waited = 0
    for r in drained:
        mine = [i for i, k in enumerate(log.replica) if k == r.index]
        assert r.stopped_s is not None and all(log.end_s[i] <= r.stopped_s + 1e-9 for i in mine)
        assert not any(log.dispatch_s[i] > r.drain_s for i in mine), "no new request after the drain began"
        waited += r.stopped_s > r.drain_s
    assert waited, "some replica had requests in flight when its drain began"
    assert result.summary().failed == 0 and not any(log.failed)


def test_requests_still_running_at_the_drain_timeout_are_cut_off_and_count_as_failed() -> None:
    sim, result = simulate(keda_drain_config(drain_timeout_s=2.0), LONG)
    log = result.requests
    cut = [i for i, lost in enumerate(log.failed) if lost]
    assert cut, "the 2 s drain timeout must cut some 15 s request off"
    for i in cut:
        r = sim.replicas[log.replica[i]]
        assert r.drain_s is not None and log.end_s[i] == pytest.approx(r.drain_s + 2.0)
        assert math.isnan(log.first_token_s[i]) or log.first_token_s[i] <= log.end_s[i]
    assert result.summary().failed == len(cut)
    assert all(r.endpoint.in_flight == 0 for r in sim.replicas)


def test_the_fixed_baseline_never_scales() -> None:
    sim, result = simulate(config(AutoscalingSpec(policy="fixed"), ReplicaBounds(2, 2, 2)))
    assert {t.desired for t in result.ticks} == {2} and {t.ready for t in result.ticks} == {2}
    assert len(sim.replicas) == 2 and not result.startups
    s = result.summary()
    assert s.scaling_actions == 0 and s.max_replicas == 2
    assert s.replica_hours == pytest.approx(2 * result.horizon_s / 3600)
    assert s.within_slo < 1.0  # two replicas are too few for the burst: the fleet did not grow anyway


def test_one_request_on_an_idle_replica_takes_one_prefill_step() -> None:
    trace = Trace("one", (TraceRequest(0.0, 64, 3), TraceRequest(10.0, 64, 3)))
    _, result = simulate(config(AutoscalingSpec(policy="fixed")), trace)
    log = result.requests
    assert [f - a for a, f in zip(log.arrival_s, log.first_token_s)] == pytest.approx([0.05, 0.05])
    assert [e - a for a, e in zip(log.arrival_s, log.end_s)] == pytest.approx([0.15, 0.15])  # 3 steps
    assert result.summary().ttft_p99_s == pytest.approx(0.05)


def test_the_admission_queue_holds_requests_for_a_joining_replica_and_times_out() -> None:
    # One request at a time per replica, a 1 s queue timeout: most of a 40 req/s second fails.
    cfg = config(AutoscalingSpec(policy="fixed"), max_concurrency_per_endpoint=1, queue_timeout_s=1.0)
    _, result = simulate(cfg, trace_of((1, 40.0), output=8))
    log = result.requests
    assert log.replica[0] == 0 and log.dispatch_s[0] == 0.0
    served = [i for i, lost in enumerate(log.failed) if not lost]
    # One request every 0.4 s (8 steps of 50 ms): those dispatched within the 1 s timeout are served.
    assert all(log.dispatch_s[i] - log.arrival_s[i] <= 1.0 + 1e-9 for i in served)
    assert 3 <= len(served) < 10 and result.summary().failed == 40 - len(served)
    # FCFS: served requests were dispatched in arrival order.
    assert [log.dispatch_s[i] for i in served] == sorted(log.dispatch_s[i] for i in served)


def decision(at_s: float, previous: int, desired: int) -> ScalingDecision:
    return ScalingDecision(at_s, previous, desired, "test", "")


def test_summary_metrics_on_a_hand_checked_case() -> None:
    # Ten requests, one per second; TTFTs 0.1 .. 0.9 s and 3.0 s; request 9 failed instead.
    log = RequestLog([float(i) for i in range(10)])
    ttfts = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 3.0]
    for i, t in enumerate(ttfts):
        log.first_token_s[i] = i + t
        log.end_s[i] = i + t + 1.0
    log.failed[9] = True
    ticks = [TickRecord(0.0, 1, 1, 0, 0, decision(0.0, 1, 1)), TickRecord(5.0, 3, 1, 2, 0, decision(5.0, 1, 3)),
             TickRecord(10.0, 2, 2, 0, 1, decision(10.0, 3, 2)), TickRecord(15.0, 2, 2, 0, 0, decision(15.0, 2, 2))]
    result = SimResult(name="hand", policy="fleet", ttft_slo_s=0.5, requests=log, ticks=ticks, horizon_s=3600.0,
                       end_s=20.0, replica_cost_s=5400.0)  # fmt: skip
    s = result.summary()
    assert s.requests == 10 and s.failed == 1
    assert s.within_slo == pytest.approx(0.5)  # 0.1..0.5 s: 5 of 10 (the failed one and 3.0 s miss)
    assert s.ttft_p50_s == pytest.approx(0.5)  # nearest rank: the 5th of 9 answered
    assert s.ttft_p99_s == pytest.approx(3.0)  # the 9th of 9
    assert s.replica_hours == pytest.approx(1.5) and s.mean_replicas == pytest.approx(1.5)
    assert (s.scale_ups, s.scale_downs, s.scaling_actions, s.max_replicas) == (1, 1, 2, 3)
    tl = result.timeline(bin_s=5.0)
    assert tl["arrivals_per_s"][:2] == [1.0, 1.0]
    assert tl["ttft_p99_s"][:2] == pytest.approx([0.5, 3.0]) and tl["failed"][:2] == [0, 1]
    assert tl["within_slo"][:2] == pytest.approx([1.0, 0.0])
    assert math.isnan(tl["ttft_p99_s"][2])  # no request arrived in 10..15 s
    doc = result.to_dict(timeline_bin_s=5.0)
    assert doc["timeline"]["ttft_p99_s"][2] is None  # JSON has no NaN
    assert [(a["previous"], a["desired"]) for a in doc["scaling_actions"]] == [(1, 3), (3, 2)]


def test_rate_scale_keeps_the_time_axis_and_multiplies_every_gap() -> None:
    base = trace_of((10, 1.0), (5, 4.0))
    scaled = scale_rate(base, 3, seed=1)
    assert len(scaled.requests) == 3 * len(base.requests)
    assert scaled.duration_s == base.duration_s
    times = [r.arrival_s for r in scaled.requests]
    assert times == sorted(times)
    for a, b in zip(base.requests, base.requests[1:]):
        assert sum(a.arrival_s <= t < b.arrival_s for t in times) == 3
    with pytest.raises(ValueError, match="rate scale"):
        scale_rate(base, 0)


def test_arrival_jitter_delays_each_arrival_by_less_than_its_bound_and_swaps_only_close_ones() -> None:
    base = Trace("t", tuple(TraceRequest(t, 64 + i, 8) for i, t in enumerate([0.0, 0.001, 0.002, 1.0, 2.0, 2.004])))
    moved = jitter_arrivals(base, 0.01, seed=3)
    times = [r.arrival_s for r in moved.requests]
    assert times == sorted(times) and len(times) == len(base.requests)
    by_prompt = {r.prompt_tokens: r.arrival_s for r in moved.requests}
    assert all(0 <= by_prompt[r.prompt_tokens] - r.arrival_s < 0.01 for r in base.requests)
    order = [r.prompt_tokens for r in moved.requests]
    assert set(order[:3]) == {64, 65, 66} and order[3] == 67 and set(order[4:]) == {68, 69}
    draws = {tuple(r.prompt_tokens for r in jitter_arrivals(base, 0.01, seed=s).requests) for s in range(20)}
    assert len(draws) > 1                                  # close arrivals do swap
    assert jitter_arrivals(base, 0.01, seed=3) == moved    # the same draw for the same seed
    assert jitter_arrivals(base, 0.0) is base
    with pytest.raises(ValueError, match="jitter"):
        jitter_arrivals(base, -0.001)


def test_contenders_share_everything_but_the_policy() -> None:
    base = config(fleet_spec(), ReplicaBounds(1, 6, 2), max_concurrency_per_endpoint=8)
    sizing = FleetSizing(capacity_per_s=10.0, mean_rate_per_s=12.0, peak_rate_per_s=31.0)
    rows = [contender(base, n, sizing) for n in COMPARE]
    assert [c.label for c in rows] == ["fleet", "fixed-peak (4)", "fixed-mean (2)", "keda-queue", "kpa"]
    assert rows[0].autoscaling is base.autoscaling  # the deployment's own spec, as written
    assert rows[3].autoscaling.max_scale_down_rate == 1000  # HPA: no scale-down rate limit
    assert rows[1].bounds == ReplicaBounds(4, 4, 4) and rows[4].bounds == base.bounds
    assert {(c.max_concurrency_per_endpoint, c.warm_startup_s, c.profile.name) for c in rows} == {(8, 10.0, "test-tiny")}
    assert contender(base, "fixed-3").bounds == ReplicaBounds(3, 3, 3)
    with pytest.raises(ValueError, match="unknown contender 'hpa'"):
        contender(base, "hpa")


def test_capacity_and_sizing_of_the_tiny_replica() -> None:
    workload = Workload.from_trace(BURST, TINY)
    capacity = replica_capacity_per_s(workload.trace, TINY)
    assert capacity == pytest.approx(4 / (8 * 0.05), rel=0.05)  # 4 requests per 8 steps of 50 ms
    sizing = workload.sizing(capacity)
    assert (sizing.peak, sizing.mean) == (3, 1)  # 30 req/s busiest minute; 3.9 req/s on average
