"""The endpoint picker's own Prometheus metrics and its small HTTP side (`/metrics`, `/ready`, `/healthz`).

Owns `PickerMetrics` (the families, on a registry of the picker's own) and `serve_http` (an aiohttp
site on the picker's event loop). `router.picker.service.PickerService` records into the metrics
and hands them to its `router.signals.kv_streams.KvEventStreams` (which binds one
`router.stats.endpoint_metrics.KvEndpointMetrics` per stream through `bind_kv`, as it does on the
router's `router.stats.metrics.RouterMetrics`); `router.picker.__main__` serves them.

Names follow the router's (`router/stats/metric_families.py`: base units, `_total` for counters,
`_seconds` for durations), with the prefix ``fleet_picker_``:

- `fleet_picker_picks_total{outcome}`: picks answered with an endpoint (`answered`), or declined
  (`declined`: the picker knows no such pool yet; `standby`: this picker does not hold the Lease).
  A router falls back to its own pick on either decline.
- `fleet_picker_pick_decision_seconds`: time to decide one pick (the policy's choice and the load
  bookkeeping, not the wire).
- `fleet_picker_kv_events_total`, `_kv_event_gaps_total`, `_kv_event_resyncs_total{reason}`,
  `_kv_event_errors_total{reason}` (each by `model`, `endpoint`): the router's KV stream counters,
  as the picker's subscribers count them.
- `fleet_picker_kv_stream_live{model,endpoint}` (1: connected and its exact view complete) and
  `fleet_picker_kv_index_blocks{model,endpoint}`, read at scrape time.
- `fleet_picker_routers_connected`, `fleet_picker_picks_in_flight`, `fleet_picker_leader` (1 while
  this picker answers picks: it holds the Lease, or runs without one), read at scrape time.

HTTP: `GET /metrics` (the exposition), `GET /ready` (200 while leading, else 503: the chart's
readiness probe, so the picker Service's Endpoints hold the leader alone), `GET /healthz` (200
while the process serves).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from router.stats.endpoint_metrics import KvEndpointMetrics

DECISION_BUCKETS_S: tuple[float, ...] = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
                                         0.005, 0.01, 0.025)  # fmt: skip
"""Bucket upper bounds (s) of `fleet_picker_pick_decision_seconds`: a pick decides in tens of
microseconds on a quiet picker (docs/routing.md, "Endpoint picker"); 5 ms is the routers' default
deadline for the whole round trip."""


class PickerFacts:
    """What the scrape-time gauges read (the service sets these callables): ``kv_rows()`` ->
    [(model, endpoint, live, blocks)], ``routers()`` -> connections open, ``in_flight()`` -> picks
    held, ``leading()`` -> whether picks are answered."""

    def __init__(self) -> None:
        self.kv_rows: Callable[[], list[tuple[str, str, bool, int]]] = list
        self.routers: Callable[[], int] = lambda: 0
        self.in_flight: Callable[[], int] = lambda: 0
        self.leading: Callable[[], bool] = lambda: True


class _ScrapeGauges:
    """Collector of the gauges read when scraped (`PickerFacts`)."""

    def __init__(self, facts: PickerFacts) -> None:
        self.facts = facts

    def describe(self) -> Iterable[Metric]:
        return ()

    def collect(self) -> Iterator[Metric]:
        facts = self.facts
        live = GaugeMetricFamily("fleet_picker_kv_stream_live", "1 while an endpoint's KV event stream is connected "
                                 "and the picker's exact view of it complete; 0 while down or rebuilding (the "
                                 "policy's approximate index applies).", labels=["model", "endpoint"])  # fmt: skip
        blocks = GaugeMetricFamily("fleet_picker_kv_index_blocks", "KV cache blocks the picker's exact index holds "
                                   "for an endpoint.", labels=["model", "endpoint"])  # fmt: skip
        for model, endpoint, is_live, held in facts.kv_rows():
            live.add_metric([model, endpoint], 1.0 if is_live else 0.0)
            blocks.add_metric([model, endpoint], float(held))
        yield live
        yield blocks
        yield GaugeMetricFamily("fleet_picker_routers_connected", "Router connections open to this picker.",
                                value=float(facts.routers()))  # fmt: skip
        yield GaugeMetricFamily("fleet_picker_picks_in_flight", "Picks answered and not yet reported finished, "
                                "over every router.", value=float(facts.in_flight()))  # fmt: skip
        yield GaugeMetricFamily("fleet_picker_leader", "1 while this picker answers picks (it holds the Lease, or "
                                "runs without HA); 0 while it is a standby.", value=1.0 if facts.leading() else 0.0)


class PickerMetrics:
    """The picker's metric families on `registry` (None: a fresh one); module docstring for names.

    `answered`, `declined`, `standby`: the `fleet_picker_picks_total` children; `decision`: the
    decision-time histogram; `facts`: what the scrape-time gauges read. `watch_kv_streams` and
    `bind_kv` are what `router.signals.kv_streams.KvEventStreams` calls on its metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry if registry is not None else CollectorRegistry()
        picks = Counter("fleet_picker_picks", "Picks the routers asked of this picker, by outcome: answered, or "
                        "declined (no such pool yet) or standby (not holding the Lease); the router picks alone on "
                        "a decline.", ["outcome"], registry=r)  # fmt: skip
        self.answered = picks.labels("answered")
        self.declined = picks.labels("declined")
        self.standby = picks.labels("standby")
        self.decision = Histogram("fleet_picker_pick_decision_seconds", "Time to decide one pick at the picker "
                                  "(policy and load bookkeeping; seconds).", buckets=DECISION_BUCKETS_S,
                                  registry=r)  # fmt: skip
        kv = ["model", "endpoint"]
        self.kv_events = Counter("fleet_picker_kv_events", "KV cache events applied to the picker's exact block "
                                 "index, live or replayed (router.signals.kv_subscriber).", kv, registry=r)  # fmt: skip
        self.kv_event_gaps = Counter("fleet_picker_kv_event_gaps", "Breaks in an endpoint's KV event stream (a seq "
                                     "skipped or gone back, a reconnection), each followed by a replay request.", kv,
                                     registry=r)  # fmt: skip
        self.kv_event_resyncs = Counter("fleet_picker_kv_event_resyncs", "Times an endpoint's exact view was dropped "
                                        "and rebuilt from the stream, by reason (as fleet_router_kv_event_resyncs).",
                                        [*kv, "reason"], registry=r)  # fmt: skip
        self.kv_event_errors = Counter("fleet_picker_kv_event_errors", "KV event messages that could not be read, by "
                                       "reason (as fleet_router_kv_event_errors).", [*kv, "reason"],
                                       registry=r)  # fmt: skip
        self.facts = PickerFacts()
        r.register(_ScrapeGauges(self.facts))  # type: ignore[arg-type]  # duck-typed Collector

    def watch_kv_streams(self, streams) -> None:
        """Read the KV stream gauges from `streams.kv_rows()` at each scrape."""
        self.facts.kv_rows = streams.kv_rows

    def bind_kv(self, model: str, endpoint_id: str) -> KvEndpointMetrics:
        """The KV event counters of one endpoint's stream (the families above, router's bundle)."""
        return KvEndpointMetrics(self, model, endpoint_id)  # type: ignore[arg-type]  # the four kv families

    def render(self) -> bytes:
        """The text exposition of every family."""
        return generate_latest(self.registry)


async def serve_http(metrics: PickerMetrics, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `/metrics`, `/ready` and `/healthz` on `host`:`port` (0: a free one) on the running
    loop; returns the runner (`await runner.cleanup()` stops it) and the port bound. Raises
    OSError if it cannot bind."""

    async def metrics_page(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), content_type="text/plain")

    async def ready(request: web.Request) -> web.Response:
        leading = metrics.facts.leading()
        return web.json_response({"leader": leading}, status=200 if leading else 503)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/ready", ready)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, runner.addresses[0][1]
