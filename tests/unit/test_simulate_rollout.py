"""Canary rollouts in the trace simulator (fleet.tracesim.rollout) on a short synthetic workload:
the real split, state machine and judges decide; a good canary is promoted, slow and failing
ones are rolled back by Fleet's analysis, a canary without traffic is never promoted by it, and
the baselines show the failure modes they are known for."""

from __future__ import annotations

import pytest

from fleet.enginesim.profiles import get_profile
from fleet.tracesim.rollout import CanaryVariant, RolloutSimConfig, RolloutSimulation, abs_p99_threshold
from fleet.tracesim.workload import Workload
from fleet.tracesim.traces import Trace, TraceRequest
from fleet.rollout.spec import AnalysisSpec, RolloutSpec, RolloutStep, StepAnalysis

PROFILE = get_profile("h100-llama-8b")
SPEC = RolloutSpec(strategy="canary", steps=[
    RolloutStep(weight=25), RolloutStep(analysis=StepAnalysis()), RolloutStep(weight=50),
    RolloutStep(analysis=StepAnalysis())],
    analysis=AnalysisSpec(interval_seconds=30, min_samples_per_side=30, exclude_after_ready_seconds=5))


def workload(rate_per_s: float = 8.0, duration_s: float = 420.0) -> Workload:
    n = int(rate_per_s * duration_s)
    reqs = tuple(TraceRequest(i / rate_per_s, 300 + (i * 7919) % 900, 60 + (i * 104729) % 200) for i in range(n))
    return Workload.from_trace(Trace("synthetic", reqs), PROFILE)


WL = workload()


def run(variant: CanaryVariant, judge: str = "fleet", threshold_s: float | None = None):
    cfg = RolloutSimConfig(PROFILE, 4, SPEC, judge, variant, threshold_s=threshold_s, rollout_start_s=60.0,
                           canary_startup_s=20.0, max_rollout_s=300.0)  # fmt: skip
    return RolloutSimulation(cfg, WL).run()


def test_an_identical_canary_is_promoted_after_every_step():
    out = run(CanaryVariant("identical"))
    assert out.decision == "promoted" and out.correct
    assert out.verdicts == ["pass", "pass"] and out.canary_failed == 0
    assert 60.0 <= out.decided_after_s <= 120.0             # two 30 s windows after the canary was READY
    # 8 requests/s: 25 % from READY (20 s) until the second canary replica is READY (70 s), then 50 %.
    assert out.canary_requests == pytest.approx(8 * (50 * 0.25 + 10 * 0.5), rel=0.05)


def test_the_absolute_threshold_comes_from_stable_before_the_rollout():
    cfg = RolloutSimConfig(PROFILE, 4, SPEC, "abs-p99", CanaryVariant("identical"), rollout_start_s=60.0)
    threshold_s = abs_p99_threshold(WL, cfg)
    assert 0.5 < threshold_s < 30.0
