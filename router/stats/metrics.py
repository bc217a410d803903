"""Prometheus metrics of the router, on a registry of its own.

Owns `RouterMetrics`, the router's metrics of one app: the counter and histogram families
(`router.stats.metric_families.RouterFamilies`), the bundles of label children it binds per
endpoint and per KV event stream (`router.stats.endpoint_metrics`), the gauges read at scrape
time (`router.stats.scrape_gauges`) and the rendering of `GET /metrics`. Created once per app
by `router.http.app.create_app`; `router.pools.pool.PoolTable` creates and forgets endpoint
bundles as pools change; `router.request.attempt` binds and records into them (and
`router.request.relay` counts the tokens it relays); `router.request.refuse` counts the router's
own error answers (`RouterMetrics.reject`).

The registry is a dedicated `CollectorRegistry`, never the process-global one, so several apps
(tests, embedding) can live in one process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import choose_encoder

from router.stats.endpoint_metrics import EndpointMetrics, KvEndpointMetrics
from router.stats.metric_families import RouterFamilies
from router.stats.scrape_gauges import KvGauges, KvStreamsView, LiveGauges, LiveTable

UNKNOWN_MODEL = "(unknown)"
"""`model` label of a rejected request that named a model the router has no pool for. Clients
choose model names freely, so echoing them into a label would let anyone create unbounded
series (and memory) with random names; a model is a label value only while it has a pool."""


class RouterMetrics(RouterFamilies):
    """The router's metric families (`RouterFamilies`) on a dedicated `CollectorRegistry`, with
    the scrape-time gauges registered beside them.

    One instance per app. `bind(model, endpoint_id, version)` returns the label children of an
    endpoint (`EndpointMetrics`, whose `forget()` drops its series when it leaves the pool, so
    endpoint churn does not grow the exposition); `reject` counts the router's own error
    answers; `watch_pools` connects the scrape-time gauges to the live pools.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry if registry is not None else CollectorRegistry())
        self._live = LiveGauges()
        self.registry.register(self._live)  # type: ignore[arg-type]  # duck-typed Collector
        self._kv_gauges = KvGauges()
        self.registry.register(self._kv_gauges)  # type: ignore[arg-type]  # duck-typed Collector

    def watch_kv_streams(self, streams: KvStreamsView) -> None:
        """Read `fleet_router_kv_stream_live` and `fleet_router_kv_index_blocks` from `streams` at each
        scrape (called once by `router.signals.kv_streams.KvEventStreams`)."""
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
        for family in (self.retries, self.migrations, self.unmigrated_streams, self.migration_time, self.rejected,
                       self.queue_time, self.prompt_tokens, self.generation_tokens, self.responses_without_usage,
                       self.prefix_cache_hits, self.prefix_cache_predicted_hits):  # fmt: skip
            family.remove_by_labels({"model": model})

    async def render_off_loop(self, accept_header: str = "") -> tuple[bytes, str]:
        """`render` in a worker thread, so a scrape never holds the event loop. Encoding is
        Python code that hands the GIL back every few milliseconds, and it grows with the series:
        measured 1.1 s and 12 MB for a pool of 10,000 endpoints of which 1,000 had served
        requests. The live pools are read here, on the loop, so the thread touches no state the
        request path mutates (prometheus_client's own values are locked)."""
        self._live.pin()
        self._kv_gauges.pin()
        return await asyncio.to_thread(self.render, accept_header)  # the thread gets a copy of the context

    def render(self, accept_header: str = "") -> tuple[bytes, str]:
        """Text exposition of the registry and its content type, negotiated from `Accept`."""
        encoder: Callable[[CollectorRegistry], bytes]
        encoder, content_type = choose_encoder(accept_header)
        return encoder(self.registry), content_type
