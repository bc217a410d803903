"""The label children of one endpoint and of one KV event stream, bound once and forgotten
exactly.

Owns `EndpointMetrics` (the (model, endpoint, version) children the request path updates
without any label lookup: `router.request.attempt` and `router.request.relay` record into it,
`router.pools.endpoint.EndpointState` holds it) and `KvEndpointMetrics` (the (model, endpoint)
counters of a KV event stream, held by `router.signals.kv_subscriber.KvEventSubscriber`), both
over the families of `router.stats.metric_families.RouterFamilies`, and
`ENDPOINT_ERROR_REASONS`. Made by `router.stats.metrics.RouterMetrics.bind` and `bind_kv`.
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from router.protocol.tokens import TokenCount
from router.stats.metric_families import RouterFamilies

ENDPOINT_ERROR_REASONS = ("connect", "timeout", "http_5xx", "interrupted")
"""Values of the `reason` label of `fleet_router_endpoint_errors_total`:
`connect` - the connection failed before any response byte (refused, reset, closed before
the status line, connect timeout); the request is retried on another endpoint.
`timeout` - no response headers within the read timeout (504 to the client).
`http_5xx` - the endpoint answered with a 5xx status (relayed as is).
`interrupted` - the endpoint failed after its response began: a stream broken off or cut by its
guard (migrated, or ended with an error event), an error event inside a 200 stream, a sized body
cut off, not a JSON object or over its size limit (retried while nothing had been sent, else a
502)."""


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
    and only the endpoints that get traffic export series. `bind()` (called by `router.request.attempt`
    once, when `bound` is False) creates the histogram children `first_byte`, `ttft`, `tpot`,
    `e2e` (seconds) and the error counters; `requests(code)` and `error(reason)` return cached
    counter children. `forget()` removes exactly the series this object created, each by its
    full label set (O(1) each, never a scan of the family), and turns every later record into a
    no-op, so a request still in flight on a removed endpoint cannot resurrect its series.
    """

    __slots__ = ("labels", "bound", "forgotten", "first_byte", "ttft", "tpot", "e2e", "first_token_timeouts",
                 "_requests", "_errors", "_ejections", "_metrics", "_tokens")  # fmt: skip

    def __init__(self, metrics: RouterFamilies, model: str, endpoint_id: str, version: str = "") -> None:
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
        deletion removes them, `router.stats.metrics.RouterMetrics.forget_pool`).

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


class KvEndpointMetrics:
    """The KV event counters of one (model, endpoint) stream: `events` and `gaps` children, and
    `resync(reason)` / `error(reason)`. `forget()` removes every series it created (the endpoint
    left its pool) and turns later records into no-ops."""

    __slots__ = ("labels", "events", "gaps", "_metrics", "_made")

    def __init__(self, metrics: RouterFamilies, model: str, endpoint_id: str) -> None:
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


