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


@pytest.mark.parametrize("variant", [
    CanaryVariant("ttft+60%", prefill_factor=1.6, bad=True),
    CanaryVariant("tpot+50%", decode_factor=1.5, bad=True),
    CanaryVariant("errors-5%", error_share=0.05, bad=True),
])
def test_a_bad_canary_is_rolled_back_by_fleets_analysis(variant):
    out = run(variant)
    assert out.decision == "rolled back" and out.correct, (out.verdicts, out.reason)
    assert out.verdicts == ["fail", "fail"]                 # failureLimit 1: the second failure decides


def test_a_canary_without_traffic_is_never_promoted_by_fleet_but_by_the_no_data_passes_baseline():
    silent = CanaryVariant("no-traffic", no_traffic=True, bad=True)
    fleet = run(silent)
    assert fleet.decision == "undecided" and set(fleet.verdicts) == {"inconclusive"} and fleet.canary_requests == 0
    assert run(silent, "abs-p99", threshold_s=60.0).decision == "promoted"
    assert run(silent, "success-rate").decision == "rolled back"


def test_the_absolute_threshold_comes_from_stable_before_the_rollout():
    cfg = RolloutSimConfig(PROFILE, 4, SPEC, "abs-p99", CanaryVariant("identical"), rollout_start_s=60.0)
    threshold_s = abs_p99_threshold(WL, cfg)
    assert 0.5 < threshold_s < 30.0


def test_fleet_simulate_rollout_prints_the_table_and_refuses_bad_names(tmp_path):
    import json

    from typer.testing import CliRunner

    from fleet.cli import app

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp_s": r.arrival_s, "prompt_tokens": r.prompt_tokens,
                                         "output_tokens": r.output_tokens}) + "\n"
                             for r in WL.requests[:2400]))  # fmt: skip
    deployment = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "canary-simulate.yaml")
    runner = CliRunner()
    out = tmp_path / "o.json"
    result = runner.invoke(app, ["simulate-rollout", str(trace), "-d", deployment, "--judges", "fleet",
                                 "--variants", "errors-2%", "--rollout-start-s", "60", "--canary-startup-s", "20",
                                 "--max-rollout-s", "200", "--json", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "errors-2%" in result.output and "rolled back" in result.output
    assert json.loads(out.read_text())[0]["decision"] == "rolled back"
    bad = runner.invoke(app, ["simulate-rollout", str(trace), "-d", deployment, "--judges", "argo",
                              "--variants", "slow"])  # fmt: skip
    assert bad.exit_code == 2
    assert "--variants: unknown 'slow'" in bad.output and "--judges: unknown 'argo'" in bad.output
