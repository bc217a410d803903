"""Live routing state: the endpoints of each model's pool and their measured stats.

Owns `EndpointState` (one engine endpoint: identity from the spec plus live stats the
proxy updates), `Pool` (one model's endpoints and its policy instance) and `PoolTable`
(all pools by model name). `router.admin` replaces pools through `PoolTable.put/delete`;
`router.proxy` reads `PoolTable.get`, picks with `Pool.pick` and records into the chosen
`EndpointState`. Nothing here does I/O or reads a clock: times are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from router.metrics import EndpointMetrics, RouterMetrics
from router.policies import RoutingPolicy, make_policy
from router.spec import PoolSpec

EWMA_ALPHA = 0.3
"""Weight of the newest time-to-first-byte sample in `EndpointState.ewma_ttft_s`:
ewma <- alpha * sample + (1 - alpha) * ewma. At 0.3 a sample's weight halves after about
two further samples, so a slowdown shows within a handful of requests while one outlier
moves the average by under a third of its excess."""

FAILURE_PENALTY_S = 10.0
"""A failed attempt (connect error, timeout, 5xx, interrupted response) is folded into
`ewma_ttft_s` as a sample of this many seconds, far above interactive TTFTs, so that
`latency-aware` ranks a failing endpoint last among equally loaded ones instead of
treating a fast error as a fast endpoint (or, having no sample, as unknown and first).
It is not observed in the TTFT histogram."""

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
    interrupted), `ewma_ttft_s` (EWMA of time to first byte, seconds; None before the first
    sample), `last_sample_s` (router-clock seconds of the latest sample; None before it),
    `unavailable_until_s` (router-clock seconds until which a connection failure keeps the
    endpoint out of the candidates). `metrics` holds the pre-bound Prometheus children (None outside a `PoolTable`).
    """

    __slots__ = (
        "id", "url", "version", "weight", "draining",
        "in_flight", "requests_total", "errors_total", "ewma_ttft_s", "last_sample_s", "unavailable_until_s",
        "metrics",
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
        self.ewma_ttft_s: float | None = None
        self.last_sample_s: float | None = None
        self.unavailable_until_s = 0.0
        self.metrics = metrics

    def record_ttft(self, ttft_s: float, now_s: float) -> None:
        """Fold one time-to-first-byte sample (seconds) into the EWMA (see `EWMA_ALPHA`)."""
        ewma_s = self.ewma_ttft_s
        self.ewma_ttft_s = ttft_s if ewma_s is None else EWMA_ALPHA * ttft_s + (1.0 - EWMA_ALPHA) * ewma_s
        self.last_sample_s = now_s

    def record_failure(self, now_s: float, cooldown_s: float = 0.0) -> None:
        """Count a failed attempt: fold `FAILURE_PENALTY_S` into the EWMA and, for a
        connection failure, keep the endpoint out of the candidates for `cooldown_s`."""
        self.errors_total += 1
        self.record_ttft(FAILURE_PENALTY_S, now_s)
        if cooldown_s > 0.0:
            self.unavailable_until_s = now_s + cooldown_s

    def snapshot(self) -> dict[str, object]:
        """The fields `GET /admin/v1/pools` lists for this endpoint."""
        return {
            "id": self.id,
            "url": self.url,
            "version": self.version,
            "weight": self.weight,
            "draining": self.draining,
            "in_flight": self.in_flight,
            "requests_total": self.requests_total,
            "errors_total": self.errors_total,
            "ewma_ttft_s": self.ewma_ttft_s,
        }

    def __repr__(self) -> str:
        return (
            f"EndpointState(id={self.id!r}, url={self.url!r}, draining={self.draining}, "
            f"in_flight={self.in_flight}, ewma_ttft_s={self.ewma_ttft_s})"
        )


class Pool:
    """The endpoints serving one model and the policy instance that chooses among them.

    `endpoints` holds all endpoints (draining ones too), `ready` the non-draining ones, in
    spec order. A pool is replaced, never edited, when its spec changes.
    """

    __slots__ = ("model", "policy", "endpoints", "ready", "created_s")

    def __init__(self, model: str, policy: RoutingPolicy, endpoints: Sequence[EndpointState], created_s: float) -> None:
        self.model = model
        self.policy = policy
        self.endpoints = tuple(endpoints)
        self.ready = tuple(e for e in self.endpoints if not e.draining)
        self.created_s = created_s

    def pick(self, now_s: float, tried: Collection[EndpointState] = ()) -> EndpointState | None:
        """The endpoint the policy chooses among the ready ones not in `tried`; None if
        none is left. Endpoints cooling down after a connection failure are left out
        unless all remaining ones are (see `DEFAULT_FAILURE_COOLDOWN_S`)."""
        candidates: Sequence[EndpointState] = self.ready
        if tried:
            candidates = [e for e in candidates if e not in tried]
        if not candidates:
            return None
        for endpoint in candidates:
            if endpoint.unavailable_until_s > now_s:
                available = [e for e in candidates if e.unavailable_until_s <= now_s]
                return self.policy.choose(available or candidates, now_s)
        return self.policy.choose(candidates, now_s)

    def snapshot(self) -> dict[str, object]:
        """The pool as `GET /admin/v1/pools` lists it."""
        return {"policy": self.policy.name, "endpoints": [e.snapshot() for e in self.endpoints]}


class PoolTable:
    """All pools of the router, by model name.

    `put` and `delete` swap whole `Pool` objects, so a request that already holds a pool
    (or an endpoint) finishes against it undisturbed. `wall_clock` (seconds since the
    epoch, default `time.time`) only stamps `Pool.created_s` for `GET /v1/models`.
    """

    def __init__(self, metrics: RouterMetrics, wall_clock: Callable[[], float]) -> None:
        self._metrics = metrics
        self._wall_clock = wall_clock
        self._pools: dict[str, Pool] = {}
        metrics.watch_pools(lambda: {model: pool.endpoints for model, pool in self._pools.items()})

    def get(self, model: str) -> Pool | None:
        """The pool serving `model`, or None."""
        return self._pools.get(model)

    def models(self) -> list[str]:
        """Names of the models that have a pool, sorted."""
        return sorted(self._pools)

    def pools(self) -> dict[str, Pool]:
        """A copy of the model-to-pool mapping."""
        return dict(self._pools)

    def put(self, model: str, spec: PoolSpec) -> Pool:
        """Create or replace `model`'s pool from `spec`.

        An endpoint whose id and url are unchanged keeps its `EndpointState` (stats,
        in-flight count) and takes the new version, weight and draining flag; others start
        fresh. The policy instance is kept when the policy name is unchanged. Removed
        endpoints lose their metric series; their in-flight requests finish normally.
        Raises `KeyError` for an unknown policy name (`PoolSpec` validation prevents it).
        """
        old = self._pools.get(model)
        old_by_id = {e.id: e for e in old.endpoints} if old is not None else {}
        policy = old.policy if old is not None and old.policy.name == spec.policy else make_policy(spec.policy)

        kept: dict[str, EndpointState] = {}
        for endpoint_spec in spec.endpoints:
            previous = old_by_id.get(endpoint_spec.id)
            if previous is not None and previous.url == endpoint_spec.url:
                kept[endpoint_spec.id] = previous
        for endpoint_id, previous in old_by_id.items():
            if kept.get(endpoint_id) is not previous:
                self._metrics.forget(model, endpoint_id)

        endpoints: list[EndpointState] = []
        for endpoint_spec in spec.endpoints:
            state = kept.get(endpoint_spec.id)
            if state is None:
                state = EndpointState(
                    endpoint_spec.id, endpoint_spec.url, metrics=self._metrics.bind(model, endpoint_spec.id)
                )
            state.version = endpoint_spec.version
            state.weight = endpoint_spec.weight
            state.draining = endpoint_spec.draining
            endpoints.append(state)

        created_s = old.created_s if old is not None else self._wall_clock()
        pool = Pool(model, policy, endpoints, created_s)
        self._pools[model] = pool
        return pool

    def delete(self, model: str) -> bool:
        """Remove `model`'s pool and its metric series; False if there was none."""
        pool = self._pools.pop(model, None)
        if pool is None:
            return False
        for endpoint in pool.endpoints:
            self._metrics.forget(model, endpoint.id)
        self._metrics.forget_pool(model)
        return True
