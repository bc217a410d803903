"""The PromQL lint (fleet/observability/promql.py), the dashboard (dashboard.py) and the rules
(rules.py): every shipped query passes the lint and the shipped files are the generated ones.
promtool checking and unit-testing the rules is in tests/integration/test_observability_queries.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleet.cli import app
from fleet.observability.dashboard import (
    QUANTILES,
    build_dashboard,
    panel_queries,
    render_dashboard,
)
from fleet.observability.promql import PromQLSyntaxError, grafana_to_promql, lint
from fleet.observability.rules import SLO, alerts, kubernetes_alerts, recording_rules, render_rules

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "observability"
CHART_RULES = REPO / "charts" / "fleet" / "files" / "fleet-rules.yaml"
CHART_DASHBOARD = REPO / "charts" / "fleet" / "dashboards" / "fleet-dashboard.json"
REGENERATE = ("regenerate them: `fleet dashboard > docs/observability/fleet-dashboard.json; "
              "cp docs/observability/fleet-dashboard.json charts/fleet/dashboards/; "
              "fleet rules > docs/observability/fleet-rules.yaml; "
              "fleet rules --kubernetes > charts/fleet/files/fleet-rules.yaml` "
              "(or run this test with FLEET_UPDATE_GOLDEN=1), then review the diff")


@pytest.mark.parametrize("expr, problem", [
    ("vllm:e2e_request_latency_seconds_sum / vllm:e2e_request_latency_seconds_count", "counter"),  # lifetime avg
    ("sum(fleet_router_requests_total)", "counter"),
    ("sum_over_time(fleet_router_requests_total[5m])", "counter range"),
    ("histogram_quantile(0.99, rate(x_bucket[5m]))", "aggregate the buckets"),
    ("histogram_quantile(0.99, sum by (model) (rate(x_bucket[5m])))", "summed by (le"),
    ("histogram_quantile(0.99, sum without (le) (rate(x_bucket[5m])))", "summed by (le"),
    ("histogram_quantile(0.99, max by (le) (rate(x_bucket[5m])))", "summed by (le"),
])  # fmt: skip


def test_the_lint_rejects_the_anchors_mistakes(expr: str, problem: str) -> None:
    problems = lint(expr)
    assert problems and any(problem in p for p in problems), problems


@pytest.mark.parametrize("expr", [
    "rate(vllm:e2e_request_latency_seconds_sum[5m]) / rate(vllm:e2e_request_latency_seconds_count[5m])",
    "histogram_quantile(0.99, sum by (le, model) (rate(x_bucket[5m])))",
    "histogram_quantile(0.5, (sum without (endpoint) (rate(x_bucket[5m]))))",
    "increase(fleet_autoscaler_decisions_total[1h]) > 0",
    "vllm:num_requests_running",
])  # fmt: skip


def test_the_lint_accepts_correct_queries(expr: str) -> None:
    assert lint(expr) == []


def test_the_lint_reports_a_syntax_error() -> None:
    with pytest.raises(PromQLSyntaxError, match="sum by"):
        lint("sum by (le (rate(x[5m]))")


def test_grafana_variables_become_promql() -> None:
    q = 'rate(x{a=~"$model", b=~"${replica}"}[$__rate_interval])'
    assert grafana_to_promql(q) == 'rate(x{a=~".*", b=~".*"}[1m])'
    assert grafana_to_promql(q, {"model": "m"}, "30s") == 'rate(x{a=~"m", b=~".*"}[30s])'
    # the interval and range as numbers (a subquery's samples x their spacing)
    assert grafana_to_promql("sum_over_time(x[$__range:$__interval]) * $__interval_ms / $__range_s", None,
                             "20s") == "sum_over_time(x[20s:20s]) * 20000 / 20"  # fmt: skip


def test_every_dashboard_query_and_every_rule_passes_the_lint() -> None:
    queries = [(t, grafana_to_promql(q)) for t, q in panel_queries(build_dashboard())]
    queries += [(r.record, r.expr) for r in recording_rules()]
    queries += [(a.name, q) for a in [*alerts(), *kubernetes_alerts()] for q in (a.expr, *a.data_exprs)]
    bad = {name: lint(q) for name, q in queries if lint(q)}
    assert not bad, bad


def test_the_shipped_files_are_the_generated_ones() -> None:
    """The dashboard and rules under docs/ and in the chart (its dashboards ConfigMap and its
    PrometheusRule read them) are what the generators make: a changed panel or rule that was not
    regenerated fails here."""
    shipped = {
        DOCS / "fleet-dashboard.json": render_dashboard(),
        CHART_DASHBOARD: render_dashboard(),
        DOCS / "fleet-rules.yaml": render_rules(),
        CHART_RULES: render_rules(kubernetes=True),
    }
    if os.environ.get("FLEET_UPDATE_GOLDEN") == "1":
        for path, text in shipped.items():
            path.write_text(text)
    stale = [str(p.relative_to(REPO)) for p, text in shipped.items() if not p.exists() or p.read_text() != text]
    assert not stale, f"stale generated files {stale}: {REGENERATE}"
    assert sorted(p.name for p in CHART_DASHBOARD.parent.glob("*.json")) == ["fleet-dashboard.json"]


def test_the_charts_rules_are_the_plain_rules_and_the_cluster_group() -> None:
    plain = yaml.safe_load(render_rules())["groups"]
    chart = yaml.safe_load(render_rules(kubernetes=True))["groups"]
    assert chart[:-1] == plain
    assert chart[-1]["name"] == "fleet-kubernetes"
    assert [r["alert"] for r in chart[-1]["rules"]] == [a.name for a in kubernetes_alerts()] == ["FleetOperatorDown"]


def test_the_dashboard_covers_tail_latency_per_deployment_version_and_endpoint() -> None:
    doc = build_dashboard()
    variables = [v["name"] for v in doc["templating"]["list"]]
    assert variables == ["datasource", "deployment", "model", "version", "replica", "node"]
    panels = {p["title"]: p for p in doc["panels"] if p["type"] != "row"}
    for title in ("Time to first token (streamed, router)", "Time per output token (streamed, router)",
                  "Time to first byte (router)", "End-to-end latency (router)", "Queue time (router admission queue)",
                  "Engine time to first token"):  # fmt: skip
        exprs = [t["expr"] for t in panels[title]["targets"]]
        assert [e.split(",")[0] for e in exprs] == [f"histogram_quantile({q}" for _, q in QUANTILES], title
        assert all("$__rate_interval" in e and "sum by (le" in e for e in exprs), title
    for title in ("Time to first token (streamed, router)", "Time per output token (streamed, router)",
                  "Time to first byte (router)", "End-to-end latency (router)"):  # fmt: skip
        # canary vs stable: split by the version label, filtered by every template variable
        assert all("sum by (le, version)" in t["expr"] and 'version=~"$version(@.*)?"' in t["expr"]
                   and 'endpoint=~"$replica"' in t["expr"] for t in panels[title]["targets"]), title  # fmt: skip
    assert {"Requests by code", "Error ratio (5xx)", "Requests in flight", "Admission queue length", "Rejections",
            "Requests within the TTFT SLO (1 s)", "TTFT SLO burn rate", "Replicas by state",
            "Autoscaler: desired vs ready", "Running and waiting requests", "KV-cache usage",
            "Prefix cache hit rate", "Preemptions", "GPU health checks failing", "Quarantined GPUs",
            "Quarantine decisions", "Xid events"} <= set(panels)  # fmt: skip
    gpu = [t["expr"] for title in ("GPU health checks failing", "Quarantined GPUs", "Quarantine decisions")
           for t in panels[title]["targets"]]  # fmt: skip
    assert all('node=~"$node"' in e for e in gpu) and "by (node, gpu, check, severity)" in gpu[0]
    assert [a["name"] for a in doc["annotations"]["list"]] == ["Scaling decisions"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels.values())
    ids = [p["id"] for p in doc["panels"]]
    assert len(set(ids)) == len(ids) == len(doc["panels"]) and all(isinstance(i, int) and i > 0 for i in ids)


def test_the_slo_threshold_must_be_a_bucket_bound_and_objectives_fractions() -> None:
    with pytest.raises(ValueError, match="ttft_threshold_s: must be a bucket bound"):
        SLO(ttft_threshold_s=0.7)
    with pytest.raises(ValueError, match="ttft_objective: must be strictly between 0 and 1"):
        SLO(ttft_objective=1.0)
    assert 'le=~"2\\\\.5"' in render_rules(SLO(ttft_threshold_s=2.5))
    assert 'le=~"1|1\\\\.0"' in render_rules()  # Prometheus 3 writes le="1", 2 writes le="1.0"


def test_the_cli_prints_the_dashboard_rules_and_a_scrape_config(tmp_path: Path) -> None:
    runner = CliRunner()
    out = runner.invoke(app, ["dashboard"])
    assert out.exit_code == 0 and json.loads(out.stdout)["uid"] == "fleet-tail-latency"
    out = runner.invoke(app, ["rules", "--ttft-slo-seconds", "0.5"])
    assert out.exit_code == 0 and 'le=~"0\\\\.5"' in out.stdout
    out = runner.invoke(app, ["rules", "--ttft-slo-seconds", "0.7"])
    assert out.exit_code == 2 and "bucket bound" in out.output
    out = runner.invoke(app, ["prometheus-config", "--state-dir", str(tmp_path), "--scrape-interval", "2s"])
    assert out.exit_code == 0, out.output
    files = yaml.safe_load(out.stdout)["scrape_configs"][0]["file_sd_configs"][0]["files"]
    assert files == [str(tmp_path.resolve() / "prometheus-targets.json")]
