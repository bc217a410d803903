"""Canary rollouts in the trace simulator, the long runs: slow and failing canaries are rolled
back by Fleet's analysis, a canary without traffic is never promoted by it, and `fleet
simulate-rollout` prints its table (the short cases: tests/unit/test_simulate_rollout.py)."""

from __future__ import annotations

import pytest

from fleet.tracesim.rollout import CanaryVariant
from tests.unit.test_simulate_rollout import WL, run  # the subject's helpers live in its unit file


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
