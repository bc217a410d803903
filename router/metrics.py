"""Prometheus metrics of the router, on a registry of its own.

Owns the metric families the router exports at `GET /metrics` and the per-endpoint bundle
of pre-bound label children (`EndpointMetrics`) that the request path updates without any
label lookup. Created once per app by `router.app.create_app`; `router.pool.PoolTable`
binds and forgets endpoint bundles as pools change; `router.proxy` records into them.

The gauges (`fleet_router_requests_in_flight`, `fleet_router_pool_endpoints`,
`fleet_router_queued_requests`, and the windowed `fleet_router_arrival_rate` and
`fleet_router_window_latency_seconds`) are read from the live pools and their
`router.stats.ModelStats` when scraped, so the request path pays nothing for them; counters and
histograms are updated on the request path through pre-bound children.

Names follow the Prometheus conventions (base units, `_total` for counters, `_seconds` for
durations). The registry is a dedicated `CollectorRegistry`, never the process-global one,
so several apps (tests, embedding) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

TTFB_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the time-to-first-byte histogram: vLLM's
`TIME_TO_FIRST_TOKEN_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32), so the router's
TTFT and the engines' `vllm:time_to_first_token_seconds` can be compared bucket by bucket."""

E2E_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1,
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the end-to-end latency histogram: vLLM's
`REQUEST_LATENCY_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32, 0.3 s to 7680 s) with
four sub-0.3 s bounds added in front, because the router also sees fast upstream errors
and tiny completions that vLLM's engine-side histogram lumps into its first bucket."""

ENDPOINT_ERROR_REASONS = ("connect", "timeout", "http_5xx", "interrupted")
"""Values of the `reason` label of `fleet_router_endpoint_errors_total`:
`connect` - the connection failed before any response byte (refused, reset, closed before
the status line, connect timeout); the request is retried on another endpoint.
`timeout` - no response headers within the read timeout (504 to the client).
`http_5xx` - the endpoint answered with a 5xx status (relayed as is).
`interrupted` - the endpoint failed after its response began (the client sees a truncated
stream, or a 502 if nothing had been sent to it yet)."""


class LiveEndpoint(Protocol):
    """What the scrape-time gauges read from an endpoint (`router.pool.EndpointState`)."""

    id: str
    in_flight: int
    draining: bool


class LiveTable(Protocol):
    """What the scrape-time gauges read from the pools (`router.pool.PoolTable`)."""

    def live_endpoints(self) -> Mapping[str, Sequence[LiveEndpoint]]:
        """Every pool's endpoints by model name."""
        ...

    def stats(self) -> Mapping[str, Mapping[str, object]]:
        """Every pool's windowed statistics by model name (`router.stats.ModelStats.snapshot`)."""
        ...


class _NoPools:
    def live_endpoints(self) -> Mapping[str, Sequence[LiveEndpoint]]:
        return {}

    def stats(self) -> Mapping[str, Mapping[str, object]]:
        return {}


WINDOW_SIGNALS = {"queue_time": "queue_time_s", "ttft": "ttft_s", "e2e": "e2e_s"}
"""`signal` label of `fleet_router_window_latency_seconds` -> key of the stats snapshot."""


class EndpointMetrics:
    """Label children of one (model, endpoint) pair, bound once so recording is cheap.

    `ttfb` and `e2e` are histogram children (seconds); `requests(code)` and
    `error(reason)` return cached counter children.
    """

    __slots__ = ("model", "endpoint_id", "ttfb", "e2e", "_requests", "_errors", "_metrics")

    def __init__(self, metrics: RouterMetrics, model: str, endpoint_id: str) -> None:
        self.model = model
        self.endpoint_id = endpoint_id
        self._metrics = metrics
        self.ttfb = metrics.time_to_first_byte.labels(model, endpoint_id)
        self.e2e = metrics.e2e_latency.labels(model, endpoint_id)
        self._requests: dict[int, Counter] = {}
        self._errors = {r: metrics.endpoint_errors.labels(model, endpoint_id, r) for r in ENDPOINT_ERROR_REASONS}

    def requests(self, code: int) -> Counter:
        """The `fleet_router_requests_total` child for HTTP status `code`."""
        child = self._requests.get(code)
        if child is None:
            child = self._metrics.requests.labels(self.model, self.endpoint_id, str(code))
            self._requests[code] = child
        return child

    def error(self, reason: str) -> Counter:
        """The `fleet_router_endpoint_errors_total` child for `reason` (see ENDPOINT_ERROR_REASONS)."""
        return self._errors[reason]


class _LiveGauges:
    """Collector of the gauges derived from the live pools when the registry is scraped."""

    def __init__(self) -> None:
        self.table: LiveTable = _NoPools()

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> tuple[GaugeMetricFamily, ...]:
        return (
            GaugeMetricFamily("fleet_router_requests_in_flight",
                              "Requests dispatched to an endpoint and not yet finished.",
                              labels=["model", "endpoint"]),
            GaugeMetricFamily("fleet_router_pool_endpoints",
                              "Endpoints in a model's pool, by state (ready, draining).",
                              labels=["model", "state"]),
            GaugeMetricFamily("fleet_router_queued_requests",
                              "Requests waiting in a model's admission queue for a free endpoint slot.",
                              labels=["model"]),
            GaugeMetricFamily("fleet_router_arrival_rate",
                              "Requests per second that reached a model's pool, over the stats window "
                              "(router.stats.DEFAULT_WINDOW_S).",
                              labels=["model"]),
            GaugeMetricFamily("fleet_router_window_latency_seconds",
                              "Exact nearest-rank quantiles over the stats window of the client-side "
                              "queue time, time to first token and end-to-end latency (router.stats).",
                              labels=["model", "signal", "quantile"]),
        )  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        in_flight, pool_endpoints, queued, arrival_rate, window_latency = self._families()
        for model, endpoints in self.table.live_endpoints().items():
            draining = 0
            for endpoint in endpoints:
                in_flight.add_metric([model, endpoint.id], endpoint.in_flight)
                draining += endpoint.draining
            pool_endpoints.add_metric([model, "ready"], len(endpoints) - draining)
            pool_endpoints.add_metric([model, "draining"], draining)
        for model, snap in self.table.stats().items():
            queued.add_metric([model], float(snap["queued"]))  # type: ignore[arg-type]
            arrival_rate.add_metric([model], float(snap["arrival_rate_per_s"]))  # type: ignore[arg-type]
            for signal, key in WINDOW_SIGNALS.items():
                summary = snap[key]
                for quantile in ("p50", "p90", "p99"):
                    value = summary[quantile]  # type: ignore[index]
                    if value is not None:
                        window_latency.add_metric([model, signal, f"0.{quantile[1:]}"], value)
        yield in_flight
        yield pool_endpoints
        yield queued
        yield arrival_rate
        yield window_latency


class RouterMetrics:
    """The router's metric families on a dedicated `CollectorRegistry`.

    One instance per app. `bind(model, endpoint_id)` returns the pre-bound children of an
    endpoint; `forget(model, endpoint_id)` drops all series of an endpoint that left its
    pool, so endpoint churn does not grow the exposition without bound; `watch_pools`
    connects the scrape-time gauges to the live pools.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        endpoint = ["model", "endpoint"]
        self.requests = Counter(
            "fleet_router_requests",
            "Requests answered by an endpoint, by HTTP status code the endpoint returned.",
            [*endpoint, "code"],
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "fleet_router_time_to_first_byte_seconds",
            "Seconds from dispatching a request to an endpoint until its response began: the "
            "first body chunk for streamed responses (the time to first token), the response "
            "head for sized ones. Successful (< 400) responses only.",
            endpoint,
            buckets=TTFB_BUCKETS_S,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "fleet_router_e2e_request_latency_seconds",
            "Seconds from dispatching a request to an endpoint until the last response byte "
            "was relayed to the client.",
            endpoint,
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.endpoint_errors = Counter(
            "fleet_router_endpoint_errors",
            "Failed attempts against an endpoint, by reason (connect, timeout, http_5xx, interrupted).",
            [*endpoint, "reason"],
            registry=r,
        )
        self.retries = Counter(
            "fleet_router_retries",
            "Requests re-sent to another endpoint after a connection failure before any "
            "response byte arrived.",
            ["model"],
            registry=r,
        )
        self.queue_time = Histogram(
            "fleet_router_queue_time_seconds",
            "Seconds from a request's arrival at the router (body read, model known) until its "
            "dispatch to an endpoint: the wait in the admission queue, 0 without one (a request "
            "that timed out in the queue counts with the time it waited).",
            ["model"],
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.rejected = Counter(
            "fleet_router_rejected_requests",
            "Requests the router answered itself (400 bad request, 404 unknown model, 502 "
            "all attempts failed, 503 no ready endpoint). model is empty unless it names a pool.",
            ["model", "code"],
            registry=r,
        )
        self._live = _LiveGauges()
        r.register(self._live)  # type: ignore[arg-type]  # duck-typed Collector

    def watch_pools(self, table: LiveTable) -> None:
        """Read the scrape-time gauges from `table` at each scrape (called once by
        `router.pool.PoolTable`)."""
        self._live.table = table

    def bind_model(self, model: str) -> Histogram:
        """The pre-bound `fleet_router_queue_time_seconds` child of `model`."""
        return self.queue_time.labels(model)  # type: ignore[no-any-return]

    def bind(self, model: str, endpoint_id: str) -> EndpointMetrics:
        """Pre-bound label children for one endpoint of `model`'s pool."""
        return EndpointMetrics(self, model, endpoint_id)

    def forget(self, model: str, endpoint_id: str) -> None:
        """Remove every series labelled with this (model, endpoint)."""
        labels = {"model": model, "endpoint": endpoint_id}
        for family in (self.requests, self.time_to_first_byte, self.e2e_latency, self.endpoint_errors):
            family.remove_by_labels(labels)

    def forget_pool(self, model: str) -> None:
        """Remove the pool-level series of a deleted pool."""
        for family in (self.retries, self.rejected, self.queue_time):
            family.remove_by_labels({"model": model})

    def render(self, accept_header: str = "") -> tuple[bytes, str]:
        """Text exposition of the registry and its content type, negotiated from `Accept`."""
        encoder: Callable[[CollectorRegistry], bytes]
        encoder, content_type = choose_encoder(accept_header)
        return encoder(self.registry), content_type
