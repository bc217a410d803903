"""`fleet simulate` with several contenders, which it runs in worker processes: the policies pick
the contenders and the router limit can be overridden (tests/unit/test_simulate_cli.py: the rest)."""

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


def test_policies_pick_the_contenders_and_the_router_limit_can_be_overridden(files: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:  # fmt: skip
    trace, dep = files
    out_json = tmp_path / "out.json"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fixed-2,kpa",
                                 "--max-concurrency-per-endpoint", "4", "--json", str(out_json)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "│ fixed-2" in result.output and "│ kpa" in result.output and "│ fleet" not in result.output
    assert "4 per replica, then the router queue" in result.output
    doc = json.loads(out_json.read_text())
    assert {r["params"]["routing"]["max_concurrency_per_endpoint"] for r in doc["results"]} == {4}


