"""`fleet simulate` end to end on a small trace file: the table, --json, --plot, and clear errors for
a bad trace path, a malformed trace, a deployment without a simulator profile and an unknown
contender (fleet.cli, fleet.tracesim). The contenders run in worker processes:
tests/integration/test_simulate_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fleet.cli import app
from fleet.tracesim.traces import Trace, TraceRequest, write_jsonl

runner = CliRunner()

DEPLOYMENT = """\
apiVersion: fleet.inference.dev/v1alpha1
kind: InferenceDeployment
metadata: {name: small}
spec:
  model: {name: tiny, source: "sim://cpu-tiny-llama"}
  engine: {kind: sim}
  resources: {accelerator: cpu}
  replicas: {min: 1, max: 4, initial: 1}
  autoscaling: {policy: fleet, windowSeconds: 10, intervalSeconds: 2, scaleDownStabilizationSeconds: 30}
"""


def write_files(tmp_path: Path) -> tuple[Path, Path]:
    """A two-minute trace with a 20 s burst, and the deployment above, written in ``tmp_path``."""
    reqs = [TraceRequest(i * 0.5, 200, 16) for i in range(80)]                      # 2 req/s for 40 s
    reqs += [TraceRequest(40 + i * 0.02, 200, 16) for i in range(1000)]             # 50 req/s for 20 s
    reqs += [TraceRequest(60 + i * 0.5, 200, 16) for i in range(120)]               # 2 req/s for 60 s
    trace = tmp_path / "small.jsonl"
    write_jsonl(Trace("small", tuple(reqs)), trace)
    dep = tmp_path / "dep.yaml"
    dep.write_text(DEPLOYMENT)
    return trace, dep


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    return write_files(tmp_path)


def test_a_missing_trace_file_is_named(files: tuple[Path, Path], tmp_path: Path) -> None:
    _, dep = files
    missing = tmp_path / "nope.csv"
    result = runner.invoke(app, ["simulate", str(missing), "-d", str(dep)])
    assert result.exit_code == 2
    assert f"{missing}: cannot read" in result.output


def test_a_malformed_trace_names_the_line_and_field(files: tuple[Path, Path], tmp_path: Path) -> None:
    _, dep = files
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,100,10\n"
                   "2023-11-16 18:17:04.03,many,8\n")  # fmt: skip
    result = runner.invoke(app, ["simulate", str(bad), "-d", str(dep)])
    assert result.exit_code == 2
    assert f"{bad}:3 ContextTokens: must be an integer >= 1, got 'many'" in result.output


def test_a_deployment_without_a_simulator_profile_is_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, _ = files
    dep = tmp_path / "real.yaml"
    dep.write_text(DEPLOYMENT.replace('source: "sim://cpu-tiny-llama"', "source: /models/llama")
                   .replace("engine: {kind: sim}", "engine: {kind: vllm}"))  # fmt: skip
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep)])
    assert result.exit_code == 2
    assert "spec.model.source '/models/llama' is not a simulator profile" in result.output and "--profile" in result.output
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--profile", "h200-nope"])
    assert result.exit_code == 2 and "unknown simulator profile 'h200-nope'" in result.output


def test_an_unknown_contender_and_an_invalid_spec_are_refused(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, dep = files
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fleet,hpa"])
    assert result.exit_code == 2 and "unknown contender 'hpa'" in result.output
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--plot", str(tmp_path / "no" / "x.png")])
    assert result.exit_code == 2 and f"directory {tmp_path / 'no'} does not exist" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text(DEPLOYMENT.replace("max: 4", "max: 0"))
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(bad)])
    assert result.exit_code == 2 and "spec.replicas.max" in result.output


ROOT = Path(__file__).resolve().parents[2]


def test_standby_max_gives_the_standby_policy_a_pool_and_the_table_counts_it(files: tuple[Path, Path],
                                                                             tmp_path: Path) -> None:  # fmt: skip
    trace, dep = files
    out_json = tmp_path / "out.json"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "standby",
                                 "--standby-max", "1", "--wake-s", "2", "--json", str(out_json), "-j", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "up to 1 standby, wake 2 s" in result.output and "of which standby" in result.output
    (run,) = json.loads(out_json.read_text())["results"]
    assert run["params"]["standby"] == {"max": 1, "wake_s": 2.0}
    assert 0 < run["summary"]["standby_hours"] < run["summary"]["replica_hours"]


def test_history_primes_the_forecast_of_standby_forecast(files: tuple[Path, Path], tmp_path: Path) -> None:
    trace, dep = files
    out_json = tmp_path / "out.json"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "standby-forecast",
                                 "--history", str(trace), "--history", str(trace), "--json", str(out_json),
                                 "-j", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    (run,) = json.loads(out_json.read_text())["results"]
    assert run["name"] == "standby-forecast" and run["params"]["autoscaling"]["forecast"]["binSeconds"] == 1800
    assert run["params"]["history_s"] == 7200.0   # two traces of two minutes, each an hour once rounded


def test_each_policy_is_held_to_the_hindsight_optimum_and_the_best_fixed_fleet(files: tuple[Path, Path],
                                                                               tmp_path: Path) -> None:  # fmt: skip
    trace, dep = files
    out_json = tmp_path / "out.json"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fleet,fixed-1,fixed-4",
                                 "--warm-startup-s", "10", "--json", str(out_json), "-j", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "hindsight-optimal schedule:" in result.output and "x hindsight" in result.output
    doc = json.loads(out_json.read_text())
    sticks = doc["hindsight"]
    optimum_h = sticks["optimum"]["replica_hours"]
    assert sticks["within_slo_share"] == 0.99 and sticks["startup_s"] == 10.0
    assert 0 < optimum_h <= sticks["best_fixed_model"]["replica_hours"]
    assert sticks["optimum"]["within_slo_model"] >= 0.99
    by_name = {r["name"]: r["summary"] for r in doc["results"]}
    kept = [s["replica_hours"] for s in by_name.values() if s["within_slo"] >= 0.99 and s["name"].startswith("fixed")]
    best_fixed_h = min(kept) if kept else sticks["best_fixed_model"]["replica_hours"]
    fleet_h = by_name["fleet"]["replica_hours"]
    assert f"{fleet_h / optimum_h:.2f}x" in result.output and f"{fleet_h / best_fixed_h:.2f}x" in result.output
    off = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fixed-1", "--no-hindsight",
                              "-j", "1"])  # fmt: skip
    assert off.exit_code == 0 and "hindsight" not in off.output
