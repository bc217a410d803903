"""One engine endpoint as the router sees it: identity from the pool spec, live load and latency.

Owns `EndpointState` and the constants of its latency estimate (`EWMA_ALPHA`,
`FAILURE_PENALTY_S`, `DEFAULT_FAILURE_COOLDOWN_S`). The request path updates it at dispatch,
first byte and finish (`router.request.attempt`, `router.request.relay`); routing policies (`router.pools.policies`) and the revision split
(`router.pools.split`) read it; pools (`router.pools.pool`) hold it. The trace simulator updates the same
objects at the same points. Pure: times are passed in.
"""

from __future__ import annotations

from router.stats.endpoint_metrics import EndpointMetrics
from router.pools.outlier import OutlierState

EWMA_ALPHA = 0.3
"""Weight of the newest time-to-first-byte sample in `EndpointState.ewma_first_byte_s`:
ewma <- alpha * sample + (1 - alpha) * ewma. At 0.3 a sample's weight halves after about
two further samples, so a slowdown shows within a handful of requests while one outlier
moves the average by under a third of its excess."""

FAILURE_PENALTY_S = 10.0
"""A failed attempt (connect error, timeout, 5xx, interrupted response) is folded into
`ewma_first_byte_s` as a sample of this many seconds, far above interactive TTFTs, so that
`latency-aware` ranks a failing endpoint last among equally loaded ones instead of
treating a fast error as a fast endpoint (or, having no sample, as unknown and first).
It is not observed in any latency histogram."""

DEFAULT_FAILURE_COOLDOWN_S = 2.0
"""After a connection failure (nothing reached the endpoint) the endpoint is left out of
the candidates for this many seconds, so that requests do not each pay a failed connect
(or a connect timeout) before being retried elsewhere. If every ready endpoint is cooling
down they are all candidates again: trying beats refusing."""


class EndpointState:
    """One endpoint of a pool: its spec fields and the live stats the router measured.

    Spec fields: `id`, `url` (base URL, no trailing slash), `version`, `weight`, `draining`.
    Live stats: `in_flight` (requests dispatched, not finished), `requests_total`
    (attempts dispatched), `errors_total` (attempts that failed: connect error, 5xx,
    interrupted), `ewma_first_byte_s` (EWMA of the time to first byte, seconds: the first body
    chunk of a streamed reply, the response head of a sized one, so for a non-streamed
    completion the whole generation; None before the first sample), `last_sample_s`
    (router-clock seconds of the latest sample; None before it), `unavailable_until_s`
    (router-clock seconds until which a connection failure keeps the endpoint out of the
    candidates), `prefill_tokens` (prompt tokens, not expected cached, of the requests in
    flight that have no first byte yet: queued prefill work) and `prefilling` (how many
    requests those are; `in_flight - prefilling` are decoding), kept by `start`, `first_byte`
    and `finish`. `metrics` holds the endpoint's Prometheus children
    (`router.stats.endpoint_metrics.EndpointMetrics`; None outside a `PoolTable`).

    The load other routers sent (docs/routing.md, "Two routers or more"): `others_in_flight`,
    `others_prefilling` and `others_prefill_tokens` estimate the requests in flight, those not
    yet past their first token, and their prompt tokens to prefill, that reached the engine from
    anywhere but this router, as of the engine's latest load sample (`router.signals.engine_load`);
    `others_until_s` (router-clock seconds) is when that estimate goes stale (0: none). The
    fields are written only here, through `set_others_load` and `forget_others_load`: the signal
    that estimates them hands its figures over (`router.signals.engine_load.EngineLoadView` from
    the engines' load, live and in the trace simulator); `kv-aware` reads them.

    Outlier ejection: `outlier` holds its outlier counters and ejection (`router.pools.outlier.OutlierState`); `ejected_until_s` (router-clock
    seconds, 0.0 when in service) mirrors the ejection's end for the picking loop
    (`router.pools.pool.Pool.pick` leaves ejected endpoints out while others remain), and
    `slow_start_since_s` (router-clock seconds, 0.0 when not ramping) when its slow start after an
    ejection began (`router.pools.outlier.OutlierDetector.admit`).
    """

    __slots__ = (
        "id", "url", "version", "weight", "draining",
        "in_flight", "requests_total", "errors_total", "ewma_first_byte_s", "last_sample_s", "unavailable_until_s",
        "prefill_tokens", "prefilling", "metrics",
        "others_in_flight", "others_prefilling", "others_prefill_tokens", "others_until_s",
        "outlier", "ejected_until_s", "slow_start_since_s",
    )  # fmt: skip

    def __init__(
        self,
        id: str,  # the field's name in the spec, shadowing the builtin on purpose
        url: str,
        version: str = "",
        weight: float = 1.0,
        draining: bool = False,
        *,
        metrics: EndpointMetrics | None = None,
    ) -> None:
        self.id = id
        self.url = url.rstrip("/")
        self.version = version
        self.weight = weight
        self.draining = draining
        self.in_flight = 0
        self.requests_total = 0
        self.errors_total = 0
        self.ewma_first_byte_s: float | None = None
        self.last_sample_s: float | None = None
        self.unavailable_until_s = 0.0
        self.prefill_tokens = 0
        self.prefilling = 0
        self.metrics = metrics
        self.others_in_flight = 0
        self.others_prefilling = 0
        self.others_prefill_tokens = 0.0
        self.others_until_s = 0.0
        self.outlier = OutlierState()
        self.ejected_until_s = 0.0
        self.slow_start_since_s = 0.0

    def start(self, prefill_tokens: int) -> None:
        """A request is dispatched here, with `prefill_tokens` to compute before its first token."""
        self.in_flight += 1
        self.requests_total += 1
        self.prefill_tokens += prefill_tokens
        self.prefilling += 1

    def first_byte(self, prefill_tokens: int) -> None:
        """A request started with `prefill_tokens` got its first byte: its prefill is done."""
        self.prefill_tokens -= prefill_tokens
        self.prefilling -= 1

    def finish(self, prefill_tokens: int, got_first_byte: bool) -> None:
        """A request started with `prefill_tokens` left (done, failed or cancelled)."""
        self.in_flight -= 1
        if not got_first_byte:
            self.first_byte(prefill_tokens)

    def set_others_load(self, in_flight: int, prefilling: int, prefill_tokens: float, until_s: float) -> None:
        """The load other routers sent here is now `in_flight` requests, `prefilling` of them not
        past their first token, with `prefill_tokens` prompt tokens to prefill; the estimate holds
        until `until_s` (router-clock seconds)."""
        self.others_in_flight = in_flight
        self.others_prefilling = prefilling
        self.others_prefill_tokens = prefill_tokens
        self.others_until_s = until_s

    def forget_others_load(self) -> None:
        """No estimate of the others' load any more (its source is gone): own load only."""
        self.set_others_load(0, 0, 0.0, 0.0)

    def record_first_byte(self, first_byte_s: float, now_s: float) -> None:
        """Fold one time-to-first-byte sample (seconds) into the EWMA (see `EWMA_ALPHA`)."""
        ewma_s = self.ewma_first_byte_s
        self.ewma_first_byte_s = (first_byte_s if ewma_s is None
                                  else EWMA_ALPHA * first_byte_s + (1.0 - EWMA_ALPHA) * ewma_s)  # fmt: skip
        self.last_sample_s = now_s

    def record_failure(self, now_s: float, cooldown_s: float = 0.0) -> None:
        """Count a failed attempt: fold `FAILURE_PENALTY_S` into the EWMA and, for a
        connection failure, keep the endpoint out of the candidates for `cooldown_s`."""
        self.errors_total += 1
        self.record_first_byte(FAILURE_PENALTY_S, now_s)
        if cooldown_s > 0.0:
            self.unavailable_until_s = now_s + cooldown_s

    def snapshot(self, now_s: float | None = None) -> dict[str, object]:
        """The fields `GET /admin/v1/pools` lists for this endpoint; with `now_s` (router-clock
        seconds) also its outlier state (`router.pools.outlier.OutlierState.snapshot`)."""
        out: dict[str, object] = {
            "id": self.id,
            "url": self.url,
            "version": self.version,
            "weight": self.weight,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "requests_total": self.requests_total,
            "errors_total": self.errors_total,
            "ewma_first_byte_s": self.ewma_first_byte_s,
        }
        if now_s is not None:
            out.update(self.outlier.snapshot(now_s))
        return out

    def __repr__(self) -> str:
        return (
            f"EndpointState(id={self.id!r}, url={self.url!r}, draining={self.draining}, "
            f"in_flight={self.in_flight}, ewma_first_byte_s={self.ewma_first_byte_s})"
        )
