"""Prometheus metrics of the router, on a registry of its own.

Owns the metric families the router exports at `GET /metrics` and the per-endpoint bundle
of label children (`EndpointMetrics`, bound at an endpoint's first request) that the request
path updates without any label lookup. Created once per app by `router.http.app.create_app`;
`router.pools.pool.PoolTable` creates and forgets endpoint bundles as pools change; `router.request.proxy`
binds and records into them, and counts the router's own error answers (`RouterMetrics.reject`).

The gauges (`fleet_router_requests_in_flight`, `fleet_router_pool_endpoints`,
`fleet_router_queued_requests`, and the windowed `fleet_router_arrival_rate` and
`fleet_router_window_latency_seconds`) are read from the live pools and their
`router.stats.windows.ModelStats` when scraped, so the request path pays nothing for them; counters and
histograms are updated on the request path through pre-bound children.

Names follow the Prometheus conventions (base units, `_total` for counters, `_seconds` for
durations). The registry is a dedicated `CollectorRegistry`, never the process-global one,
so several apps (tests, embedding) can live in one process.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from router.protocol.tokens import TokenCount

TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the time-to-first-token and time-to-first-byte histograms: vLLM's
`TIME_TO_FIRST_TOKEN_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32), so the router's
TTFT and the engines' `vllm:time_to_first_token_seconds` can be compared bucket by bucket."""

TPOT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the time-per-output-token histogram: vLLM's
`INTER_TOKEN_LATENCY_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32; the buckets of
`vllm:request_time_per_output_token_seconds`, as in fleet/enginesim/metrics.py)."""

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
    """What the scrape-time gauges read from an endpoint (`router.pools.endpoint.EndpointState`)."""

    id: str
    in_flight: int
    draining: bool
    ejected_until_s: float


class LiveTable(Protocol):
    """What the scrape-time gauges read from the pools (`router.pools.pool.PoolTable`)."""

    def live_endpoints(self) -> Mapping[str, Sequence[LiveEndpoint]]:
        """Every pool's endpoints by model name."""
        ...

    def stats(self) -> Mapping[str, Mapping[str, object]]:
        """Every pool's windowed statistics by model name (`router.stats.windows.ModelStats.snapshot`)."""
        ...

    def now_s(self) -> float:
        """The table's clock (seconds; what `ejected_until_s` is measured on)."""
        ...


class _NoPools:
    def live_endpoints(self) -> Mapping[str, Sequence[LiveEndpoint]]:
        return {}

    def stats(self) -> Mapping[str, Mapping[str, object]]:
        return {}

    def now_s(self) -> float:
        return 0.0


WINDOW_SIGNALS = {"queue_time": "queue_time_s", "ttft": "ttft_s", "tpot": "tpot_s", "e2e": "e2e_s"}
"""`signal` label of `fleet_router_window_latency_seconds` -> key of the stats snapshot."""


ENDPOINT_LABELS = ("model", "endpoint", "version")
"""Labels of every per-endpoint series: the pool's model, the endpoint id and the endpoint's
version (`router.pools.spec.EndpointSpec.version`), so dashboards compare a canary's version with the
stable one (`sum by (model, version)`). Bounded by the pools an operator declares, never by
clients; an endpoint that leaves its pool (or changes version) takes its series with it."""

UNKNOWN_MODEL = "(unknown)"
"""`model` label of a rejected request that named a model the router has no pool for. Clients
choose model names freely, so echoing them into a label would let anyone create unbounded
series (and memory) with random names; a model is a label value only while it has a pool."""


class _Discard:
    """Stands in for the children of a forgotten endpoint: records nothing, creates no series."""

    __slots__ = ()

    def observe(self, amount: float) -> None:
        pass

    def inc(self, amount: float = 1.0) -> None:
        pass


_DISCARD = _Discard()


class EndpointMetrics:
    """Label children of one (model, endpoint, version), bound at the endpoint's first attempt.

    Creating the object is cheap (no series): a pool of 10,000 endpoints is put in milliseconds
    and only the endpoints that get traffic export series. `bind()` (called by `router.request.proxy`
    once, when `bound` is False) creates the histogram children `first_byte`, `ttft`, `tpot`,
    `e2e` (seconds) and the error counters; `requests(code)` and `error(reason)` return cached
    counter children. `forget()` removes exactly the series this object created, each by its
    full label set (O(1) each, never a scan of the family), and turns every later record into a
    no-op, so a request still in flight on a removed endpoint cannot resurrect its series.
    """

    __slots__ = ("labels", "bound", "forgotten", "first_byte", "ttft", "tpot", "e2e", "first_token_timeouts",
                 "_requests", "_errors", "_ejections", "_metrics", "_tokens")  # fmt: skip

    def __init__(self, metrics: RouterMetrics, model: str, endpoint_id: str, version: str = "") -> None:
        self.labels = (model, endpoint_id, version)
        self._metrics = metrics
        self.bound = False
        self.forgotten = False
        self.first_byte: Histogram | _Discard = _DISCARD
        self.ttft: Histogram | _Discard = _DISCARD
        self.tpot: Histogram | _Discard = _DISCARD
        self.e2e: Histogram | _Discard = _DISCARD
        self.first_token_timeouts: Counter | _Discard = _DISCARD
        self._ejections: dict[str, Counter] = {}   # by reason, made at the first ejection
        self._requests: dict[int, Counter | _Discard] | None = None  # made at bind: pools of 10,000
        self._errors: dict[str, Counter | _Discard] | None = None  # allocate nothing per endpoint
        # prompt, generated, no usage, prefix-cache hits, predicted hits
        self._tokens: tuple[Counter | _Discard, ...] = (_DISCARD,) * 5

    def bind(self) -> None:
        """Create this endpoint's series (no-op once bound or after `forget`)."""
        if self.bound or self.forgotten:
            return
        m, labels = self._metrics, self.labels
        self.first_byte = m.time_to_first_byte.labels(*labels)
        self.ttft = m.time_to_first_token.labels(*labels)
        self.tpot = m.time_per_output_token.labels(*labels)
        self.e2e = m.e2e_latency.labels(*labels)
        self.first_token_timeouts = m.first_token_timeouts.labels(*labels)
        self._errors = {r: m.endpoint_errors.labels(*labels, r) for r in ENDPOINT_ERROR_REASONS}
        self._requests = {}
        model_version = (labels[0], labels[2])
        self._tokens = (m.prompt_tokens.labels(*model_version), m.generation_tokens.labels(*model_version),
                        m.responses_without_usage.labels(*model_version),
                        m.prefix_cache_hits.labels(*model_version),
                        m.prefix_cache_predicted_hits.labels(*model_version))  # fmt: skip
        self.bound = True

    def requests(self, code: int) -> Counter | _Discard:
        """The `fleet_router_requests_total` child for HTTP status `code`."""
        requests = self._requests
        if requests is None:  # not bound (or forgotten): count nowhere
            return _DISCARD
        child = requests.get(code)
        if child is None:
            child = requests[code] = self._metrics.requests.labels(*self.labels, str(code))
        return child

    def error(self, reason: str) -> Counter | _Discard:
        """The `fleet_router_endpoint_errors_total` child for `reason` (see ENDPOINT_ERROR_REASONS)."""
        return _DISCARD if self._errors is None else self._errors.get(reason, _DISCARD)

    def ejected(self, reason: str) -> None:
        """Count one ejection of the endpoint (`fleet_router_endpoint_ejections_total`; `reason`:
        a `router.pools.outlier.Outcome` value). No-op once forgotten."""
        if self.forgotten:
            return
        child = self._ejections.get(reason)
        if child is None:
            child = self._ejections[reason] = self._metrics.endpoint_ejections.labels(*self.labels, reason)
        child.inc()

    def count_tokens(self, tokens: TokenCount, predicted_cached: int = 0) -> None:
        """Add one answered request's tokens (`router.protocol.tokens`) to its model and version's counters.
        Those series are shared by the version's endpoints: `forget` leaves them (the pool's
        deletion removes them, `RouterMetrics.forget_pool`).

        `predicted_cached`: the prompt tokens the routing policy expected this endpoint to hold
        (`RouteRequest.cached_tokens`). It is counted only when the usage says what the engine
        held (`tokens.cached`), so the hit and predicted-hit counters cover the same requests."""
        prompt, generated, without_usage, hits, predicted = self._tokens
        if tokens.prompt is not None:
            prompt.inc(tokens.prompt)
        if tokens.generated:
            generated.inc(tokens.generated)
        if not tokens.from_usage:
            without_usage.inc()
        if tokens.cached is not None:
            hits.inc(tokens.cached)
            predicted.inc(predicted_cached)

    def forget(self) -> None:
        """Remove every series this endpoint created; later records go nowhere."""
        if self.forgotten:
            return
        self.forgotten = True
        m, labels = self._metrics, self.labels
        if self.bound:
            for family in (m.time_to_first_byte, m.time_to_first_token, m.time_per_output_token, m.e2e_latency,
                           m.first_token_timeouts):
                family.remove(*labels)
            for reason in self._errors or ():
                m.endpoint_errors.remove(*labels, reason)
            for code in self._requests or ():
                m.requests.remove(*labels, str(code))
        for reason in self._ejections:
            m.endpoint_ejections.remove(*labels, reason)
        self._ejections = {}
        self.first_byte = self.ttft = self.tpot = self.e2e = self.first_token_timeouts = _DISCARD
        self._requests = self._errors = None
        self._tokens = (_DISCARD,) * 5


_ScrapeView = tuple[Mapping[str, Sequence[LiveEndpoint]], Mapping[str, Mapping[str, object]], float]
_SCRAPE_VIEW: contextvars.ContextVar[_ScrapeView | None] = contextvars.ContextVar("fleet_router_scrape_view",
                                                                                  default=None)
"""The live pools' endpoints, statistics and clock reading as `RouterMetrics.render_off_loop` read
them on the event loop, for the collector that runs in a worker thread (None: read the live table)."""


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
            GaugeMetricFamily("fleet_router_endpoint_ejected",
                              "1 while outlier detection keeps an endpoint out of its pool's candidates "
                              "(router.pools.outlier), else 0.",
                              labels=["model", "endpoint"]),
            GaugeMetricFamily("fleet_router_queued_requests",
                              "Requests waiting in a model's admission queue for a free endpoint slot.",
                              labels=["model"]),
            GaugeMetricFamily("fleet_router_arrival_rate",
                              "Requests per second that reached a model's pool, over the stats window "
                              "(router.stats.windows.DEFAULT_WINDOW_S).",
                              labels=["model"]),
            GaugeMetricFamily("fleet_router_window_latency_seconds",
                              "Exact nearest-rank quantiles over the stats window of the client-side "
                              "queue time, time to first byte (signal ttft: the time to first token of "
                              "a streamed reply), time per output token (streamed replies) and "
                              "end-to-end latency (router.stats.windows).",
                              labels=["model", "signal", "quantile"]),
        )  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        in_flight, pool_endpoints, ejected, queued, arrival_rate, window_latency = self._families()
        view = _SCRAPE_VIEW.get()
        live, stats, now_s = view if view is not None else (self.table.live_endpoints(), self.table.stats(),
                                                            self.table.now_s())  # fmt: skip
        for model, endpoints in live.items():
            draining = 0
            for endpoint in endpoints:
                in_flight.add_metric([model, endpoint.id], endpoint.in_flight)
                ejected.add_metric([model, endpoint.id], 1.0 if endpoint.ejected_until_s > now_s else 0.0)
                draining += endpoint.draining
            pool_endpoints.add_metric([model, "ready"], len(endpoints) - draining)
            pool_endpoints.add_metric([model, "draining"], draining)
        for model, snap in stats.items():
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
        yield ejected
        yield queued
        yield arrival_rate
        yield window_latency


class KvStreamsView(Protocol):
    """What the KV stream gauges read (`router.signals.kv_subscriber.KvEventStreams`)."""

    def kv_rows(self) -> list[tuple[str, str, bool, int]]:
        """(model, endpoint, live, blocks held) of every endpoint with a KV event stream."""
        ...


class _NoStreams:
    def kv_rows(self) -> list[tuple[str, str, bool, int]]:
        return []


_KV_SCRAPE_VIEW: contextvars.ContextVar[list[tuple[str, str, bool, int]] | None] = contextvars.ContextVar(
    "fleet_router_kv_scrape_view", default=None)
"""The KV stream rows as `RouterMetrics.render_off_loop` read them on the event loop."""


class _KvGauges:
    """Collector of the KV event stream gauges, read from the subscribers when scraped."""

    def __init__(self) -> None:
        self.streams: KvStreamsView = _NoStreams()

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily("fleet_router_kv_stream_live",
                              "1 while an endpoint's KV event stream is connected and its exact view complete "
                              "(kv-aware routes on the exact index), 0 while it is down or rebuilding (the "
                              "approximate index applies).", labels=["model", "endpoint"]),
            GaugeMetricFamily("fleet_router_kv_index_blocks",
                              "KV cache blocks the router's exact index holds for an endpoint (bounded by "
                              "router.kv.exact_index.DEFAULT_MAX_BLOCKS_PER_ENDPOINT).", labels=["model", "endpoint"]),
        )  # fmt: skip

    def collect(self) -> Iterator[Metric]:
        live, blocks = self._families()
        rows = _KV_SCRAPE_VIEW.get()
        for model, endpoint, is_live, held in rows if rows is not None else self.streams.kv_rows():
            live.add_metric([model, endpoint], 1.0 if is_live else 0.0)
            blocks.add_metric([model, endpoint], float(held))
        yield live
        yield blocks


class KvEndpointMetrics:
    """The KV event counters of one (model, endpoint) stream: `events` and `gaps` children, and
    `resync(reason)` / `error(reason)`. `forget()` removes every series it created (the endpoint
    left its pool) and turns later records into no-ops."""

    __slots__ = ("labels", "events", "gaps", "_metrics", "_made")

    def __init__(self, metrics: RouterMetrics, model: str, endpoint_id: str) -> None:
        self.labels = (model, endpoint_id)
        self._metrics = metrics
        self.events: Counter | _Discard = metrics.kv_events.labels(model, endpoint_id)
        self.gaps: Counter | _Discard = metrics.kv_event_gaps.labels(model, endpoint_id)
        self._made: set[tuple[str, str]] | None = set()

    def resync(self, reason: str) -> None:
        """Count a resync for `reason` (see `fleet_router_kv_event_resyncs_total`)."""
        self._child("resync", reason).inc()

    def error(self, reason: str) -> None:
        """Count an unreadable message for `reason` (see `fleet_router_kv_event_errors_total`)."""
        self._child("error", reason).inc()

    def _child(self, kind: str, reason: str) -> Counter | _Discard:
        if self._made is None:
            return _DISCARD
        self._made.add((kind, reason))
        family = self._metrics.kv_event_resyncs if kind == "resync" else self._metrics.kv_event_errors
        return family.labels(*self.labels, reason)

    def forget(self) -> None:
        """Remove this stream's series; later records go nowhere."""
        if self._made is None:
            return
        m = self._metrics
        m.kv_events.remove(*self.labels)
        m.kv_event_gaps.remove(*self.labels)
        for kind, reason in self._made:
            (m.kv_event_resyncs if kind == "resync" else m.kv_event_errors).remove(*self.labels, reason)
        self._made = None
        self.events = self.gaps = _DISCARD


class RouterMetrics:
    """The router's metric families on a dedicated `CollectorRegistry`.

    One instance per app. `bind(model, endpoint_id, version)` returns the label children of an
    endpoint (`EndpointMetrics`, whose `forget()` drops its series when it leaves the pool, so
    endpoint churn does not grow the exposition); `reject` counts the router's own error
    answers; `watch_pools` connects the scrape-time gauges to the live pools.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        endpoint = list(ENDPOINT_LABELS)
        self.requests = Counter(
            "fleet_router_requests",
            "Requests answered by an endpoint, by HTTP status code the endpoint returned.",
            [*endpoint, "code"],
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "fleet_router_time_to_first_byte_seconds",
            "Seconds from dispatching a request to an endpoint until its response began: the first "
            "body chunk of a streamed response, the response head of a sized one (for a non-streamed "
            "completion that is the whole answer). Successful (< 400) responses only.",
            endpoint,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "fleet_router_time_to_first_token_seconds",
            "Seconds from dispatching a streamed request to an endpoint until the first SSE event "
            "carrying generated text (text, content, reasoning or a tool call) arrived. Successful "
            "(< 400) streamed responses only.",
            endpoint,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "fleet_router_time_per_output_token_seconds",
            "Per streamed request: (arrival of the last token event - arrival of the first) / "
            "(output tokens - 1), output tokens from the stream's usage chunk when it has one, else "
            "the count of events carrying text (router.protocol.sse). Requests with >= 2 tokens over >= 2 reads.",
            endpoint,
            buckets=TPOT_BUCKETS_S,
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
            "Requests re-sent to another endpoint while nothing had been sent to the client: after a "
            "connection failure before any response byte, a first-token timeout or a 5xx answer.",
            ["model"],
            registry=r,
        )
        self.first_token_timeouts = Counter(
            "fleet_router_first_token_timeouts",
            "Attempts that got no first token (streamed) or response head (not streamed) from the endpoint "
            "within the request's first-token deadline (router.request.deadline): a stalled or overloaded engine.",
            endpoint,
            registry=r,
        )
        self.endpoint_ejections = Counter(
            "fleet_router_endpoint_ejections",
            "Times outlier detection took an endpoint out of its pool's candidates (router.pools.outlier), by the "
            "failure run that caused it: stall (first-token timeouts), gateway (502/503/504, connection "
            "failures), 5xx.",
            [*endpoint, "reason"],
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
            "Requests the router answered itself with an error, by HTTP status: 400 bad request "
            "(JSON or HTTP), "
            "401 admin token, 404 unknown model or path, 405, 408 request not received in time, 413, "
            "414 request target too long, 422 bad admin document, 431 request head or a header "
            "too large, 500 router bug, 502 all attempts "
            "failed or the endpoint failed before answering, 504 endpoint timed out, 503 no "
            "ready endpoint, queue full, or a model served before a restart not yet published "
            "again. model: the pool's model (or the model served before the restart); '(unknown)' "
            "for a model without a pool; empty when no model was named.",
            ["model", "code"],
            registry=r,
        )
        model_version = ["model", "version"]
        self.prompt_tokens = Counter(
            "fleet_router_prompt_tokens",
            "Prompt tokens of answered (< 400) requests, from the engine's usage object (a stream "
            "without a usage chunk counts none: see fleet_router_responses_without_usage_total). "
            "As vllm:prompt_tokens_total, per model and version (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.generation_tokens = Counter(
            "fleet_router_generation_tokens",
            "Generated (output) tokens of answered (< 400) requests: usage.completion_tokens when the "
            "response has a usage object (always when not streamed; streamed with "
            "stream_options.include_usage), else the stream's events carrying text (one per token "
            "in vLLM's default; fewer when it batches). As vllm:generation_tokens_total (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.responses_without_usage = Counter(
            "fleet_router_responses_without_usage",
            "Answered (< 400) responses without a usage object: their generated tokens were counted "
            "from the stream's text events and their prompt tokens not at all (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "fleet_router_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache, for answered (< 400) requests whose "
            "usage says so (usage.prompt_tokens_details.cached_tokens: vLLM's "
            "--enable-prompt-tokens-details). As vllm:prefix_cache_hits_total, counted at the router, "
            "per model and version (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.prefix_cache_predicted_hits = Counter(
            "fleet_router_prefix_cache_predicted_hits",
            "Prompt tokens the routing policy expected the chosen endpoint to hold in its prefix cache "
            "(kv-aware, cache-aware; 0 for policies that do not predict), for the same requests as "
            "fleet_router_prefix_cache_hits_total: their ratio is how well the router's view of the "
            "caches matches the engines' (1: exact; above: the router believes more is cached).",
            model_version,
            registry=r,
        )
        self.state_write_errors = Counter(
            "fleet_router_state_write_errors",
            "Failed writes of the router's models file (the models it serves, kept so a restarted "
            "router answers 503 for them, not 404, until they are published again; "
            "router.http.remembered). Each failure is retried with backoff; serving is unaffected.",
            registry=r,
        )
        kv = ["model", "endpoint"]
        self.kv_events = Counter(
            "fleet_router_kv_events",
            "KV cache events (vLLM --kv-events-config: BlockStored, BlockRemoved, AllBlocksCleared) applied to the "
            "router's exact block index, live or replayed (router.signals.kv_subscriber).",
            kv, registry=r,
        )  # fmt: skip
        self.kv_event_gaps = Counter(
            "fleet_router_kv_event_gaps",
            "Breaks in an endpoint's KV event stream: a sequence number skipped or gone back, or the stream "
            "reconnected; each is followed by a replay request.",
            kv, registry=r,
        )  # fmt: skip
        self.kv_event_resyncs = Counter(
            "fleet_router_kv_event_resyncs",
            "Times an endpoint's exact view was dropped and rebuilt from the stream, by reason: restart (the "
            "publisher restarted: seq went back or the replayed batch differs), replay_gone (the replay buffer no "
            "longer held the missed batches, or the replay socket did not answer), no_replay (no replay address), "
            "bad_payload (a batch that did not decode).",
            [*kv, "reason"], registry=r,
        )  # fmt: skip
        self.kv_event_errors = Counter(
            "fleet_router_kv_event_errors",
            "KV event messages that could not be read, by reason: decode (payload not a KV event batch), "
            "frames (not topic, seq, payload), replay (a bad replay answer).",
            [*kv, "reason"], registry=r,
        )  # fmt: skip
        self._live = _LiveGauges()
        r.register(self._live)  # type: ignore[arg-type]  # duck-typed Collector
        self._kv_gauges = _KvGauges()
        r.register(self._kv_gauges)  # type: ignore[arg-type]  # duck-typed Collector

    def watch_kv_streams(self, streams: KvStreamsView) -> None:
        """Read `fleet_router_kv_stream_live` and `fleet_router_kv_index_blocks` from `streams` at each
        scrape (called once by `router.signals.kv_subscriber.KvEventStreams`)."""
        self._kv_gauges.streams = streams

    def bind_kv(self, model: str, endpoint_id: str) -> KvEndpointMetrics:
        """The KV event counters of one endpoint's stream (`KvEndpointMetrics`)."""
        return KvEndpointMetrics(self, model, endpoint_id)

    def watch_pools(self, table: LiveTable) -> None:
        """Read the scrape-time gauges from `table` at each scrape (called once by
        `router.pools.pool.PoolTable`)."""
        self._live.table = table

    def bind_model(self, model: str) -> Histogram:
        """The pre-bound `fleet_router_queue_time_seconds` child of `model`."""
        return self.queue_time.labels(model)  # type: ignore[no-any-return]

    def bind(self, model: str, endpoint_id: str, version: str = "") -> EndpointMetrics:
        """The (not yet bound) label children of one endpoint of `model`'s pool."""
        return EndpointMetrics(self, model, endpoint_id, version)

    def reject(self, model: str, status: int, known: bool) -> None:
        """Count one request the router answered itself with `status`. `model`: the model the
        request named ("" if none); `known`: whether it has a pool. An unknown name is counted
        under `UNKNOWN_MODEL`, never as itself (see there)."""
        label = model if known or not model else UNKNOWN_MODEL
        self.rejected.labels(label, str(status)).inc()

    def forget_pool(self, model: str) -> None:
        """Remove the pool-level series of a deleted pool."""
        for family in (self.retries, self.rejected, self.queue_time, self.prompt_tokens, self.generation_tokens,
                       self.responses_without_usage, self.prefix_cache_hits, self.prefix_cache_predicted_hits):  # fmt: skip
            family.remove_by_labels({"model": model})

    async def render_off_loop(self, accept_header: str = "") -> tuple[bytes, str]:
        """`render` in a worker thread, so a scrape never holds the event loop. Encoding is
        Python code that hands the GIL back every few milliseconds, and it grows with the series:
        measured 1.1 s and 12 MB for a pool of 10,000 endpoints of which 1,000 had served
        requests. The live pools are read here, on the loop, so the thread touches no state the
        request path mutates (prometheus_client's own values are locked)."""
        table = self._live.table
        _SCRAPE_VIEW.set((table.live_endpoints(), table.stats(), table.now_s()))
        _KV_SCRAPE_VIEW.set(self._kv_gauges.streams.kv_rows())
        return await asyncio.to_thread(self.render, accept_header)  # the thread gets a copy of the context

    def render(self, accept_header: str = "") -> tuple[bytes, str]:
        """Text exposition of the registry and its content type, negotiated from `Accept`."""
        encoder: Callable[[CollectorRegistry], bytes]
        encoder, content_type = choose_encoder(accept_header)
        return encoder(self.registry), content_type
