"""Prometheus recording and alert rules for a fleet: SLO burn rates and the faults an SRE acts on.

Owns the rule definitions (`recording_rules`, `alerts`) and their rendering (`rules_document`,
a Prometheus rules file; `fleet rules` prints it, docs/observability/fleet-rules.yaml ships it).
Checked by `promtool check rules` and unit-tested by `promtool test rules`
(tests/data/observability/fleet-rules.test.yaml); the integration test
(tests/integration/test_observability_sim.py) evaluates every rule against a real Prometheus.

SLOs (`SLO`): time to first token of streamed replies at the router
(``fleet_router_time_to_first_token_seconds``: dispatch to the first SSE event carrying text)
within `SLO.ttft_threshold_s` for `SLO.ttft_objective` of them; requests answered without a 5xx
(the router's own 502/503/504 rejections included) for `SLO.availability_objective`. A sized
(non-streamed) reply has no time to first token apart from its whole answer, so it counts in the
availability SLO only. The threshold must be one of the histogram's bucket bounds
(router/stats/metric_families.py `TTFT_BUCKETS_S`): a ratio read from buckets is exact only there.

Alerts follow the multiwindow, multi-burn-rate recipe of Google's SRE workbook, chapter 5
("Alerting on SLOs", table 5-8): page when 2 % of a 30-day budget burns in 1 h (burn rate 14.4,
confirmed over 5 m) or 5 % in 6 h (6, over 30 m); ticket at 10 % in 3 days (1, over 6 h) or
1 d / 2 h at 3.

Every alert carries ``data_exprs``: the queries under its thresholds. They must return series
whenever the fleet is being served, whether or not the alert fires: the integration test
evaluates them, so a renamed metric or a broken join fails a test instead of silencing a page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

from router.stats.metric_families import TTFT_BUCKETS_S

WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
"""Windows of the recorded error ratios (the burn-rate alerts' long and short windows)."""

TTFT = "fleet_router_time_to_first_token_seconds"
"""The histogram the TTFT SLO is read from (streamed replies; one name, so moving the SLO to
``fleet_router_time_to_first_byte_seconds``, which also covers sized replies by their whole
answer, is a one-line change)."""

REQUESTS = "fleet_router_requests_total"
REJECTED = "fleet_router_rejected_requests_total"
NAMED_POOL = 'model!="", model!="(unknown)"'
"""Rejections that belong to a model's pool: the router labels those for no model ``""`` and
those for a model without a pool ``(unknown)``."""


@dataclass(frozen=True)
class SLO:
    """The objectives the rules alert on (defaults: 99 % of streamed requests see their first
    token within 1 s; 99.9 % of requests answered without a 5xx)."""

    ttft_threshold_s: float = 1.0
    ttft_objective: float = 0.99
    availability_objective: float = 0.999

    def __post_init__(self) -> None:
        if self.ttft_threshold_s not in TTFT_BUCKETS_S:
            raise ValueError(f"ttft_threshold_s: must be a bucket bound of {TTFT} {TTFT_BUCKETS_S}, "
                             f"got {self.ttft_threshold_s}")  # fmt: skip
        for name in ("ttft_objective", "availability_objective"):
            value = getattr(self, name)
            if not 0.0 < value < 1.0:
                raise ValueError(f"{name}: must be strictly between 0 and 1, got {value}")

    def le_matcher(self) -> str:
        """Regex matching the threshold's ``le`` label as Prometheus 2 (``1.0``) and 3 (``1``) write it."""
        text = repr(float(self.ttft_threshold_s))
        whole = text[:-2] if text.endswith(".0") else None
        return f"{whole}|{text}".replace(".", "\\\\.") if whole else text.replace(".", "\\\\.")


def ttft_good_ratio(window: str, slo: SLO, by: str = "model", selector: str = "") -> str:
    """Share of streamed requests (0..1) whose first token came within the SLO threshold, over ``window``."""
    sel = f"{selector}, " if selector else ""
    count = f"{TTFT}_count{{{selector}}}" if selector else f"{TTFT}_count"
    return (f'sum by ({by}) (rate({TTFT}_bucket{{{sel}le=~"{slo.le_matcher()}"}}[{window}]))\n'
            f'/ sum by ({by}) (rate({count}[{window}]))')  # fmt: skip


def answered(window: str, by: str = "model", code: str = "", selector: str = "") -> str:
    """Requests/s that reached the router for a model: answered by an endpoint or rejected by
    the router itself; ``code`` an optional regex on the HTTP status."""
    c = f'code=~"{code}", ' if code else ""
    sel = f"{selector}, " if selector else ""
    return (f'sum by ({by}) (rate({REQUESTS}{{{sel}{c}}}[{window}]) '
            f'or rate({REJECTED}{{{sel}{c}{NAMED_POOL}}}[{window}]))').replace(", }", "}").replace("{}", "")  # fmt: skip


def error_ratio(window: str, by: str = "model", selector: str = "") -> str:
    """Share of requests (0..1) answered with a 5xx over ``window``; 0 (not absent) without errors."""
    total = answered(window, by, selector=selector)
    return f"(\n  {answered(window, by, '5..', selector)}\n  or 0 * {total}\n)\n/ {total}"


@dataclass(frozen=True)
class RecordingRule:
    record: str
    expr: str


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str
    description: str
    data_exprs: tuple[str, ...] = field(default_factory=tuple)


def recording_rules(slo: SLO = SLO()) -> list[RecordingRule]:
    """``fleet:ttft_slo_violation:ratio_rate<W>`` and ``fleet:request_errors:ratio_rate<W>`` per
    model for every window in `WINDOWS` (values 0..1)."""
    rules = []
    for w in WINDOWS:
        rules.append(RecordingRule(f"fleet:ttft_slo_violation:ratio_rate{w}", f"1 - (\n{ttft_good_ratio(w, slo)}\n)"))
    for w in WINDOWS:
        rules.append(RecordingRule(f"fleet:request_errors:ratio_rate{w}", error_ratio(w)))
    return rules


BURN_PAGE = (("1h", "5m", 14.4), ("6h", "30m", 6.0))
BURN_TICKET = (("1d", "2h", 3.0), ("3d", "6h", 1.0))
"""(long window, short window, burn rate) pairs: SRE workbook table 5-8."""


def _burn(series: str, budget: float, pairs) -> str:
    parts = [
        f"(\n  {series}{long_w} > ({burn} * {budget:g})\n  and\n  {series}{short_w} > ({burn} * {budget:g})\n)"
        for long_w, short_w, burn in pairs
    ]
    return "\nor\n".join(parts)


def alerts(slo: SLO = SLO()) -> list[Alert]:
    """Every alert rule (see the module docstring for the SLO recipe)."""
    ttft_budget = round(1 - slo.ttft_objective, 10)
    err_budget = round(1 - slo.availability_objective, 10)
    ttft = "fleet:ttft_slo_violation:ratio_rate"
    err = "fleet:request_errors:ratio_rate"
    thr = f"{slo.ttft_threshold_s:g} s"
    out = []
    for kind, series, budget, what in (
        ("TTFT", ttft, ttft_budget, f"streamed requests over the {thr} time-to-first-token SLO"),
        ("Error", err, err_budget, "requests answered with a 5xx"),
    ):
        for speed, pairs, severity, for_ in (("Fast", BURN_PAGE, "page", "2m"), ("Slow", BURN_TICKET, "ticket", "15m")):
            windows = [w for pair in pairs for w in pair[:2]]
            out.append(Alert(
                name=f"Fleet{kind}BudgetBurn{speed}", expr=_burn(series, budget, pairs), for_=for_, severity=severity,
                summary=(f"{{{{ $labels.model }}}}: {'TTFT' if kind == 'TTFT' else 'error'} budget burning "
                         f"{'fast' if speed == 'Fast' else 'steadily'}"),
                description=(f"The share of {what} for model {{{{ $labels.model }}}} is above "
                             + " or ".join(f"{b:g}x the budget ({b * budget:.4g}) over {lw} and {sw}"
                                           for lw, sw, b in pairs) + " (SRE workbook, table 5-8)."),
                data_exprs=tuple(f"{series}{w}" for w in windows),
            ))  # fmt: skip
    ready = 'max by (model) (fleet_router_pool_endpoints{state="ready"})'
    out.append(Alert(
        "FleetNoReadyEndpoint", f"{ready} == 0", "1m", "page",
        "{{ $labels.model }}: no ready endpoint",
        "The router's pool for model {{ $labels.model }} has had no READY endpoint for 1 minute: every "
        "request is answered 503. See `fleet status` for the replicas and their last engine log lines.",
        (ready,),
    ))
    failures = "sum by (deployment) (increase(fleet_replica_failures_total[15m]))"
    out.append(Alert(
        "FleetReplicasFailingRepeatedly", f"{failures} >= 3", "0m", "ticket",
        "{{ $labels.deployment }}: replicas failing repeatedly",
        "{{ $value | humanize }} replicas of deployment {{ $labels.deployment }} failed in the last 15 minutes "
        "(fleet_replica_failures_total); the controller replaces them with growing backoff.",
        (failures,),
    ))
    pinned = ("max by (deployment) (fleet_autoscaler_desired_replicas)\n"
              ">= on (deployment) max by (deployment) (fleet_deployment_max_replicas)")  # fmt: skip
    burning = f"max by (deployment) ({ttft}1h * on (model) group_left (deployment) fleet_deployment_info)"
    out.append(Alert(
        "FleetAutoscalerPinnedAtMax", f"(\n{pinned}\n)\nand on (deployment)\n{burning} > (6 * {ttft_budget:g})",
        "10m", "page",
        "{{ $labels.deployment }}: at max replicas while the TTFT SLO burns",
        "The autoscaler wants spec.replicas.max replicas of {{ $labels.deployment }} and the TTFT SLO still "
        "burns over 6x its budget over 1 h: raise spec.replicas.max or add capacity.",
        ("max by (deployment) (fleet_autoscaler_desired_replicas)\n"
         "/ on (deployment) max by (deployment) (fleet_deployment_max_replicas)", burning),
    ))
    rejecting = f'sum by (model) (rate({REJECTED}{{code="503", {NAMED_POOL}}}[5m]))'
    out.append(Alert(
        "FleetAdmissionQueueRejecting", f"{rejecting} > 0", "5m", "ticket",
        "{{ $labels.model }}: the router is rejecting requests with 503",
        "For 5 minutes the router has answered requests for {{ $labels.model }} with 503 itself "
        "({{ $value | humanize }}/s): admission queue full (routing.maxQueueLength), queue wait over "
        "routing.queueTimeoutSeconds, or no ready endpoint.",
        (rejecting,),
    ))
    ejected = "max by (model, endpoint) (avg_over_time(fleet_router_endpoint_ejected[15m]))"
    out.append(Alert(
        "FleetEndpointEjectedRepeatedly", f"{ejected} > 0.5", "0m", "ticket",
        "{{ $labels.model }} {{ $labels.endpoint }}: the router keeps ejecting it",
        "The router's outlier detection kept endpoint {{ $labels.endpoint }} of {{ $labels.model }} out of its "
        "pool for over half of the last 15 minutes: it stalls (no first token within the deadline) or fails "
        "(5xx, connection failures) whenever it is let back. Its /health may still pass. `fleet status` and "
        "fleet_router_endpoint_ejections_total{reason} say why; restart or drain the replica (docs/routing.md).",
        (ejected,),
    ))
    ready_replicas = 'sum by (deployment) (fleet_replicas{state="READY"})'
    desired_replicas = "max by (deployment) (fleet_deployment_desired_replicas)"
    out.append(Alert(
        "FleetDeploymentBelowDesired", f"{desired_replicas}\n- on (deployment)\n{ready_replicas}\n> 0", "15m", "ticket",
        "{{ $labels.deployment }}: fewer READY replicas than desired for 15 minutes",
        "Deployment {{ $labels.deployment }} has had {{ $value }} fewer READY replicas than the controller wants "
        "for 15 minutes: replicas cannot be placed (no free GPU, pods unschedulable), their image or weights do not "
        "arrive, or they fail their start or warm-up. `fleet status` (or the InferenceDeployment's status and "
        "Events) says which.",
        (ready_replicas, desired_replicas),
    ))
    quarantined = "sum by (node) (fleet_gpu_quarantined)"
    out.append(Alert(
        "FleetGpuQuarantined", f"{quarantined} > 0", "0m", "ticket",
        "{{ $labels.node }}: {{ $value }} GPU(s) quarantined",
        "The node agent on {{ $labels.node }} quarantined {{ $value }} GPU(s) or MIG instance(s) after a failed "
        "health check (fleet_gpu_health_findings says which check): replicas on them were drained and no new one "
        "is placed there. The capacity is gone until the GPU is reset or replaced (docs/node-agent.md).",
        (quarantined,),
    ))
    withheld = "max by (node, gpu) (fleet_gpu_quarantine_withheld)"
    out.append(Alert(
        "FleetGpuQuarantineCapReached", f"{withheld} == 1", "0m", "page",
        "{{ $labels.node }} {{ $labels.gpu }}: failing GPU NOT quarantined (quarantine cap reached)",
        "A GPU health check failed on {{ $labels.gpu }} ({{ $labels.node }}) but the node agent withheld the "
        "quarantine: the share of quarantined GPUs is at its cap (--max-quarantined-share), which stops one "
        "faulty check from draining the fleet. Replicas keep running on a GPU that failed its checks: decide by "
        "hand (docs/node-agent.md).",
        (withheld,),
    ))
    up = 'up{job=~"fleet-.*"}'
    out.append(Alert(
        "FleetTargetDown", f"{up} == 0", "2m", "ticket",
        "{{ $labels.job }} {{ $labels.instance }} does not answer scrapes",
        "Prometheus cannot scrape {{ $labels.job }} at {{ $labels.instance }} "
        "(replica {{ $labels.replica }}) for 2 minutes.",
        (up,),
    ))
    return out


def kubernetes_alerts() -> list[Alert]:
    """Alerts only a cluster needs: on one machine `fleet up` is the controller, and a stopped
    fleet leaves no target to miss. The chart's ServiceMonitor gives the operator's metrics
    endpoint ``job="fleet-controller"`` (charts/fleet/templates/monitoring.yaml)."""
    controller_up = 'up{job="fleet-controller"}'
    return [Alert(
        "FleetOperatorDown", f"absent({controller_up} == 1)", "10m", "page",
        "No Fleet operator answers scrapes",
        "No Fleet operator has been scraped for 10 minutes: replicas are not replaced, scaled or rolled out "
        "(the engines and routers keep serving what they serve).",
        (controller_up,),
    )]


def _alert_rules(group: list[Alert]) -> list[dict]:
    return [{"alert": a.name, "expr": a.expr, "for": a.for_, "labels": {"severity": a.severity},
             "annotations": {"summary": a.summary, "description": a.description}} for a in group]  # fmt: skip


def rules_document(slo: SLO = SLO(), kubernetes: bool = False) -> dict:
    """The Prometheus rules file (https://prometheus.io/docs/prometheus/latest/configuration/recording_rules/);
    ``kubernetes``: with the group of `kubernetes_alerts` (the chart's PrometheusRule)."""
    groups = [
        {"name": "fleet-slo", "interval": "30s",
         "rules": [{"record": r.record, "expr": r.expr} for r in recording_rules(slo)]},
        {"name": "fleet-alerts", "rules": _alert_rules(alerts(slo))},
    ]  # fmt: skip
    if kubernetes:
        groups.append({"name": "fleet-kubernetes", "rules": _alert_rules(kubernetes_alerts())})
    return {"groups": groups}


class _LiteralDumper(yaml.SafeDumper):
    pass


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_LiteralDumper.add_representer(str, _str_presenter)


def render_rules(slo: SLO = SLO(), interval: str | None = None, kubernetes: bool = False) -> str:
    """`rules_document` as YAML (multi-line queries as literal blocks); ``interval`` overrides
    the recording group's evaluation interval (the integration test uses seconds);
    ``kubernetes``: the chart's copy (charts/fleet/files/fleet-rules.yaml, `fleet rules --kubernetes`)."""
    doc = rules_document(slo, kubernetes)
    if interval:
        for group in doc["groups"]:
            group["interval"] = interval
    command = "fleet rules --kubernetes" if kubernetes else "fleet rules"
    header = ("# Fleet's Prometheus rules: SLO recording rules and alerts (fleet/observability/rules.py).\n"
              f"# Generated by `{command}`; do not edit by hand.\n")  # fmt: skip
    return header + yaml.dump(doc, Dumper=_LiteralDumper, sort_keys=False, width=200)
