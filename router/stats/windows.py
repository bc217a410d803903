"""Windowed request statistics of each model: arrival rate, queue time, TTFT, TPOT, end-to-end latency.

Owns the two window primitives and `ModelStats`, the per-model bundle the request path records into.
`router.pools.pool.PoolTable` keeps one `ModelStats` per model across pool replacements; the request
path records into it (`router.request.proxy`: arrival, dispatch, a wait given up;
`router.request.attempt`: completion); `router.http.admin` (`GET /admin/v1/stats`) and
`router.stats.metrics` (scrape-time gauges) read `ModelStats.snapshot`. The autoscaler reads those
snapshots over the admin API, and the trace simulator records into the very same objects in virtual
time. Nothing here does I/O or reads a clock: every call takes `now_s` (seconds on the router
clock).

Method (what the numbers mean):

- Latency percentiles are exact, nearest-rank, over the samples of the window: the p-quantile
  of n sorted samples is the ceil(p * n)-th smallest (Hyndman & Fan definition 1, the one
  without interpolation). Samples sit in a bounded ring (`SampleWindow`, default 8192 per
  signal), so a window holding more samples than the ring covers only the newest ones; the
  snapshot then reports the span it really covered (`covered_s` below `window_s`). At 100
  requests/s the default ring holds 80 s, more than the 30 s default window.
- Arrival and rejection rates come from per-second counters (`RateWindow`), not from the ring,
  so they stay exact at any rate: rate = arrivals in the covered span / covered seconds, where
  the span is the current partial second plus the whole seconds before it, never reaches back
  before the statistics began, and counts as at least one second.

Recording costs a few list stores per request and allocates nothing; the sort happens when a
snapshot is asked for (the admin API, a scrape), off the request path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_WINDOW_S = 30.0
"""Window (seconds) of `GET /admin/v1/stats` and of the scrape-time gauges when none is asked."""

DEFAULT_SAMPLES_PER_WINDOW = 8192
"""Samples each latency ring holds (per model and signal)."""

DEFAULT_RATE_RETENTION_S = 600
"""Seconds of per-second counters kept: the longest window a rate can be asked over."""

QUANTILES = (0.5, 0.9, 0.99)
"""Quantiles every latency summary reports."""


def nearest_rank(sorted_values: list[float], q: float) -> float:
    """The q-quantile (0 < q <= 1) of ascending ``sorted_values`` by the nearest-rank method:
    the ceil(q * n)-th smallest value. Raises ValueError on an empty list or q outside (0, 1]."""
    n = len(sorted_values)
    if n == 0:
        raise ValueError("no samples")
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {q}")
    rank = math.ceil(q * n - 1e-9)  # 0.99 * 100 must be rank 99, not 100 through float error
    return sorted_values[max(rank, 1) - 1]


@dataclass(frozen=True)
class LatencySummary:
    """Summary of one latency signal over a window (seconds). `samples` is how many requests
    it describes; the other fields are None when there are none."""

    samples: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: list[float]) -> LatencySummary:
        """Summary of ``values`` (any order): mean, nearest-rank p50/p90/p99, max."""
        if not values:
            return cls(0, None, None, None, None, None)
        ordered = sorted(values)
        p50, p90, p99 = (nearest_rank(ordered, q) for q in QUANTILES)
        return cls(len(ordered), math.fsum(ordered) / len(ordered), p50, p90, p99, ordered[-1])

    def to_dict(self) -> dict[str, float | int | None]:
        return {"samples": self.samples, "mean": self.mean, "p50": self.p50, "p90": self.p90,
                "p99": self.p99, "max": self.max}  # fmt: skip


class SampleWindow:
    """The newest ``capacity`` (time, value) samples in a ring; times must not decrease.

    `add` is two list stores and an index step. `values(now_s, window_s)` returns the values of
    samples with time in ``[now_s - window_s, now_s]`` and the seconds that set covers.
    """

    __slots__ = ("_times", "_values", "_next", "capacity")

    def __init__(self, capacity: int = DEFAULT_SAMPLES_PER_WINDOW) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._times = [-math.inf] * capacity
        self._values = [0.0] * capacity
        self._next = 0

    def add(self, now_s: float, value: float) -> None:
        i = self._next
        self._times[i] = now_s
        self._values[i] = value
        i += 1
        self._next = i if i < self.capacity else 0

    def values(self, now_s: float, window_s: float) -> tuple[list[float], float]:
        """Values of the samples in the window, and the span covered (seconds): ``window_s``,
        or less when the ring holds only the newest part of the window."""
        since_s = now_s - window_s
        times, values = self._times, self._values
        out = [v for t, v in zip(times, values) if since_s <= t <= now_s]
        oldest_s = times[self._next]  # the slot written next holds the oldest sample
        covered_s = window_s if oldest_s < since_s else max(0.0, now_s - oldest_s)
        return out, covered_s


class RateWindow:
    """Event counts in one-second (``slice_s``) slices over the last ``retention_s`` seconds.

    `add` finds the slice of ``now_s`` and bumps its counter, zeroing slices it skipped over.
    `count(now_s, window_s)` sums the slices that overlap the window and returns the seconds
    they cover (the current slice only up to ``now_s``; never before ``started_s``).
    """

    __slots__ = ("_counts", "_current", "slice_s", "started_s")

    def __init__(self, started_s: float, retention_s: float = DEFAULT_RATE_RETENTION_S,
                 slice_s: float = 1.0) -> None:  # fmt: skip
        if slice_s <= 0 or retention_s < slice_s:
            raise ValueError(f"need 0 < slice_s <= retention_s, got {slice_s}, {retention_s}")
        self.slice_s = slice_s
        self.started_s = started_s
        self._counts = [0] * (int(math.ceil(retention_s / slice_s)) + 1)
        self._current = int(started_s // slice_s)

    def add(self, now_s: float, n: int = 1) -> None:
        index = int(now_s // self.slice_s)
        if index != self._current:
            self._advance(index)
        self._counts[self._current % len(self._counts)] += n

    def _advance(self, index: int) -> None:
        if index < self._current:
            return  # a clock that stepped back: count into the current slice
        size = len(self._counts)
        for i in range(self._current + 1, min(index, self._current + size) + 1):
            self._counts[i % size] = 0
        self._current = index

    def count(self, now_s: float, window_s: float) -> tuple[int, float]:
        """(events, covered seconds) over the slices overlapping ``[now_s - window_s, now_s]``."""
        index = int(now_s // self.slice_s)
        self._advance(index)
        size = len(self._counts)
        slices = min(int(math.ceil(window_s / self.slice_s)), size - 1)
        first = max(index - slices + 1, int(self.started_s // self.slice_s))
        total = sum(self._counts[i % size] for i in range(first, index + 1))
        covered_s = now_s - max(first * self.slice_s, self.started_s)
        return total, covered_s


class ModelStats:
    """What the router measured for one model, recorded by the request path.

    Signals (seconds on the router clock; "arrival" = the router has the whole request body and
    knows its model's pool):
    `arrivals` - requests that reached routing (counted once, before any queueing or rejection);
    `rejected` - requests the router answered itself with 502/503 (no ready endpoint, admission
    queue full or timed out, every endpoint unreachable);
    `queue_time` - arrival until dispatch to an endpoint: time spent in the router's admission
    queue (0 when an endpoint had a free slot at once), sampled at dispatch; a request that
    gave up waiting (queue timeout) counts with the time it waited;
    `ttft` - arrival until the first response byte reached the client (the client-side time to
    first token of a streamed reply: queue time + retries + the endpoint's time to first byte;
    for a non-streamed reply the whole answer), successful (< 400) responses only, sampled then;
    `tpot` - time per output token of a successful streamed reply, as the router saw its token
    events arrive (`router.protocol.sse`; the formula is `router.stats.metrics`'
    `fleet_router_time_per_output_token_seconds`), sampled at completion;
    `e2e` - arrival until the last response byte was relayed, every completed response,
    sampled then.
    """

    __slots__ = ("arrivals", "rejected", "queue_time", "ttft", "tpot", "e2e", "started_s")

    def __init__(self, started_s: float, samples: int = DEFAULT_SAMPLES_PER_WINDOW,
                 rate_retention_s: float = DEFAULT_RATE_RETENTION_S) -> None:  # fmt: skip
        self.started_s = started_s
        self.arrivals = RateWindow(started_s, rate_retention_s)
        self.rejected = RateWindow(started_s, rate_retention_s)
        self.queue_time = SampleWindow(samples)
        self.ttft = SampleWindow(samples)
        self.tpot = SampleWindow(samples)
        self.e2e = SampleWindow(samples)

    def snapshot(self, now_s: float, window_s: float = DEFAULT_WINDOW_S, *, in_flight: int = 0,
                 queued: int = 0) -> dict[str, object]:  # fmt: skip
        """The model's statistics over ``[now_s - window_s, now_s]``, JSON-ready.

        ``in_flight`` (requests dispatched to an endpoint, not finished) and ``queued`` (waiting
        in the admission queue) are instantaneous and come from the caller's live pool.
        Keys: ``window_s``, ``covered_s`` (the span the latency samples cover; below
        ``window_s`` only when a ring overflowed), ``arrivals``, ``arrival_rate_per_s``,
        ``rejected``, ``rejected_rate_per_s``, ``in_flight``, ``queued``, and
        ``queue_time_s``, ``ttft_s``, ``tpot_s``, ``e2e_s`` (`LatencySummary.to_dict`).
        """
        arrivals, rate_span_s = self.arrivals.count(now_s, window_s)
        rejected, _ = self.rejected.count(now_s, window_s)
        rate_span_s = max(rate_span_s, self.arrivals.slice_s)  # one early request is not a rate
        covered = [window_s]
        summaries = {}
        for name, ring in (("queue_time_s", self.queue_time), ("ttft_s", self.ttft), ("tpot_s", self.tpot),
                           ("e2e_s", self.e2e)):  # fmt: skip
            values, covered_s = ring.values(now_s, window_s)
            covered.append(covered_s)
            summaries[name] = LatencySummary.of(values).to_dict()
        return {
            "window_s": window_s,
            "covered_s": min(covered),
            "arrivals": arrivals,
            "arrival_rate_per_s": arrivals / rate_span_s,
            "rejected": rejected,
            "rejected_rate_per_s": rejected / rate_span_s,
            "in_flight": in_flight,
            "queued": queued,
            **summaries,
        }
