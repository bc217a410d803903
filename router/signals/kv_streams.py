"""The router's KV event streams: a subscriber per publishing endpoint, an exact index per model.

Owns `KvEventStreams`: a `router.signals.kv_subscriber.KvEventSubscriber` per endpoint of every
pool whose `router.pools.spec.EndpointSpec.kv_events` names a publisher, all draining on one
shared `router.signals.drain_ticks.DrainTicks`, and each model's `router.kv.exact_index.ExactIndex`.
`router.pools.pool.PoolTable` tells it of every pool put or deleted; `router.http.app` starts it
with the app's lifespan and closes it at shutdown; `router.stats.metrics.RouterMetrics` reads its
rows at scrape time. Everything runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

import zmq.asyncio

from router.kv.exact_index import ExactIndex
from router.pools.spec import KvEventsSource
from router.signals.drain_ticks import DRAIN_INTERVAL_S, DrainTicks
from router.signals.kv_subscriber import DEFAULT_REBUILD_S, DEFAULT_REPLAY_TIMEOUT_S, KvEventSubscriber
from router.stats.endpoint_metrics import KvEndpointMetrics
from router.stats.metrics import RouterMetrics


class KvEventStreams:
    """A `KvEventSubscriber` per endpoint with a `kv_events` source, and an `ExactIndex` per model.

    `put(model, sources)` / `delete(model)` say which endpoints of a model publish where
    (called by `router.pools.pool.PoolTable`); subscribers start and stop to match, on the running
    event loop (before `start`, only the wish is recorded). An endpoint whose source changed
    gets a new subscriber and an empty view. `close` stops them all.
    """

    def __init__(self, metrics: RouterMetrics | None = None, *, clock: Callable[[], float] = time.monotonic,
                 rebuild_s: float = DEFAULT_REBUILD_S, replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
                 drain_interval_s: float = DRAIN_INTERVAL_S) -> None:  # fmt: skip
        self._metrics = metrics
        self._ticks = DrainTicks(drain_interval_s)
        self._clock = clock
        self._rebuild_s = rebuild_s
        self._replay_timeout_s = replay_timeout_s
        self._ctx: zmq.asyncio.Context | None = None
        self._wanted: dict[str, dict[str, KvEventsSource]] = {}
        self._running: dict[tuple[str, str], tuple[KvEventSubscriber, asyncio.Task[None], KvEndpointMetrics | None]] = {}
        self._indexes: dict[str, ExactIndex] = {}
        self._started = False
        if metrics is not None:
            metrics.watch_kv_streams(self)

    @property
    def drain_interval_s(self) -> float:
        """Seconds between two drains of the subscribers' sockets (their shared `DrainTicks`)."""
        return self._ticks.interval_s

    def index(self, model: str) -> ExactIndex:
        """`model`'s exact index (made on first use; kept while the model has a pool)."""
        index = self._indexes.get(model)
        if index is None:
            index = self._indexes[model] = ExactIndex()
        return index

    def put(self, model: str, sources: Mapping[str, KvEventsSource]) -> None:
        """`model`'s endpoints that publish KV events are now `sources` (endpoint id -> source)."""
        self._wanted[model] = dict(sources)
        index = self._indexes.get(model)
        if index is not None:
            index.retain(sources)
        self._reconcile()

    def delete(self, model: str) -> None:
        """`model` has no pool any more: stop its subscribers and drop its index."""
        self._wanted.pop(model, None)
        self._indexes.pop(model, None)
        self._reconcile()

    def subscriber(self, model: str, endpoint_id: str) -> KvEventSubscriber | None:
        """The running subscriber of one endpoint (None if none)."""
        entry = self._running.get((model, endpoint_id))
        return entry[0] if entry is not None else None

    async def start(self) -> None:
        """Start the subscribers wished so far (the app's lifespan startup)."""
        self._started = True
        self._reconcile()

    async def close(self) -> None:
        """Stop every subscriber and close the ZMQ context (the app's lifespan shutdown)."""
        self._started = False
        tasks = [self._stop(key) for key in list(self._running)]
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def kv_rows(self) -> list[tuple[str, str, bool, int]]:
        """(model, endpoint, live, blocks held) of every wished stream (the scrape-time gauges)."""
        rows = []
        for model, sources in sorted(self._wanted.items()):
            index = self._indexes.get(model)
            for endpoint_id in sorted(sources):
                if index is None:
                    rows.append((model, endpoint_id, False, 0))
                else:
                    rows.append((model, endpoint_id, index.live(endpoint_id), index.blocks(endpoint_id)))
        return rows

    def _reconcile(self) -> None:
        """Start and stop subscribers to match the wish; needs the running loop (else waits for `start`)."""
        if not self._started:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        for key, (subscriber, _, _) in list(self._running.items()):
            model, endpoint_id = key
            if self._wanted.get(model, {}).get(endpoint_id) != subscriber.source:
                self._stop(key)
                index = self._indexes.get(model)
                if index is not None:
                    index.forget(endpoint_id)
        if self._ctx is None and any(self._wanted.values()):
            self._ctx = zmq.asyncio.Context()
        for model, sources in self._wanted.items():
            for endpoint_id, source in sources.items():
                key = (model, endpoint_id)
                if key in self._running:
                    continue
                assert self._ctx is not None
                metrics = self._metrics.bind_kv(model, endpoint_id) if self._metrics is not None else None
                subscriber = KvEventSubscriber(model, endpoint_id, source, self.index(model), self._ctx, metrics,
                                               clock=self._clock, rebuild_s=self._rebuild_s,
                                               replay_timeout_s=self._replay_timeout_s, ticks=self._ticks)  # fmt: skip
                task = loop.create_task(subscriber.run(), name=f"kv-events:{model}/{endpoint_id}")
                self._running[key] = (subscriber, task, metrics)

    def _stop(self, key: tuple[str, str]) -> asyncio.Task[None]:
        _, task, metrics = self._running.pop(key)
        task.cancel()
        if metrics is not None:
            metrics.forget()
        return task
