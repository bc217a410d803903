"""The chart's Prometheus objects (charts/fleet/templates/monitoring.yaml) and dashboards
ConfigMap, rendered by `helm template` with the Prometheus Operator's API: the PrometheusRule
carries the generated rule groups, the dashboards ConfigMap the generated dashboard, and every
target gets the labels `fleet up`'s file_sd gives it (fleet/observability/discovery.py), so the
shipped dashboard and rules read a cluster as they read one machine.

The relabelings are also run by a real Prometheus (Debian's package; `.ci/prometheus.sh`), over
file_sd targets carrying the meta labels Kubernetes service discovery would give an engine pod
and a router endpoint: what Prometheus attaches is checked, not only the YAML.

Helm comes from `.ci/helm.sh`; without helm (or Prometheus, for the last test) these skip."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import kubernetes_validate
import pytest
import yaml

from fleet.k8s.pods import ANNOTATION_REVISION, LABEL_DEPLOYMENT, LABEL_REPLICA, LABEL_REVISION, label_value
from fleet.observability.dashboard import render_dashboard
from fleet.observability.discovery import JOB_CONTROLLER, JOB_ENGINE, JOB_NODE_AGENT, JOB_ROUTER, file_sd_groups
from fleet.observability.rules import rules_document
from tests.support.helm import REPO, helm_binary, render
from tests.support.waits import wait_until

pytestmark = pytest.mark.skipif(helm_binary() is None, reason="helm not installed: run `bash .ci/helm.sh`")

MONITORING = [REPO / "examples" / "kubernetes" / "values-monitoring.yaml"]
API = ("monitoring.coreos.com/v1",)


def _objects(extra: tuple[str, ...] = ()) -> dict[tuple[str, str], dict]:
    """The chart's objects with the monitoring values (the node agent on: the default) and ``extra``
    arguments to ``helm template``, by (kind, name)."""
    return {(o["kind"], o["metadata"]["name"]): o for o in render(MONITORING, api_versions=API, extra=extra)}


def prometheus_label(pod_label: str, kind: str = "label") -> str:
    """The meta label Kubernetes service discovery gives a pod label (``kind`` "annotation": a
    pod annotation): every character outside [a-zA-Z0-9_] becomes ``_`` (Prometheus
    ``strutil.SanitizeLabelName``)."""
    return f"__meta_kubernetes_pod_{kind}_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def _relabel(endpoint: dict) -> dict[str, str]:
    """{target label: source meta label or the fixed replacement} of an endpoint's relabelings."""
    out = {}
    for r in endpoint.get("relabelings", []):
        if r.get("action", "replace") == "replace":
            out[r["targetLabel"]] = r["sourceLabels"][0] if "sourceLabels" in r else r["replacement"]
    return out


def test_the_prometheus_rule_carries_the_generated_groups() -> None:
    rule = _objects()[("PrometheusRule", "fleet")]
    assert rule["spec"] == rules_document(kubernetes=True)
    names = [g["name"] for g in rule["spec"]["groups"]]
    assert names == ["fleet-slo", "fleet-alerts", "fleet-kubernetes"]
    alerts = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"FleetTTFTBudgetBurnFast", "FleetNoReadyEndpoint", "FleetGpuQuarantineCapReached",
            "FleetOperatorDown"} <= set(alerts)  # fmt: skip
    # Prometheus's templates reach Prometheus as written (the file is not run through Helm's templating)
    assert alerts["FleetNoReadyEndpoint"]["annotations"]["summary"] == "{{ $labels.model }}: no ready endpoint"
    # nothing scrapes the operator without the ServiceMonitor: no absent() alert that would fire forever
    alone = _objects(extra=("--set", "monitoring.serviceMonitor.enabled=false"))[("PrometheusRule", "fleet")]
    assert alone["spec"] == rules_document(kubernetes=False)


def test_the_engine_pod_monitor_gives_the_file_sd_labels_from_the_operators_pod_labels() -> None:
    pm = _objects()[("PodMonitor", "fleet-engines")]
    assert pm["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "fleet-operator"}}
    [endpoint] = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    labels = _relabel(endpoint)
    assert labels == {
        "job": JOB_ENGINE,
        "deployment": prometheus_label(LABEL_DEPLOYMENT),
        "version": prometheus_label(ANNOTATION_REVISION, "annotation"),   # as written, not the sanitised label
        "replica": prometheus_label(LABEL_REPLICA),
    }
    # exactly the labels fleet up's file_sd gives an engine
    snapshot = {"replicas": [{"id": "chat-0", "deployment": "chat", "revision": "v1", "status": "READY",
                              "endpoint": "http://10.0.0.1:8000"}]}  # fmt: skip
    [group] = file_sd_groups(snapshot, None)
    assert set(group["labels"]) == set(labels)


def test_the_service_monitor_and_the_node_agent_pod_monitor_set_fleets_jobs() -> None:
    objs = _objects()
    sm = objs[("ServiceMonitor", "fleet")]
    jobs = {e["port"]: _relabel(e)["job"] for e in sm["spec"]["endpoints"]}
    assert jobs == {"http": JOB_ROUTER, "metrics": JOB_CONTROLLER}
    router = next(e for e in sm["spec"]["endpoints"] if e["port"] == "http")
    assert {"action": "labeldrop", "regex": "endpoint"} in router["relabelings"]  # the router's own `endpoint` wins
    agent = objs[("PodMonitor", "fleet-node-agent")]
    [endpoint] = agent["spec"]["podMetricsEndpoints"]
    assert _relabel(endpoint) == {"job": JOB_NODE_AGENT} and endpoint["port"] == "metrics"
    # it selects the DaemonSet's pods, which serve that port
    ds = objs[("DaemonSet", "fleet-agent")]
    assert agent["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9402, "protocol": "TCP"} in container["ports"]
    assert container["args"][0] == "node-agent" and "--metrics-port=9402" in container["args"]
    assert "--node-name=$(NODE_NAME)" in container["args"]   # series carry the node's name, not the pod's
    kubernetes_validate.validate(ds, "1.30.0", strict=True)
    assert ("PodMonitor", "fleet-node-agent") not in _objects(extra=("--set", "agent.enabled=false"))   # no agent, no monitor


def test_the_dashboards_config_map_ships_the_generated_dashboard() -> None:
    cm = _objects()[("ConfigMap", "fleet-dashboards")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(cm["data"]) == ["fleet-dashboard.json"]
    assert json.loads(cm["data"]["fleet-dashboard.json"]) == json.loads(render_dashboard())


# ----- the relabelings run by a real Prometheus -------------------------------------------------


def _prometheus_relabel(rule: dict) -> dict:
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {keys.get(k, k): v for k, v in rule.items()}


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="Prometheus is not installed (.ci/prometheus.sh)")
def test_prometheus_attaches_the_labels_the_dashboard_filters_on(tmp_path: Path) -> None:
    """Targets as the Prometheus Operator hands them to the chart's relabelings (its own job and
    endpoint labels set, the pod's labels as meta labels); what Prometheus shows after them is
    what `fleet up`'s file_sd gives."""
    objs = _objects()
    engine = objs[("PodMonitor", "fleet-engines")]["spec"]["podMetricsEndpoints"][0]
    router = next(e for e in objs[("ServiceMonitor", "fleet")]["spec"]["endpoints"] if e["port"] == "http")
    controller = next(e for e in objs[("ServiceMonitor", "fleet")]["spec"]["endpoints"] if e["port"] == "metrics")
    agent = objs[("PodMonitor", "fleet-node-agent")]["spec"]["podMetricsEndpoints"][0]
    # A revision no label value may hold: the label is sanitised, the annotation keeps it as written.
    revision = "2026-11/ft+lora v2"
    pod_labels = {LABEL_DEPLOYMENT: "chat", LABEL_REVISION: label_value(revision), LABEL_REPLICA: "chat-3"}
    meta = {prometheus_label(k): v for k, v in pod_labels.items()}
    meta[prometheus_label(ANNOTATION_REVISION, "annotation")] = revision
    files = {
        "engine": [{"targets": ["127.0.0.1:9"], "labels": {"job": "fleet/fleet-engines", "endpoint": "http", **meta}}],
        "router": [{"targets": ["127.0.0.1:10"], "labels": {"job": "serviceMonitor/fleet/fleet/0", "endpoint": "http"}}],
        "controller": [{"targets": ["127.0.0.1:11"], "labels": {"job": "serviceMonitor/fleet/fleet/1"}}],
        "agent": [{"targets": ["127.0.0.1:12"], "labels": {"job": "podMonitor/fleet/fleet-node-agent/0"}}],
    }
    scrape = []
    for name, endpoint in (("engine", engine), ("router", router), ("controller", controller), ("agent", agent)):
        (tmp_path / f"{name}.json").write_text(json.dumps(files[name]))
        scrape.append({"job_name": name, "scrape_interval": "1h", "file_sd_configs": [{"files": [str(tmp_path / f"{name}.json")]}],
                       "relabel_configs": [_prometheus_relabel(r) for r in endpoint["relabelings"]]})  # fmt: skip
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"scrape_configs": scrape}))
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "prometheus.log", "wb")
    prom = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:

        def every_target() -> dict[str, dict]:
            active = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
            targets = {t["scrapePool"]: t["labels"] for t in active}
            return targets if len(targets) == len(files) else {}

        targets = wait_until(every_target, 60, interval_s=0.3, what=f"Prometheus to list {len(files)} targets",
                             explain=(tmp_path / "prometheus.log").read_text,
                             ignoring=(httpx.HTTPError, KeyError, ValueError))
        [local] = file_sd_groups({"replicas": [{"id": "chat-3", "deployment": "chat", "revision": revision,
                                                "status": "READY", "endpoint": "http://127.0.0.1:9"}]}, None)  # fmt: skip
        assert {k: v for k, v in targets["engine"].items() if k != "instance" and k != "endpoint"} == local["labels"]
        assert targets["router"] == {"job": JOB_ROUTER, "instance": "127.0.0.1:10"}   # no `endpoint` target label
        assert targets["controller"] == {"job": JOB_CONTROLLER, "instance": "127.0.0.1:11"}
        assert targets["agent"] == {"job": JOB_NODE_AGENT, "instance": "127.0.0.1:12"}
    finally:
        prom.terminate()
        prom.wait(timeout=30)
