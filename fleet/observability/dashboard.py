"""Fleet's Grafana dashboard, as code: tail latency per deployment, version and endpoint.

Owns the panel definitions (`ROWS`: title, description, unit, PromQL per series) and their
rendering to Grafana dashboard JSON with grafana-foundation-sdk (`build_dashboard`,
`render_dashboard`; `fleet dashboard` prints it, docs/observability/fleet-dashboard.json ships
it). `panel_queries` lists every query of a rendered dashboard: the integration test
(tests/integration/test_observability_sim.py) evaluates each against a real Prometheus and the lint
(`fleet.observability.promql`) checks each for rate() and ``le``.

Why grafana-foundation-sdk and not grafanalib: it is Grafana Labs' own, generated from the
schemas of the Grafana version it is released for (panel options, field config, variables
match what Grafana loads), typed, and released with Grafana; grafanalib is community-kept,
hand-written against Grafana 8-era JSON, and its last release is from January 2024.

Conventions that make the numbers right (the anchors' dashboards get them wrong):
every quantile is ``histogram_quantile(q, sum by (le, ...) (rate(..._bucket[$__rate_interval])))``
at p50 / p90 / p99 / p99.9; counters are only read through ``rate()`` / ``increase()``; latency
panels split by the ``version`` label (the replica's revision), so a canary and its stable
version draw side by side.

Where each label comes from: router series carry ``model`` (its pool), ``endpoint`` (= replica
id) and ``version``; engine series get ``deployment``,
``version`` and ``replica`` from Fleet's service discovery (`fleet.observability.discovery`);
``fleet_deployment_info`` maps a deployment to its model, which the ``model`` variable follows;
node agent series (GPU health, quarantine) carry ``node`` and ``gpu`` themselves. On Kubernetes
the chart's ServiceMonitor and PodMonitors give the same ``job``, ``deployment``, ``version`` and
``replica`` labels (charts/fleet/templates/monitoring.yaml), so one dashboard serves both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grafana_foundation_sdk.builders import common as gcommon
from grafana_foundation_sdk.builders import dashboard as gdash
from grafana_foundation_sdk.builders import prometheus as gprom
from grafana_foundation_sdk.builders import stat as gstat
from grafana_foundation_sdk.builders import timeseries as gts
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as mcommon
from grafana_foundation_sdk.models import dashboard as mdash

from fleet.observability.rules import SLO, error_ratio, ttft_good_ratio

DASHBOARD_UID = "fleet-tail-latency"
QUANTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p99.9", 0.999))
RATE = "$__rate_interval"

ROUTER_EP = 'model=~"$model", endpoint=~"$replica", version=~"$version(@.*)?"'
"""Router per-endpoint series (router/stats/metric_families.py `ENDPOINT_LABELS`: requests, time to first
token / byte, time per output token, end-to-end latency). The router's ``version`` is
``<revision>@<serving hash>`` (`fleet.rollout.revisions.revision_label`: two revisions may share a model
revision), the variable's values are revisions (``fleet_replicas``, the engines' targets): the
optional suffix makes a selected revision match its router series."""
ROUTER_MODEL = 'model=~"$model"'
ENGINE = 'deployment=~"$deployment", version=~"$version", replica=~"$replica"'
DEPLOYMENT = 'deployment=~"$deployment"'
NODE = 'node=~"$node"'
"""Node agent series (fleet/agent/runner.py): ``node`` is the agent's node name."""
GPUS_HELD = f"rate(fleet_gpu_seconds_allocated_total{{{DEPLOYMENT}}}[{RATE}])"
"""GPUs held, by deployment, revision, product and state: the controller's GPU-seconds counter's
rate (fleet/observability/discovery.py `ControllerStateCollector`)."""
ROUTER_TOKENS = (f"sum by (deployment) (sum by (model) (rate(fleet_router_generation_tokens_total{{{ROUTER_MODEL}}}"
                 f"[{RATE}]))\n* on (model) group_right fleet_deployment_info{{{DEPLOYMENT}}})")
"""Output tokens per second by deployment: the router's counter (per model, router/protocol/tokens.py) joined to
the deployment serving that model through ``fleet_deployment_info{deployment, model} = 1``."""



@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelDef:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    width: int = 12
    kind: str = "timeseries"   # "stat": one figure per series over the dashboard's range (instant queries)


def quantiles(metric: str, selector: str, by: str, legend: str) -> tuple[Query, ...]:
    """p50 / p90 / p99 / p99.9 of histogram ``metric`` (base name), summed by ``le`` and ``by``."""
    group = f"le, {by}" if by else "le"
    return tuple(
        Query(f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
              f"{name} {legend}".strip())
        for name, q in QUANTILES
    )  # fmt: skip


def _rows(slo: SLO) -> list[tuple[str, list[PanelDef]]]:
    ttft_budget = round(1 - slo.ttft_objective, 10)
    err_budget = round(1 - slo.availability_objective, 10)
    thr = f"{slo.ttft_threshold_s:g} s"
    lat = "Seconds; histogram_quantile over sum by (le, ...) (rate(..._bucket[$__rate_interval]))."
    return [
        ("Tail latency, as clients see it (router)", [
            PanelDef("Time to first token (streamed, router)", "Dispatch to the first SSE event carrying text, "
                     "per version (canary and stable side by side). " + lat, "s",
                     quantiles("fleet_router_time_to_first_token_seconds", ROUTER_EP, "version", "{{version}}")),
            PanelDef("Time per output token (streamed, router)", "(last token - first token) / (tokens - 1) per "
                     "streamed request, per version. " + lat, "s",
                     quantiles("fleet_router_time_per_output_token_seconds", ROUTER_EP, "version", "{{version}}")),
            PanelDef("Time to first byte (router)", "Dispatch to the first response byte, every reply: "
                     "for a sized reply that is its whole answer. " + lat, "s",
                     quantiles("fleet_router_time_to_first_byte_seconds", ROUTER_EP, "version", "{{version}}")),
            PanelDef("End-to-end latency (router)", "Dispatch to last byte relayed. " + lat, "s",
                     quantiles("fleet_router_e2e_request_latency_seconds", ROUTER_EP, "version", "{{version}}")),
            PanelDef("Queue time (router admission queue)", "Arrival to dispatch: the wait for a free endpoint "
                     "slot (routing.maxConcurrencyPerEndpoint). " + lat, "s",
                     quantiles("fleet_router_queue_time_seconds", ROUTER_MODEL, "model", "{{model}}")),
            PanelDef("p99 time to first token by endpoint", "One line per replica: a slow endpoint stands out. "
                     + lat, "s",
                     (Query("histogram_quantile(0.99, sum by (le, endpoint) (rate("
                            f"fleet_router_time_to_first_token_seconds_bucket{{{ROUTER_EP}}}[{RATE}])))",
                            "{{endpoint}}"),)),
        ]),  # fmt: skip
        ("Traffic, errors and admission", [
            PanelDef("Requests by code", "Requests/s answered by endpoints, by HTTP status, and requests the "
                     "router rejected itself (400/404/413/502/503).", "reqps", (
                Query(f"sum by (code) (rate(fleet_router_requests_total{{{ROUTER_EP}}}[{RATE}]))", "{{code}}"),
                Query(f"sum by (code) (rate(fleet_router_rejected_requests_total{{{ROUTER_MODEL}}}[{RATE}]))",
                      "rejected {{code}}"),
            )),
            PanelDef("Error ratio (5xx)", "Share of requests answered with a 5xx (endpoint or router).",
                     "percentunit", (Query(error_ratio(RATE, "model", ROUTER_MODEL), "{{model}}"),)),
            PanelDef("Requests in flight", "Dispatched to an endpoint and not finished, per endpoint.", "short",
                     (Query('sum by (endpoint) (fleet_router_requests_in_flight{model=~"$model", '
                            'endpoint=~"$replica"})', "{{endpoint}}"),)),
            PanelDef("Admission queue length", "Requests waiting in the router for a free endpoint slot.", "short",
                     (Query(f"sum by (model) (fleet_router_queued_requests{{{ROUTER_MODEL}}})", "{{model}}"),)),
            PanelDef("Rejections", "Requests/s the router answered itself, by code (503: queue full or timed "
                     "out, or no ready endpoint).", "reqps",
                     (Query(f"sum by (model, code) (rate(fleet_router_rejected_requests_total{{{ROUTER_MODEL}}}"
                            f"[{RATE}]))", "{{model}} {{code}}"),)),
        ]),  # fmt: skip
        (f"SLO: first token within {thr} for {slo.ttft_objective:.4g}, no 5xx for {slo.availability_objective:.4g}", [
            PanelDef(f"Requests within the TTFT SLO ({thr})", f"Share of streamed requests whose first token came within "
                     f"{thr} (objective {slo.ttft_objective:.4g}).", "percentunit",
                     (Query(ttft_good_ratio(RATE, slo, "model", ROUTER_MODEL), "{{model}}"),)),
            PanelDef("TTFT SLO burn rate", "Error-budget burn rate: 1 spends the budget exactly over the SLO "
                     "period; the page fires at 14.4 over 1 h and 5 m (SRE workbook, table 5-8).", "short",
                     tuple(Query(f"(1 - (\n{ttft_good_ratio(w, slo, 'model', ROUTER_MODEL)}\n)) / {ttft_budget:g}",
                                 f"{{{{model}}}} {w}") for w in ("5m", "1h"))),
            PanelDef("Error budget burn rate", "5xx ratio over the budget (1 - availability objective).", "short",
                     tuple(Query(f"{error_ratio(w, 'model', ROUTER_MODEL)}\n/ {err_budget:g}", f"{{{{model}}}} {w}")
                           for w in ("5m", "1h"))),
        ]),  # fmt: skip
        ("Replicas and autoscaling", [
            PanelDef("Replicas by state", "Replicas per lifecycle state (fleet/controller/lifecycle.py), per version.",
                     "short", (Query(f'sum by (version, state) (fleet_replicas{{{DEPLOYMENT}, version=~"$version"}}) '
                                     "> 0", "{{version}} {{state}}"),)),
            PanelDef("Router pool endpoints", "Endpoints in the router's pool: ready and draining (max over "
                     "router replicas: on Kubernetes every router pod holds the same pool).", "short",
                     (Query(f"max by (model, state) (fleet_router_pool_endpoints{{{ROUTER_MODEL}}})",
                            "{{model}} {{state}}"),)),
            PanelDef("Autoscaler: desired vs ready", "Replicas the autoscaler wants, READY replicas at its last "
                     "decision, and spec.replicas.max; each scaling decision is an annotation.", "short", (
                Query(f"max by (deployment) (fleet_autoscaler_desired_replicas{{{DEPLOYMENT}}})",
                      "desired {{deployment}}"),
                Query(f"max by (deployment) (fleet_autoscaler_ready_replicas{{{DEPLOYMENT}}})", "ready {{deployment}}"),
                Query(f"max by (deployment) (fleet_deployment_max_replicas{{{DEPLOYMENT}}})", "max {{deployment}}"),
            )),
            PanelDef("Autoscaler signals", "What the autoscaler scaled on: mean queue time (router + engine) and "
                     "p99 time to first token over its window.", "s", (
                Query(f"max by (deployment) (fleet_autoscaler_queue_time_seconds{{{DEPLOYMENT}}})",
                      "queue time {{deployment}}"),
                Query(f"max by (deployment) (fleet_autoscaler_ttft_p99_seconds{{{DEPLOYMENT}}})",
                      "TTFT p99 {{deployment}}"),
            )),
            PanelDef("Scaling decisions", "Decisions per rate interval by direction (holds included).", "short",
                     (Query(f"sum by (deployment, direction) (increase(fleet_autoscaler_decisions_total"
                            f"{{{DEPLOYMENT}}}[{RATE}]))", "{{deployment}} {{direction}}"),)),
        ]),  # fmt: skip
        ("Engines (vLLM's own metrics)", [
            PanelDef("Running and waiting requests", "vllm:num_requests_running / _waiting per replica.", "short", (
                Query(f"sum by (replica) (vllm:num_requests_running{{{ENGINE}}})", "running {{replica}}"),
                Query(f"sum by (replica) (vllm:num_requests_waiting{{{ENGINE}}})", "waiting {{replica}}"),
            )),
            PanelDef("KV-cache usage", "vllm:kv_cache_usage_perc per replica (1 = full).", "percentunit",
                     (Query(f"max by (replica) (vllm:kv_cache_usage_perc{{{ENGINE}}})", "{{replica}}"),)),
            PanelDef("Prefix cache hit rate", "Cached tokens / queried tokens, per replica.", "percentunit",
                     (Query(f"sum by (replica) (rate(vllm:prefix_cache_hits_total{{{ENGINE}}}[{RATE}]))\n"
                            f"/ sum by (replica) (rate(vllm:prefix_cache_queries_total{{{ENGINE}}}[{RATE}]))",
                            "{{replica}}"),)),
            PanelDef("Router's cache view: predicted / found prefix hits", "Prompt tokens the routing policy "
                     "expected the chosen replica to hold over those the engine found in its prefix cache "
                     "(usage.prompt_tokens_details.cached_tokens), per model: 1 is an exact view, above 1 the "
                     "router believes more is cached than is (a lagging or stale view).", "short",
                     (Query(f"sum by (model) (rate(fleet_router_prefix_cache_predicted_hits_total{{{ROUTER_MODEL}}}"
                            f"[{RATE}]))\n/ sum by (model) (rate(fleet_router_prefix_cache_hits_total"
                            f"{{{ROUTER_MODEL}}}[{RATE}]))", "{{model}}"),)),
            PanelDef("Preemptions", "Requests preempted per second (KV cache exhausted), per replica.", "ops",
                     (Query(f"sum by (replica) (rate(vllm:num_preemptions_total{{{ENGINE}}}[{RATE}]))",
                            "{{replica}}"),)),
            PanelDef("Engine time to first token", "vllm:time_to_first_token_seconds per version: the "
                     "engine's side, without the router's queue. " + lat, "s",
                     quantiles("vllm:time_to_first_token_seconds", ENGINE, "version", "{{version}}")),
            PanelDef("Engine time per output token", "vllm:request_time_per_output_token_seconds per version. "
                     + lat, "s", quantiles("vllm:request_time_per_output_token_seconds", ENGINE, "version",
                                          "{{version}}")),
        ]),  # fmt: skip
        ("Cost and GPU use", [
            PanelDef("Cost per hour (USD)", "GPUs held (rate of fleet_gpu_seconds_allocated_total: serving, "
                     "starting and standby replicas all hold theirs) x USD per GPU-hour of their product "
                     "(fleet_gpu_price_usd_per_hour, `fleet up --prices`).", "currencyUSD",
                     (Query(f"sum by (deployment) ({GPUS_HELD}\n* on (product) group_left "
                            "fleet_gpu_price_usd_per_hour)", "{{deployment}}"),)),
            PanelDef("Cost per 1M output tokens (USD)", "Cost per hour (every GPU the deployment holds, "
                     "standby and starting included) over the output tokens it delivered per hour, per million. "
                     "Tokens: the router's fleet_router_generation_tokens_total (the engine's usage; a stream "
                     "without a usage chunk by its text events, router/protocol/tokens.py), so the engines' warm-up "
                     "requests are not counted; its model is the deployment's (fleet_deployment_info).",
                     "currencyUSD", (Query(f"sum by (deployment) ({GPUS_HELD}\n* on (product) group_left "
                                           f"fleet_gpu_price_usd_per_hour)\n/ ({ROUTER_TOKENS} * 3600 / 1e6)",
                                           "{{deployment}}"),)),
            PanelDef("GPUs allocated vs busy", "GPUs held by replicas (GPU-hours per hour), by state, and the "
                     "GPU-busy share of the GPUs serving a replica (DCGM_FI_DEV_GPU_UTIL / 100, node agent): "
                     "the gap is allocated-but-idle GPU time.", "short", (
                Query(f"sum by (deployment, state) ({GPUS_HELD})", "allocated {{deployment}} {{state}}"),
                Query(f'sum by (deployment) (DCGM_FI_DEV_GPU_UTIL{{{DEPLOYMENT}, deployment!=""}}) / 100',
                      "busy {{deployment}}"),
            )),
            PanelDef("GPU-hours in the time range: allocated vs busy", "Over the dashboard's time range: "
                     "GPU-hours held by state (increase of fleet_gpu_seconds_allocated_total / 3600) and GPU-hours "
                     "busy (DCGM_FI_DEV_GPU_UTIL / 100 of the GPUs serving a replica, summed over the range at "
                     "the panel's interval). Allocated minus busy is the GPU time paid for and idle.", "short", (
                Query(f"sum by (deployment, state) (increase(fleet_gpu_seconds_allocated_total{{{DEPLOYMENT}}}"
                      "[$__range])) / 3600", "allocated {{deployment}} {{state}}"),
                Query(f'sum by (deployment) (sum_over_time((sum by (deployment) (DCGM_FI_DEV_GPU_UTIL{{{DEPLOYMENT}, '
                      'deployment!=""}) / 100)[$__range:$__interval])) * $__interval_ms / 3.6e6',
                      "busy {{deployment}}"),
            ), kind="stat"),
            PanelDef("Standby share of GPU time", "Share of the GPU time held that standby replicas hold "
                     "(asleep, ready to wake); 0 without standby replicas.", "percentunit",
                     (Query(f'(sum by (deployment) (rate(fleet_gpu_seconds_allocated_total{{{DEPLOYMENT}, '
                            f'state="standby"}}[{RATE}]))\nor sum by (deployment) ({GPUS_HELD}) * 0)\n'
                            f"/ sum by (deployment) ({GPUS_HELD})", "{{deployment}}"),)),
        ]),  # fmt: skip
        ("GPU health and quarantine (node agent)", [
            PanelDef("GPU health checks failing", "Findings of each node agent's last check, by GPU (or MIG "
                     "instance) and check: ECC, row remapping, PCIe link, throttling, NVLink errors, P2P, Xid, "
                     "lost GPU (fleet/agent/health.py). Empty: every check passed.", "short",
                     (Query(f"sum by (node, gpu, check, severity) (fleet_gpu_health_findings{{{NODE}}})",
                            "{{node}} {{gpu}} {{check}} ({{severity}})"),)),
            PanelDef("Quarantined GPUs", "GPUs or MIG instances quarantined (no replica placed, running ones "
                     "drained), and failing ones NOT quarantined because the cap on the quarantined share was "
                     "reached (withheld: decide by hand).", "short", (
                Query(f"sum by (node) (fleet_gpu_quarantined{{{NODE}}})", "quarantined {{node}}"),
                Query(f"sum by (node) (fleet_gpu_quarantine_withheld{{{NODE}}})", "withheld {{node}}"),
            )),
            PanelDef("Quarantine decisions", "Decisions per rate interval: quarantine, lift (hold-off passed "
                     "without new evidence) and withheld (cap reached).", "short",
                     (Query(f"sum by (node, action) (increase(fleet_gpu_quarantine_decisions_total{{{NODE}}}"
                            f"[{RATE}]))", "{{node}} {{action}}"),)),
            PanelDef("Xid events", "Xid errors NVML reported per rate interval, by GPU, code and class "
                     "(fleet/agent/xid.py).", "short",
                     (Query(f"sum by (node, gpu, xid, xid_class) (increase(fleet_gpu_xid_events_total{{{NODE}}}"
                            f"[{RATE}]))", "{{node}} {{gpu}} Xid {{xid}} ({{xid_class}})"),)),
        ]),  # fmt: skip
    ]


ANNOTATION_EXPR = f"changes(fleet_autoscaler_desired_replicas{{{DEPLOYMENT}}}[{RATE}]) > 0"
"""Grafana annotation query: a mark where the autoscaler's desired replicas changed (a scale-up
or scale-down decision). Read from the desired-replicas gauge, not from
``increase(fleet_autoscaler_decisions_total{direction!="hold"})``: a decision counter series is
born at its first decision with value 1, and ``increase()`` cannot see that first step."""


def rows(slo: SLO = SLO()) -> list[tuple[str, list[PanelDef]]]:
    """The dashboard's rows and panels (pure data)."""
    return _rows(slo)


def _datasource() -> mdash.DataSourceRef:
    return mdash.DataSourceRef(type_val="prometheus", uid="${datasource}")


def _query_var(name: str, label: str, query: str) -> gdash.QueryVariable:
    return (gdash.QueryVariable(name).label(label).datasource(_datasource()).query(query)
            .multi(True).include_all(True).all_value(".*").refresh(mdash.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(mdash.VariableSort.ALPHABETICAL_ASC))  # fmt: skip


def _stat_panel(p: PanelDef) -> gstat.Panel:
    builder = (gstat.Panel().title(p.title).description(p.description).unit(p.unit).datasource(_datasource())
               .span(p.width).height(8).decimals(2).graph_mode(mcommon.BigValueGraphMode.NONE)
               .reduce_options(gcommon.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))  # fmt: skip
    for i, q in enumerate(p.queries):
        builder = builder.with_target(gprom.Dataquery().expr(q.expr).legend_format(q.legend).instant()
                                      .ref_id(chr(ord("A") + i)))  # fmt: skip
    return builder


def _panel(p: PanelDef) -> gts.Panel | gstat.Panel:
    if p.kind == "stat":
        return _stat_panel(p)
    builder = (gts.Panel().line_width(1).fill_opacity(5)
               .legend(gcommon.VizLegendOptions().display_mode(mcommon.LegendDisplayMode.LIST)
                       .placement(mcommon.LegendPlacement.BOTTOM).show_legend(True))
               .tooltip(gcommon.VizTooltipOptions().mode(mcommon.TooltipDisplayMode.MULTI)
                        .sort(mcommon.SortOrder.DESCENDING)))  # fmt: skip
    builder = builder.title(p.title).description(p.description).unit(p.unit).datasource(_datasource()).span(p.width)
    builder = builder.height(8)
    for i, q in enumerate(p.queries):
        builder = builder.with_target(gprom.Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)))
    return builder


def build_dashboard(slo: SLO = SLO()) -> dict:
    """The dashboard as a JSON-ready dict (Grafana dashboard schema, as grafana-foundation-sdk builds it)."""
    b = (gdash.Dashboard("Fleet: tail latency").uid(DASHBOARD_UID).tags(["fleet", "llm-inference", "slo"])
         .description("Fleet (inference-fleet): tail latency per deployment, version and endpoint; SLO burn; "
                      "replicas and autoscaling; vLLM engine state; GPU health and quarantine. "
                      "Generated by fleet/observability/dashboard.py.")
         .refresh("30s").time("now-1h", "now").timezone("browser").editable()
         .with_variable(gdash.DatasourceVariable("datasource").label("Prometheus").type("prometheus"))
         .with_variable(_query_var("deployment", "Deployment", "label_values(fleet_deployment_info, deployment)"))
         .with_variable(_query_var("model", "Model",
                                   'label_values(fleet_deployment_info{deployment=~"$deployment"}, model)'))
         .with_variable(_query_var("version", "Version",
                                   'label_values(fleet_replicas{deployment=~"$deployment"}, version)'))
         .with_variable(_query_var("replica", "Endpoint",
                                   'label_values(up{job="fleet-engine", deployment=~"$deployment", '
                                   'version=~"$version"}, replica)'))
         .with_variable(_query_var("node", "Node", "label_values(fleet_gpu_quarantined, node)"))
         .annotation(gdash.AnnotationQuery().name("Scaling decisions").datasource(_datasource()).enable(True)
                     .icon_color("purple").expr(ANNOTATION_EXPR)))  # fmt: skip
    for title, panels in rows(slo):
        b = b.with_row(gdash.Row(title))
        for p in panels:
            b = b.with_panel(_panel(p))
    doc = json.loads(JSONEncoder(sort_keys=True).encode(b.build()))
    for panel_id, panel in enumerate(doc.get("panels", []), start=1):  # stable, unique ids (links, alerts)
        panel["id"] = panel_id
    for ann in doc.get("annotations", {}).get("list", []):
        if ann.get("expr") == ANNOTATION_EXPR:  # Prometheus annotation fields the typed model lacks
            ann.update({"titleFormat": "scaling decision", "textFormat": "{{deployment}}: desired replicas changed",
                        "tagKeys": "deployment", "useValueForTime": False, "step": "15s"})  # fmt: skip
    return doc


def render_dashboard(slo: SLO = SLO()) -> str:
    """`build_dashboard` as indented JSON (the file under docs/observability/)."""
    return json.dumps(build_dashboard(slo), indent=2, sort_keys=True) + "\n"


def panel_queries(doc: dict) -> list[tuple[str, str]]:
    """(panel title, query) for every query of every panel of a rendered dashboard, then
    ("annotation: NAME", query) for each Prometheus annotation."""
    out = []
    for panel in doc.get("panels", []):
        for sub in [panel, *panel.get("panels", [])]:
            for target in sub.get("targets", []) or []:
                if target.get("expr"):
                    out.append((sub["title"], target["expr"]))
    for ann in doc.get("annotations", {}).get("list", []):
        if ann.get("expr"):
            out.append((f"annotation: {ann['name']}", ann["expr"]))
    return out
