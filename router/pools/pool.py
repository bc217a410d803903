"""Live routing state: the endpoints of each model's pool and their measured stats.

Owns `Pool` (one model's endpoints, its policy instance and admission limit), `PoolShared` (what a
model's successive pools share: windowed statistics, admission queue, queue-time metric) and
`PoolTable` (all pools by model name). `router.http.admin` replaces pools through
`PoolTable.put/delete` and reads `PoolTable.stats`; `router.request.proxy` reads `PoolTable.get` and
picks with `Pool.pick`; `router.request.prepare` asks the pool what its policy needs of a request
(`Pool.hashes_prompts`, `Pool.wants_token_ids`); `router.request.attempt` records into the chosen
`EndpointState` and the pool's `PoolShared`. Nothing here does I/O; times are passed in, except that
`PoolTable` stamps new pools with its injected clocks.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import Histogram

from router.pools.admission import AdmissionQueue
from router.pools.endpoint import EndpointState
from router.stats.metrics import RouterMetrics
from router.pools.outlier import Outcome, OutlierDetector
from router.pools.upstream import DEFAULT_MIGRATION_LIMIT, StreamLimits
from router.pools.policies import RoutingPolicy, make_policy
from router.kv.prompt_blocks import RouteRequest
from router.pools.spec import DEFAULT_MAX_QUEUE_LENGTH, DEFAULT_MAX_RETRIES, DEFAULT_QUEUE_TIMEOUT_S, PoolSpec
from router.stats.request_log import RequestLog, revision_summaries
from router.pools.split import RevisionSplit, SplitState
from router.stats.windows import DEFAULT_WINDOW_S, ModelStats

if TYPE_CHECKING:
    from router.kv.exact_index import ExactIndex
    from router.pools.spec import KvEventsSource

AWAIT_AFTER_HEARD_S = 30.0
"""Seconds after the control plane first spoke to a (re)started router during which a model it
served before still gets 503 rather than 404 (`PoolTable.awaiting`): the controller publishes
every pool within a tick or two of seeing a restarted router, so a model still unpublished by
then is one it no longer serves."""


class KvStreams(Protocol):
    """Where the pools' KV event streams are followed (`router.signals.kv_streams.KvEventStreams`)."""

    def index(self, model: str) -> ExactIndex:
        """`model`'s exact block index."""
        ...

    def put(self, model: str, sources: Mapping[str, KvEventsSource]) -> None:
        """`model`'s endpoints that publish KV events, and where."""
        ...

    def delete(self, model: str) -> None:
        """`model`'s pool is gone."""
        ...


class PickerTicket(Protocol):
    """An answered pick the picker holds until the request leaves (`router.picker.client.PickerTicket`)."""

    def first_byte(self) -> None:
        """The request's first byte reached the client."""
        ...

    def finish(self) -> None:
        """The request left the endpoint (done, failed or cancelled)."""
        ...


class RemotePicker(Protocol):
    """The endpoint picker the pools of this router ask (`router.picker.client.PickerClient`)."""

    def put_pool(self, model: str, policy: str, sources: dict[str, dict | None]) -> None:
        """`model`'s pool: its policy and its endpoints (id -> KV events source document, or None)."""
        ...

    async def pick(self, model: str, candidates: Sequence[str], request: RouteRequest,
                   fallback: Callable[[], int]) -> tuple[int, PickerTicket | None, bool]:  # fmt: skip
        """(The index of the candidate chosen, its ticket or None, whether the picker chose);
        `fallback()` is the router's own choice when the picker does not answer in time."""
        ...


class PoolShared:
    """What the successive pools of one model share, so a pool replacement loses nothing:
    `stats` (`router.stats.windows.ModelStats`), `queue` (`router.pools.admission.AdmissionQueue`),
    `queue_time` (the model's pre-bound `fleet_router_queue_time_seconds` child; None outside
    a `PoolTable`), `split` (the revision split's counters, `router.pools.split.SplitState`) and
    `requests` (finished requests by revision and endpoint, `router.stats.request_log.RequestLog`)."""

    __slots__ = ("stats", "queue", "queue_time", "split", "requests")

    def __init__(self, stats: ModelStats, queue_time: Histogram | None = None) -> None:
        self.stats = stats
        self.queue = AdmissionQueue()
        self.queue_time = queue_time
        self.split = SplitState()
        self.requests = RequestLog()

    # ----- recording one request: the request path (router.request.attempt) and the trace simulators
    # (fleet.tracesim.engine, fleet.tracesim.rollout) call these at the same points, so the
    # statistics the autoscaler and the canary analysis read are recorded by one piece of code.
    # Times are clock seconds (the router's injected clock, or virtual seconds).

    def arrived(self, now_s: float) -> None:
        """A request for the model arrived (the arrival rate)."""
        self.stats.arrivals.add(now_s)

    def dispatched(self, arrival_s: float, now_s: float) -> None:
        """The request that arrived at ``arrival_s`` leaves the admission queue for an endpoint
        now: its queue time ``now_s - arrival_s`` (0 when it never waited) is a sample."""
        waited_s = now_s - arrival_s
        self.stats.queue_time.add(now_s, waited_s)
        if self.queue_time is not None:
            self.queue_time.observe(waited_s)

    def gave_up(self, arrival_s: float, now_s: float) -> None:
        """The request stopped waiting for a slot (timed out, its pool gone): the wait so far is a
        queue-time sample (a lower bound of the real one), or overload would hide its longest
        waits from the signal. The rejection is `rejected`'s."""
        self.dispatched(arrival_s, now_s)

    def rejected(self, now_s: float) -> None:
        """The router answered the request itself with an error (503, 502, ...)."""
        self.stats.rejected.add(now_s)

    def completed(self, endpoint: EndpointState, *, arrival_s: float, dispatch_s: float, first_byte_s: float,
                  end_s: float, succeeded: bool, tpot_s: float | None = None) -> None:  # fmt: skip
        """The endpoint answered the request (dispatched at ``dispatch_s``) in full at ``end_s``:
        its end-to-end latency from arrival is a sample. A success (``succeeded``: status < 400;
        errors are not latency samples) also gives the endpoint's time-to-first-byte sample
        (`EndpointState.record_first_byte`, from dispatch), the model's TTFT sample (first byte,
        from arrival) and, for a streamed reply, its TPOT (``tpot_s``). The per-revision row is
        `finished`'s."""
        stats = self.stats
        stats.e2e.add(end_s, end_s - arrival_s)
        if succeeded:
            endpoint.record_first_byte(first_byte_s - dispatch_s, end_s)
            stats.ttft.add(end_s, first_byte_s - arrival_s)
            if tpot_s is not None:
                stats.tpot.add(end_s, tpot_s)

    def finished(self, endpoint: EndpointState, *, arrival_s: float, dispatch_s: float, end_s: float,
                 first_token_s: float | None, tpot_s: float | None, e2e_s: float | None, failed: bool) -> None:  # fmt: skip
        """The per-revision row of a request that left the endpoint (answered or not): what canary
        analysis compares (`router.stats.request_log.RequestLog`). TTFT from arrival to the first
        token (None when there was none), queue time from arrival to dispatch."""
        self.requests.record(end_s, endpoint.version, endpoint.id,
                             ttft_s=first_token_s - arrival_s if first_token_s is not None else None, tpot_s=tpot_s,
                             e2e_s=e2e_s, queue_time_s=dispatch_s - arrival_s, failed=failed)  # fmt: skip


class Pool:
    """The endpoints serving one model and the policy instance that chooses among them.

    `endpoints` holds all endpoints (draining ones too), `ready` the non-draining ones, in spec
    order. `split` divides requests between the revisions (versions) of the ready endpoints by
    weight before the policy chooses (`router.pools.split`; None with one version); `sticky_key`
    names the request key that keeps a user on one revision (None: none); `tokenizer` the directory
    of the model's tokenizer (`router.kv.tokenize`; None: none). `limit` is the most requests one
    endpoint gets at once (None: no limit, no admission queue); `max_queue_length` and
    `queue_timeout_s` bound the admission queue. `first_token_timeout_s` (None: the default,
    `router.request.deadline`) and `max_retries` bound the wait for a first token and the retries
    after a stall or a 5xx (`router.request.proxy`, `router.request.attempt`); `stream_limits` bound
    an upstream answer's length and rate and `migration_limit` the times a broken stream moves to
    another endpoint (`router.pools.upstream`); `outlier` ejects
    endpoints that stall or fail in a row (`router.pools.outlier`; `record_outcome`). `kv_view` is
    the model's exact view of the engines' KV caches (`router.kv.exact_index.ExactIndex`, fed by
    `router.signals.kv_subscriber`; None when no endpoint publishes KV events): the pool hands it to
    its policy at every pick. What the policy needs of a request is the pool's to say:
    `hashes_prompts` (it reads block hashes) and `wants_token_ids()`. A pool is replaced, never
    edited, when its spec changes.
    """

    __slots__ = ("model", "policy", "endpoints", "ready", "created_s", "shared", "limit",
                 "max_queue_length", "queue_timeout_s", "split", "sticky_key", "tokenizer", "first_token_timeout_s",
                 "max_retries", "stream_limits", "migration_limit", "outlier", "kv_view", "hashes_prompts",
                 "picker")  # fmt: skip

    def __init__(
        self,
        model: str,
        policy: RoutingPolicy,
        endpoints: Sequence[EndpointState],
        created_s: float,
        shared: PoolShared | None = None,
        *,
        limit: int | None = None,
        max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
        sticky_key: str | None = None,
        tokenizer: str | None = None,
        first_token_timeout_s: float | None = None,
        max_retries: int = DEFAULT_MAX_RETRIES,
        stream_limits: StreamLimits = StreamLimits(),
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
        outlier: OutlierDetector | None = None,
        kv_view: ExactIndex | None = None,
        picker: RemotePicker | None = None,
    ) -> None:
        self.model = model
        self.policy = policy
        self.endpoints = tuple(endpoints)
        self.ready = tuple(e for e in self.endpoints if not e.draining)
        self.created_s = created_s
        self.shared = shared if shared is not None else PoolShared(ModelStats(0.0))
        self.limit = limit
        self.max_queue_length = max_queue_length
        self.queue_timeout_s = queue_timeout_s
        self.split = RevisionSplit.of(self.ready, self.shared.split)
        self.sticky_key = sticky_key
        self.tokenizer = tokenizer
        self.first_token_timeout_s = first_token_timeout_s
        self.max_retries = max_retries
        self.stream_limits = stream_limits
        self.migration_limit = migration_limit
        self.outlier = outlier if outlier is not None else OutlierDetector()
        self.kv_view = kv_view
        self.hashes_prompts = policy.uses_prompt_blocks
        self.picker = picker
        policy.on_endpoints({e.id for e in self.endpoints})

    def wants_token_ids(self) -> bool:
        """Whether a text or chat prompt is worth tokenizing with the pool's `tokenizer` now: its
        policy reads token ids (`RoutingPolicy.uses_token_ids`) and the pool asks the endpoint picker
        (`picker`), or some endpoint's event stream is live (or rebuilding) in `kv_view`.
        Otherwise the approximate view decides, and
        `router.request.prepare` does not tokenize (`router.kv.tokenize`)."""
        if not self.policy.uses_token_ids:
            return False
        view = self.kv_view
        return self.picker is not None or (view is not None and view.any_live(rebuilding=True))

    def pick(self, request: RouteRequest, now_s: float, tried: Collection[EndpointState] = (), *,
             within_limit: bool = True, key: str | None = None) -> EndpointState | None:  # fmt: skip
        """The endpoint the policy chooses for `request` among the ready ones not in `tried`;
        None if none is left. With a `limit` (and `within_limit`), endpoints with `limit` requests
        in flight are full and left out. With more than one revision, the split first narrows the
        candidates to one revision (`router.pools.split`; ``key``: the request's sticky key), for every
        policy alike. Endpoints cooling down after a connection failure (see
        `DEFAULT_FAILURE_COOLDOWN_S`) and endpoints ejected by outlier detection (`router.pools.outlier`;
        an ejection that is over ends here) are left out unless no other one remains: then the
        cooling ones are candidates, and if none, the ejected ones (trying beats refusing). An
        endpoint in its slow start after an ejection is a candidate for the share of picks its
        slow-start weight gives (`router.pools.outlier.OutlierDetector.admit`), unless it is the
        only one left."""
        candidates = self.candidates(now_s, tried, within_limit=within_limit, key=key)
        if candidates is None:
            return None
        return self.policy.choose(candidates, request, now_s, self.kv_view)

    def candidates(self, now_s: float, tried: Collection[EndpointState] = (), *, within_limit: bool = True,
                   key: str | None = None) -> Sequence[EndpointState] | None:  # fmt: skip
        """The endpoints `pick` lets its policy choose among (its docstring says which), or None if
        none is left: what the router also hands the endpoint picker."""
        candidates: Sequence[EndpointState] = self.ready
        limit = self.limit
        if limit is not None and within_limit:
            candidates = [e for e in candidates if e.in_flight < limit]
        if tried:
            candidates = [e for e in candidates if e not in tried]
        if not candidates:
            return None
        if self.split is not None:
            candidates = self.split.narrow(candidates, key)
            if not candidates:
                return None   # only revisions of weight 0 left (router.pools.split)
        for endpoint in candidates:
            if endpoint.unavailable_until_s > now_s or endpoint.ejected_until_s or endpoint.slow_start_since_s:
                return self._available(candidates, now_s)
        return candidates

    def _available(self, candidates: Sequence[EndpointState], now_s: float) -> Sequence[EndpointState]:
        """`candidates` without ejected and cooling-down endpoints and the picks slow start keeps
        from ramping ones, with the fall-backs `pick` names."""
        release, admit = self.outlier.release, self.outlier.admit
        in_service = [e for e in candidates if not e.ejected_until_s or release(e, now_s)]
        ramped = [e for e in in_service if not e.slow_start_since_s or admit(e, now_s)]
        in_service = ramped or in_service
        available = [e for e in in_service if e.unavailable_until_s <= now_s]
        return available or in_service or candidates

    def record_outcome(self, endpoint: EndpointState, outcome: Outcome, now_s: float) -> bool:
        """Count an attempt's outcome against `endpoint` for outlier detection; True when this
        ejects it (`router.pools.outlier.OutlierDetector.record`, over this pool's ready endpoints)."""
        return self.outlier.record(endpoint, outcome, now_s, self.ready)

    def free_slots(self) -> float:
        """Requests the ready endpoints can take now without queueing (inf without a limit)."""
        if self.limit is None:
            return math.inf
        return sum(max(0, self.limit - e.in_flight) for e in self.ready)

    def in_flight(self) -> int:
        """Requests dispatched to this pool's endpoints (draining ones too) and not finished."""
        return sum(e.in_flight for e in self.endpoints)

    def snapshot_head(self) -> dict[str, object]:
        """The pool's settings and queue, without its endpoints."""
        return {"policy": self.policy.name, "max_concurrency_per_endpoint": self.limit,
                "queued": len(self.shared.queue), "split": self.split.shares() if self.split is not None else None,
                "sticky_key": self.sticky_key, "first_token_timeout_s": self.first_token_timeout_s,
                "max_retries": self.max_retries, "migration_limit": self.migration_limit}  # fmt: skip

    def snapshot(self, now_s: float | None = None) -> dict[str, object]:
        """The pool as `GET /admin/v1/pools` lists it (with `now_s`, each endpoint's outlier state)."""
        return {**self.snapshot_head(), "endpoints": [e.snapshot(now_s) for e in self.endpoints]}


class PoolTable:
    """All pools of the router, by model name.

    `put` and `delete` swap whole `Pool` objects, so a request that already holds a pool
    (or an endpoint) finishes against it undisturbed; the model's `PoolShared` (statistics,
    admission queue) carries over. `wall_clock` (seconds since the epoch) only stamps
    `Pool.created_s` for `GET /v1/models`; `clock` (the router's monotonic clock, seconds)
    marks when a model's statistics begin. `kv_streams` (None: none) is told which endpoints of
    each pool publish KV cache events (`EndpointSpec.kv_events`), and a pool with any gets its
    model's exact index as its `Pool.kv_view`. With a `picker` (the endpoint picker,
    `router.picker.client.PickerClient`) every pool is told to it instead, its endpoints' KV event
    sources with it, and the pools ask it for their picks (`Pool.picker`): the router follows no
    KV event stream of its own then.
    """

    def __init__(self, metrics: RouterMetrics, wall_clock: Callable[[], float],
                 clock: Callable[[], float] = time.perf_counter, remembered: Iterable[str] = (),
                 kv_streams: KvStreams | None = None, picker: RemotePicker | None = None) -> None:  # fmt: skip
        self._metrics = metrics
        self._kv_streams = kv_streams
        self._picker = picker
        self._wall_clock = wall_clock
        self._clock = clock
        self._pools: dict[str, Pool] = {}
        self.synced = False   # the control plane published every pool at least once (GET /ready)
        self._awaiting = set(remembered)   # served before a restart, not yet spoken for (`awaiting`)
        self._heard_s: float | None = None  # when the control plane first spoke (a PUT, DELETE or sync)
        metrics.watch_pools(self)

    def awaiting(self, model: str) -> bool:
        """Whether `model` had a pool before this router (re)started (`remembered`, read from
        `router.http.remembered.ModelsFile`) and the control plane has not yet spoken for it: the
        proxy answers 503 + Retry-After for it, not 404. True until the first of: a PUT or DELETE
        of its pool, `mark_synced` (every pool published), or `AWAIT_AFTER_HEARD_S` seconds after
        the control plane first spoke (a model it no longer publishes is then unknown)."""
        if model not in self._awaiting:
            return False
        if self._heard_s is not None and self._clock() - self._heard_s >= AWAIT_AFTER_HEARD_S:
            self._awaiting.clear()
            return False
        return True

    def awaited(self) -> list[str]:
        """The models `awaiting` answers True for now, sorted."""
        return sorted(m for m in list(self._awaiting) if self.awaiting(m))

    def mark_synced(self) -> None:
        """The control plane has published every pool (`POST /admin/v1/synced`): `GET /ready`
        turns 200 and no model is awaited any more."""
        self.synced = True
        self._awaiting.clear()
        self._heard()

    def _heard(self, model: str | None = None) -> None:
        if model is not None:
            self._awaiting.discard(model)
        if self._heard_s is None:
            self._heard_s = self._clock()

    def get(self, model: str) -> Pool | None:
        """The pool serving `model`, or None."""
        return self._pools.get(model)

    def models(self) -> list[str]:
        """Names of the models that have a pool, sorted."""
        return sorted(self._pools)

    def pools(self) -> dict[str, Pool]:
        """A copy of the model-to-pool mapping."""
        return dict(self._pools)

    def load_endpoints(self) -> dict[str, tuple[EndpointState, ...]]:
        """By model name, the endpoints (draining ones too) of the pools whose policy reads the
        engines' load (`RoutingPolicy.uses_engine_load`): what `router.signals.engine_poll` polls."""
        return {model: pool.endpoints for model, pool in self._pools.items() if pool.policy.uses_engine_load}

    def now_s(self) -> float:
        """The table's clock (seconds): the router's clock, on which ejections are timed."""
        return self._clock()

    def live_endpoints(self) -> dict[str, tuple[EndpointState, ...]]:
        """Every pool's endpoints (draining ones too), by model name."""
        return {model: pool.endpoints for model, pool in self._pools.items()}

    def put(self, model: str, spec: PoolSpec) -> Pool:
        """Create or replace `model`'s pool from `spec`.

        An endpoint whose id and url are unchanged keeps its `EndpointState` (stats,
        in-flight count) and takes the new version, weight and draining flag; others start
        fresh. The policy instance is kept when the policy name is unchanged. Removed
        endpoints lose their metric series (and a kept endpoint whose version changed its
        series of the old version); their in-flight requests finish normally. Linear in the
        endpoints of the old and new pools: series are created at an endpoint's first request
        and removed by their exact label sets (`router.stats.endpoint_metrics.EndpointMetrics`).
        Raises `KeyError` for an unknown policy name (`PoolSpec` validation prevents it).
        """
        self._heard(model)
        old = self._pools.get(model)
        old_by_id = {e.id: e for e in old.endpoints} if old is not None else {}
        policy = old.policy if old is not None and old.policy.name == spec.policy else make_policy(spec.policy)

        kept: dict[str, EndpointState] = {}
        for endpoint_spec in spec.endpoints:
            previous = old_by_id.get(endpoint_spec.id)
            if previous is not None and previous.url == endpoint_spec.url:
                kept[endpoint_spec.id] = previous
        for endpoint_id, previous in old_by_id.items():
            if kept.get(endpoint_id) is not previous and previous.metrics is not None:
                previous.metrics.forget()

        metrics = self._metrics
        endpoints: list[EndpointState] = []
        for endpoint_spec in spec.endpoints:
            state = kept.get(endpoint_spec.id)
            version = endpoint_spec.version
            if state is None:
                state = EndpointState(endpoint_spec.id, endpoint_spec.url,
                                      metrics=metrics.bind(model, endpoint_spec.id, version))  # fmt: skip
            elif state.version != version:
                # The version is a label of the endpoint's series: the old ones go, new ones start.
                if state.metrics is not None:
                    state.metrics.forget()
                state.metrics = metrics.bind(model, endpoint_spec.id, version)
            state.version = version
            state.weight = endpoint_spec.weight
            state.draining = endpoint_spec.draining
            endpoints.append(state)

        created_s = old.created_s if old is not None else self._wall_clock()
        if old is not None:
            shared = old.shared
        else:
            shared = PoolShared(ModelStats(self._clock()), self._metrics.bind_model(model))
        settings = spec.outlier_detection.settings()
        outlier = old.outlier if old is not None and old.outlier.settings == settings else OutlierDetector(settings)
        kv_view = None
        picker = self._picker
        if picker is not None:
            picker.put_pool(model, spec.policy, {e.id: e.kv_events.model_dump() if e.kv_events is not None else None
                                                 for e in spec.endpoints})  # fmt: skip
        elif self._kv_streams is not None:
            sources = {e.id: e.kv_events for e in spec.endpoints if e.kv_events is not None}
            self._kv_streams.put(model, sources)
            kv_view = self._kv_streams.index(model) if sources else None
        pool = Pool(model, policy, endpoints, created_s, shared, limit=spec.max_concurrency_per_endpoint,
                    max_queue_length=spec.max_queue_length, queue_timeout_s=spec.queue_timeout_s,
                    sticky_key=spec.sticky_key, tokenizer=spec.tokenizer, first_token_timeout_s=spec.first_token_timeout_s,
                    max_retries=spec.max_retries, stream_limits=spec.stream_limits.limits(),
                    migration_limit=spec.migration_limit, outlier=outlier, kv_view=kv_view, picker=picker)  # fmt: skip
        self._pools[model] = pool
        # Waiting requests take the slots the new pool has (all of them if the limit is gone).
        free = pool.free_slots()
        if free == math.inf:
            shared.queue.wake_all()
        elif free > 0:
            shared.queue.wake(int(free))
        return pool

    def delete(self, model: str) -> bool:
        """Remove `model`'s pool and its metric series; False if there was none."""
        self._heard(model)
        pool = self._pools.pop(model, None)
        if pool is None:
            return False
        for endpoint in pool.endpoints:
            if endpoint.metrics is not None:
                endpoint.metrics.forget()
        self._metrics.forget_pool(model)
        if self._picker is not None:
            self._picker.put_pool(model, pool.policy.name, {})
        elif self._kv_streams is not None:
            self._kv_streams.delete(model)
        pool.shared.queue.wake_all()  # waiting requests find no pool and are answered
        return True

    def stats(self, window_s: float = DEFAULT_WINDOW_S,
              models: Collection[str] | None = None) -> dict[str, dict[str, object]]:  # fmt: skip
        """Windowed statistics of every pool (or of ``models``), by model name, at the table's
        clock: `router.stats.windows.ModelStats.snapshot` plus the live in-flight and queued counts."""
        now_s = self._clock()
        out = {}
        for model, pool in sorted(self._pools.items()):
            if models is not None and model not in models:
                continue
            out[model] = pool.shared.stats.snapshot(
                now_s, window_s, in_flight=pool.in_flight(), queued=len(pool.shared.queue)
            )
            out[model]["revisions"] = revision_summaries(pool.shared.requests, now_s, window_s)  # router.stats.request_log
        return out

    def revision_samples(self, model: str, window_s: float) -> dict[str, object] | None:
        """The finished requests of ``model`` in the last ``window_s`` seconds by revision and
        endpoint (`router.stats.request_log.RequestLog.rows`), or None when it has no pool."""
        pool = self._pools.get(model)
        if pool is None:
            return None
        return {"window_s": window_s, "rows": pool.shared.requests.rows(self._clock(), window_s)}
