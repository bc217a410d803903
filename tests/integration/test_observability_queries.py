"""promtool checks the shipped rules files and runs the rules' unit tests
(tests/data/observability/fleet-rules.test.yaml), and evaluates the dashboard's cost row over
series of known cost; the lint itself is in tests/unit/test_observability_queries.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fleet.observability.rules import alerts, kubernetes_alerts, recording_rules
from tests.unit.test_observability_queries import CHART_RULES, DOCS, REPO  # the subject's helpers live in its unit file

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian package prometheus; .ci/prometheus.sh installs it)",
)


@needs_promtool
@pytest.mark.parametrize("path, extra", [(DOCS / "fleet-rules.yaml", 0), (CHART_RULES, len(kubernetes_alerts()))])
def test_promtool_checks_the_rules(path: Path, extra: int) -> None:
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts()) + len(recording_rules()) + extra} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    result = subprocess.run(["promtool", "test", "rules", "tests/data/observability/fleet-rules.test.yaml"],
                            capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    tested = yaml.safe_load((REPO / "tests/data/observability/fleet-rules.test.yaml").read_text())
    alerted = {t["alertname"] for case in tested["tests"] for t in case.get("alert_rule_test", [])}
    assert alerted == {a.name for a in [*alerts(), *kubernetes_alerts()]}  # every alert has a unit test


@needs_promtool
def test_promtool_evaluates_the_cost_row_to_the_figures_of_known_series(tmp_path: Path) -> None:
    """The cost row's own queries (fleet/observability/dashboard.py), evaluated by promtool over
    series whose cost is known: deployment chat holds 2 serving GPUs and 1 standby GPU (6 USD per
    GPU-hour), its model's router counts 1,000 output tokens/s, its two GPUs are 50 % busy from
    minute 6 (an unassigned GPU at 100 % is not its); deployment code has tokens and no GPUs."""
    from fleet.observability.dashboard import rows
    from fleet.observability.promql import grafana_to_promql

    panels = {p.title: [q.expr for q in p.queries] for row, ps in rows() if row == "Cost and GPU use" for p in ps}
    gpu_s = 'fleet_gpu_seconds_allocated_total{deployment="chat", revision="v1", product="H100", state="%s"}'
    series = {
        gpu_s % "serving": "0+120x10", gpu_s % "standby": "0+60x10",   # GPU-seconds per minute: 2 and 1 GPUs
        'fleet_gpu_price_usd_per_hour{product="H100"}': "6x10",
        'fleet_router_generation_tokens_total{model="chat-model", version="v1@abc"}': "0+60000x10",
        'fleet_router_generation_tokens_total{model="code-model", version="v1@def"}': "0+6000x10",
        'fleet_deployment_info{deployment="chat", model="chat-model"}': "1x10",
        'fleet_deployment_info{deployment="code", model="code-model"}': "1x10",
        'DCGM_FI_DEV_GPU_UTIL{deployment="chat", replica="chat-0", gpu="0"}': "_x6 50x4",
        'DCGM_FI_DEV_GPU_UTIL{deployment="chat", replica="chat-0", gpu="1"}': "_x6 50x4",
        'DCGM_FI_DEV_GPU_UTIL{deployment="", replica="", gpu="2"}': "100x10",
    }
    chat = '{deployment="chat"}'
    expected = {   # panel -> per query: {labels: value} at 10 m, $__rate_interval and $__range 5 m
        "Cost per hour (USD)": [{chat: 18}],                                       # 3 GPUs x 6 USD
        "Cost per 1M output tokens (USD)": [{chat: 5}],                            # 18 USD / 3.6 M tokens an hour
        "GPUs allocated vs busy": [{'{deployment="chat", state="serving"}': 2, '{deployment="chat", state="standby"}': 1},
                                   {chat: 1}],                                     # 2 GPUs at 50 %
        "GPU-hours in the time range: allocated vs busy": [   # 5 minutes: 2 GPUs, 1 GPU; 1 busy GPU for 5 samples
            {'{deployment="chat", state="serving"}': 0.1667, '{deployment="chat", state="standby"}': 0.0833},
            {chat: 0.0833}],
        "Standby share of GPU time": [{chat: 0.3333}],
    }
    assert set(expected) == set(panels)
    tests = []
    for title, exprs in panels.items():
        for expr, samples in zip(exprs, expected[title], strict=True):
            at_1m = expr.replace("$__interval_ms", "60000").replace("$__interval", "1m")   # the panel's step
            tests.append({"expr": f"round({grafana_to_promql(at_1m, rate_interval='5m')}, 0.0001)", "eval_time": "10m",
                          "exp_samples": [{"labels": labels, "value": value} for labels, value in samples.items()]})
    doc = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "promql_expr_test": tests}]}
    (tmp_path / "cost.test.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    result = subprocess.run(["promtool", "test", "rules", "cost.test.yaml"], capture_output=True, text=True,
                            cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
