"""The router's gauges read when it is scraped: from the live pools and the KV event streams.

Owns `LiveGauges` (`fleet_router_requests_in_flight`, `fleet_router_pool_endpoints`,
`fleet_router_endpoint_ejected`, `fleet_router_queued_requests`, and the windowed
`fleet_router_arrival_rate` and `fleet_router_window_latency_seconds`, read from the live pools
and their `router.stats.windows.ModelStats`) and `KvGauges` (`fleet_router_kv_stream_live`,
`fleet_router_kv_index_blocks`), two custom collectors, and the protocols of what they read
(`LiveTable`, `KvStreamsView`). The request path pays nothing for them. Registered by
`router.stats.metrics.RouterMetrics`, which points them at `router.pools.pool.PoolTable` and
`router.signals.kv_streams.KvEventStreams` and calls `pin` on the event loop before it renders
in a worker thread.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric


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


_ScrapeView = tuple[Mapping[str, Sequence[LiveEndpoint]], Mapping[str, Mapping[str, object]], float]
_SCRAPE_VIEW: contextvars.ContextVar[_ScrapeView | None] = contextvars.ContextVar("fleet_router_scrape_view",
                                                                                  default=None)
"""The live pools' endpoints, statistics and clock reading as `LiveGauges.pin` read them on the
event loop, for the collector that runs in a worker thread (None: read the live table)."""


class LiveGauges:
    """Collector of the gauges derived from the live pools when the registry is scraped."""

    def __init__(self) -> None:
        self.table: LiveTable = _NoPools()

    def pin(self) -> None:
        """Read the live pools now (on the event loop) for the collections of this context: a
        copy of it taken to a worker thread collects what was read here, not the live table."""
        table = self.table
        _SCRAPE_VIEW.set((table.live_endpoints(), table.stats(), table.now_s()))

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
    """What the KV stream gauges read (`router.signals.kv_streams.KvEventStreams`)."""

    def kv_rows(self) -> list[tuple[str, str, bool, int]]:
        """(model, endpoint, live, blocks held) of every endpoint with a KV event stream."""
        ...


class _NoStreams:
    def kv_rows(self) -> list[tuple[str, str, bool, int]]:
        return []


_KV_SCRAPE_VIEW: contextvars.ContextVar[list[tuple[str, str, bool, int]] | None] = contextvars.ContextVar(
    "fleet_router_kv_scrape_view", default=None)
"""The KV stream rows as `KvGauges.pin` read them on the event loop (None: read the streams)."""


class KvGauges:
    """Collector of the KV event stream gauges, read from the subscribers when scraped."""

    def __init__(self) -> None:
        self.streams: KvStreamsView = _NoStreams()

    def pin(self) -> None:
        """Read the streams' rows now (on the event loop) for the collections of this context."""
        _KV_SCRAPE_VIEW.set(self.streams.kv_rows())

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
