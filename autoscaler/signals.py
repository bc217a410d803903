"""One deployment's signals at one moment: what every scaling policy decides on.

Owns `Signals` (the snapshot a policy reads) and `DeploymentSignals`, which keeps the engine
scrapes of one deployment's replicas and combines them with the router's windowed statistics
(`router.stats.windows.ModelStats.snapshot`, fetched over `GET /admin/v1/stats`) into `Signals`.
Called by `fleet.controller.autoscaling` each autoscaler interval, and by the trace simulator with
simulated scrapes and a `ModelStats` it records into in virtual time.

Definitions (seconds unless named otherwise):

- ``queue_time_s``: mean time a request waited before it first ran, over the window = the
  router's mean queue time (arrival until dispatch, `router.stats.windows`) + the engines' mean
  `vllm:request_queue_time_seconds` (time WAITING in the scheduler). A mean of a sum is the
  sum of the means, so this is exact whichever of the two queues holds the requests; the
  engine mean is sum / count of the histogram's increase over the window (exact, no buckets).
- ``ttft_p99_s``, ``e2e_p99_s``: exact nearest-rank p99 of the client-side time to first token
  and end-to-end latency of the requests that completed in the window (router samples).
- ``engine_queue_time_p99_s``: p99 of the engines' queue time over the window, interpolated
  in the summed bucket increases (`autoscaler.histograms.histogram_quantile`).
- ``in_flight``, ``queued``: requests dispatched and not finished / waiting in the router's
  admission queue, now. ``arrival_rate_per_s``: requests per second reaching the router.
- ``engine_waiting``, ``engine_running``: sum over READY replicas of their latest
  `vllm:num_requests_waiting` / `vllm:num_requests_running`; ``kv_cache_usage``: the highest
  replica's `vllm:kv_cache_usage_perc` (0..1).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from autoscaler.engine_metrics import EngineSample
from autoscaler.histograms import CumulativeHistogram, HistogramWindow, histogram_quantile


@dataclass(frozen=True)
class Signals:
    """A deployment's signals at ``at_s`` over the ``window_s`` before it (see the module
    docstring for each field). None means "not measured" (no samples, no scrape), never 0."""

    at_s: float
    window_s: float
    arrival_rate_per_s: float = 0.0
    in_flight: int = 0
    queued: int = 0
    router_queue_time_mean_s: float | None = None
    ttft_p99_s: float | None = None
    ttft_samples: int = 0
    e2e_mean_s: float | None = None
    e2e_p99_s: float | None = None
    engine_queue_time_mean_s: float | None = None
    engine_queue_time_p99_s: float | None = None
    engine_queue_samples: int = 0
    engine_waiting: float | None = None
    engine_running: float | None = None
    kv_cache_usage: float | None = None

    @property
    def queue_time_s(self) -> float | None:
        """Router mean queue time + engine mean queue time (None when neither was measured)."""
        parts = [v for v in (self.router_queue_time_mean_s, self.engine_queue_time_mean_s) if v is not None]
        return sum(parts) if parts else None

    @property
    def concurrency(self) -> int:
        """Requests in the system now: dispatched and not finished, plus queued in the router."""
        return self.in_flight + self.queued

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields plus ``queue_time_s``."""
        return {**asdict(self), "queue_time_s": self.queue_time_s}


def _get(snapshot: Mapping[str, Any], key: str, field: str) -> Any:
    section = snapshot.get(key)
    return section.get(field) if isinstance(section, Mapping) else None


class DeploymentSignals:
    """Engine scrapes of one deployment's replicas, combined with router stats into `Signals`.

    `observe_engine(replica_id, now_s, sample)` records a scrape, `scrape_failed(replica_id)`
    a failed one; `forget_others(ids)` drops replicas no longer READY;
    `signals(now_s, router_snapshot)` builds the snapshot over ``window_s``. ``retention_s``
    bounds the scrape history kept per replica.
    """

    def __init__(self, window_s: float, retention_s: float | None = None) -> None:
        self.window_s = window_s
        self._retention_s = retention_s or 2 * window_s
        self._latest: dict[str, EngineSample] = {}
        self._queue_time: dict[str, HistogramWindow] = {}

    def observe_engine(self, replica_id: str, now_s: float, sample: EngineSample) -> None:
        self._latest[replica_id] = sample
        if sample.queue_time is not None:
            window = self._queue_time.setdefault(replica_id, HistogramWindow(self._retention_s))
            window.add(now_s, sample.queue_time)

    def scrape_failed(self, replica_id: str) -> None:
        """A scrape of ``replica_id`` failed: its gauges are unknown now (its histogram history
        stays; the next successful scrape continues it)."""
        self._latest.pop(replica_id, None)

    def forget_others(self, replica_ids: Collection[str]) -> None:
        """Drop the scrapes of replicas not in ``replica_ids`` (gone, draining or failed)."""
        for table in (self._latest, self._queue_time):
            for rid in [r for r in table if r not in replica_ids]:
                del table[rid]  # type: ignore[attr-defined]

    def _engine_queue_time(self, now_s: float) -> CumulativeHistogram | None:
        total: CumulativeHistogram | None = None
        for window in self._queue_time.values():
            grown = window.increase(now_s, self.window_s)
            if grown is None:
                continue
            if total is not None and total.bounds != grown.bounds:
                continue  # replicas with other buckets (mixed engine versions): first wins
            total = grown if total is None else total.plus(grown)
        return total

    def signals(self, now_s: float, router: Mapping[str, Any] | None) -> Signals:
        """`Signals` at ``now_s`` from the router's snapshot of this deployment's model (None
        when the router had none) and the engine scrapes kept here."""
        router = router or {}
        engine_qt = self._engine_queue_time(now_s)
        samples = list(self._latest.values())

        def total(field: str) -> float | None:
            values = [getattr(s, field) for s in samples if getattr(s, field) is not None]
            return sum(values) if values else None

        kv = [s.kv_cache_usage for s in samples if s.kv_cache_usage is not None]
        return Signals(
            at_s=now_s,
            window_s=self.window_s,
            arrival_rate_per_s=float(router.get("arrival_rate_per_s") or 0.0),
            in_flight=int(router.get("in_flight") or 0),
            queued=int(router.get("queued") or 0),
            router_queue_time_mean_s=_get(router, "queue_time_s", "mean"),
            ttft_p99_s=_get(router, "ttft_s", "p99"),
            ttft_samples=int(_get(router, "ttft_s", "samples") or 0),
            e2e_mean_s=_get(router, "e2e_s", "mean"),
            e2e_p99_s=_get(router, "e2e_s", "p99"),
            engine_queue_time_mean_s=engine_qt.mean if engine_qt is not None else None,
            engine_queue_time_p99_s=histogram_quantile(0.99, engine_qt) if engine_qt is not None else None,
            engine_queue_samples=int(engine_qt.count) if engine_qt is not None else 0,
            engine_waiting=total("waiting"),
            engine_running=total("running"),
            kv_cache_usage=max(kv) if kv else None,
        )
