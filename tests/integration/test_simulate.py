"""The trace simulator's parallel runs: worker processes give the serial results (fleet.tracesim);
the rest of the simulator is in tests/unit/test_simulate.py."""

from __future__ import annotations

from dataclasses import replace

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig
from fleet.enginesim.profiles import Profile
from fleet.tracesim.compare import contender, run_comparison
from fleet.tracesim.engine import SimConfig
from fleet.tracesim.workload import (
    Workload,
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


def fleet_spec(**kw: object) -> AutoscalingSpec:
    """Fleet's policy on short windows, so a test hour is a few simulated minutes."""
    return AutoscalingSpec(**{"window_seconds": 10, "interval_seconds": 2, "scale_down_stabilization_seconds": 60,
                              "trend_window_seconds": 20, "warm_startup_seconds": 10, **kw})  # type: ignore[arg-type]


ONE_TO_SIX = ReplicaBounds(1, 6, 1)


def config(spec: AutoscalingSpec, bounds: ReplicaBounds = ONE_TO_SIX, **kw: object) -> SimConfig:
    return SimConfig(TINY, spec, bounds, **{"warm_startup_s": 10.0, "cold_startup_s": 40.0, **kw})  # type: ignore[arg-type]


def test_parallel_runs_give_the_serial_results() -> None:
    workload = Workload.from_trace(trace_of((20, 2.0), (20, 25.0), (60, 2.0)), TINY)
    configs = [replace(config(fleet_spec()), name="fleet"), contender(config(fleet_spec()), "kpa")]
    seen: list[tuple[int, int]] = []
    serial = run_comparison(configs, workload, jobs=1)
    parallel = run_comparison(configs, workload, jobs=2, progress=lambda i, now_s, done, total: seen.append((i, done)))
    assert [r.summary() for r in serial] == [r.summary() for r in parallel]
    assert {i for i, _ in seen} == {0, 1} and (0, len(workload.requests)) in seen
