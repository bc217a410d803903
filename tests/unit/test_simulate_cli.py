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


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A two-minute trace with a 20 s burst, and the deployment above."""
    reqs = [TraceRequest(i * 0.5, 200, 16) for i in range(80)]                      # 2 req/s for 40 s
    reqs += [TraceRequest(40 + i * 0.02, 200, 16) for i in range(1000)]             # 50 req/s for 20 s
    reqs += [TraceRequest(60 + i * 0.5, 200, 16) for i in range(120)]               # 2 req/s for 60 s
    trace = tmp_path / "small.jsonl"
    write_jsonl(Trace("small", tuple(reqs)), trace)
    dep = tmp_path / "dep.yaml"
    dep.write_text(DEPLOYMENT)
    return trace, dep


def test_compare_prints_one_row_per_contender_and_writes_json_and_png(files: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:  # fmt: skip
    trace, dep = files
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--compare", "--policies", "fixed-3",
                                 "--jobs", "1", "--warm-startup-s", "5", "--json", str(out_json),
                                 "--plot", str(out_png)])  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Fleet trace SIMULATOR" in out and "1200 requests" in out
    assert "within 2 s TTFT" in out and "replica-hours" in out and "scaling actions" in out
    for row in ("fleet", "fixed-peak (", "fixed-mean (", "keda-queue", "kpa", "fixed-3"):
        assert f"│ {row}" in out, row
    doc = json.loads(out_json.read_text())
    names = [r["name"] for r in doc["results"]]
    assert names[0] == "fleet" and names[-1] == "fixed-3" and len(names) == 6
    fleet = doc["results"][0]
    assert fleet["summary"]["requests"] == 1200 and fleet["summary"]["failed"] == 0
    assert len(fleet["timeline"]["t_s"]) == 2 and fleet["timeline"]["arrivals_per_s"][0] > 0  # 60 s bins
    assert fleet["params"]["startup"]["warm_s"] == 5.0 and fleet["params"]["profile"] == "cpu-tiny-llama"
    assert doc["workload"]["trace"] == "small" and doc["sizing"]["peak"] >= 1
    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


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


def test_the_readme_code_figures_are_reproduced() -> None:
    """The autoscaling tables for the Azure `code` trace (docs/autoscaling.md, docs/benchmarks.md) come
    from loadtests/results/autoscaling-code.json; a fresh run of Fleet's row must give the same
    figures (a policy change that moves them must regenerate the table)."""
    recorded = json.loads((ROOT / "loadtests/results/autoscaling-code.json").read_text())
    want = next(r["summary"] for r in recorded["results"] if r["name"] == "fleet")
    result = runner.invoke(app, ["simulate", str(ROOT / "loadtests/traces/azure-llm-2023/code.csv"),
                                 "-d", str(ROOT / "examples/simulate-h100.yaml"), "--policies", "fleet",
                                 "--jobs", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("│ fleet"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[1] == f"{want['within_slo'] * 100:.1f}%"
    assert cells[2] == f"{want['ttft_p99_s']:.2f} s"
    assert cells[4] == f"{want['replica_hours']:.2f}"
    assert cells[5:] == [str(want["max_replicas"]), str(want["scaling_actions"]), str(want["failed"])]
