"""Windows over cumulative Prometheus histograms: how much a histogram grew in the last
``window_s`` seconds, and quantiles of that growth.

Owns `CumulativeHistogram` (one scrape of a histogram: bucket bounds, cumulative counts, sum,
count), `histogram_quantile` (Prometheus' interpolation) and `HistogramWindow` (the scrapes of
one series over time). Used by `autoscaler.signals` for the engines'
`vllm:request_queue_time_seconds`; the trace simulator feeds it simulated scrapes.

Method, the one Prometheus uses for ``histogram_quantile(q, sum(increase(x_bucket[w])))``:

- Increase over a window: the scrape at or just before the window's start is the baseline
  (the oldest scrape in the window when the series is younger than the window); the increase
  is the sum of the increments between consecutive scrapes from there to the newest one. A
  count that went down means the engine restarted: that increment is the new scrape itself
  (counted from zero), as Prometheus' counter-reset rule does. No extrapolation to the window
  edges: the window is measured at scrape granularity.
- Quantile: find the bucket whose cumulative count first reaches ``q * total`` and interpolate
  linearly inside it, from its lower bound (0 for the first bucket) to its upper bound; a rank
  in the +Inf bucket returns the largest finite bound. Accuracy is therefore bucket-wide: vLLM's
  queue-time buckets (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, ... s) bound the error by the width of
  the bucket the quantile falls in. The mean (sum / count of the increase) is exact.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class CumulativeHistogram:
    """One scrape of a Prometheus histogram.

    `bounds`: bucket upper bounds (``le``), ascending, the last one ``inf``; `counts`: the
    cumulative count of each bucket (observations <= bound); `sum`, `count`: the ``_sum`` and
    ``_count`` series. Raises ValueError when the shapes disagree or the last bound is finite.
    """

    bounds: tuple[float, ...]
    counts: tuple[float, ...]
    sum: float
    count: float

    def __post_init__(self) -> None:
        if len(self.bounds) != len(self.counts) or not self.bounds:
            raise ValueError(f"{len(self.bounds)} bounds but {len(self.counts)} counts")
        if self.bounds[-1] != math.inf:
            raise ValueError("the last bucket bound must be +Inf")
        if any(b >= a for a, b in zip(self.bounds[1:], self.bounds)):
            raise ValueError(f"bucket bounds must increase: {self.bounds}")

    @classmethod
    def zero(cls, bounds: tuple[float, ...]) -> CumulativeHistogram:
        return cls(bounds, (0.0,) * len(bounds), 0.0, 0.0)

    def _check_bounds(self, other: CumulativeHistogram) -> None:
        if other.bounds != self.bounds:
            raise ValueError(f"bucket bounds differ: {self.bounds} vs {other.bounds}")

    def plus(self, other: CumulativeHistogram) -> CumulativeHistogram:
        """Bucket-wise sum (aggregating series, e.g. replicas). Raises ValueError if bounds differ."""
        self._check_bounds(other)
        return CumulativeHistogram(self.bounds, tuple(a + b for a, b in zip(self.counts, other.counts)),
                                   self.sum + other.sum, self.count + other.count)  # fmt: skip

    def minus(self, older: CumulativeHistogram) -> CumulativeHistogram:
        """Bucket-wise difference from an older scrape of the same series."""
        self._check_bounds(older)
        return CumulativeHistogram(self.bounds, tuple(a - b for a, b in zip(self.counts, older.counts)),
                                   self.sum - older.sum, self.count - older.count)  # fmt: skip

    def is_reset_from(self, older: CumulativeHistogram) -> bool:
        """True when this scrape cannot follow ``older`` without a restart (any count fell)."""
        return self.count < older.count or any(a < b for a, b in zip(self.counts, older.counts))

    @property
    def mean(self) -> float | None:
        """sum / count, or None without observations."""
        return self.sum / self.count if self.count > 0 else None


def histogram_quantile(q: float, hist: CumulativeHistogram) -> float | None:
    """The q-quantile (0 <= q <= 1) of ``hist`` by Prometheus' ``histogram_quantile`` method
    (linear interpolation inside the bucket holding rank ``q * total``); None without
    observations. Raises ValueError for q outside [0, 1]."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    total = hist.counts[-1]
    if total <= 0:
        return None
    rank = q * total
    bounds, counts = hist.bounds, hist.counts
    b = next(i for i, c in enumerate(counts) if c >= rank or i == len(counts) - 1)
    if b == len(bounds) - 1:
        return bounds[-2] if len(bounds) > 1 else None  # in the +Inf bucket: the largest finite bound
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    below = 0.0 if b == 0 else counts[b - 1]
    in_bucket = counts[b] - below
    if in_bucket <= 0:
        return bounds[b]
    return start + (bounds[b] - start) * (rank - below) / in_bucket


class HistogramWindow:
    """Scrapes of one histogram series over the last ``retention_s`` seconds.

    `add(now_s, hist)` appends a scrape (times must not decrease); `increase(now_s, window_s)`
    returns how the histogram grew over the window (see the module docstring), or None with
    fewer than two scrapes to compare.
    """

    def __init__(self, retention_s: float) -> None:
        if retention_s <= 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s}")
        self.retention_s = retention_s
        self._scrapes: deque[tuple[float, CumulativeHistogram]] = deque()

    def __len__(self) -> int:
        return len(self._scrapes)

    def add(self, now_s: float, hist: CumulativeHistogram) -> None:
        scrapes = self._scrapes
        if scrapes and scrapes[-1][1].bounds != hist.bounds:
            scrapes.clear()  # the engine changed its buckets (a new version): start over
        scrapes.append((now_s, hist))
        # Keep one scrape older than the retention as the baseline of the longest window.
        while len(scrapes) > 2 and scrapes[1][0] <= now_s - self.retention_s:
            scrapes.popleft()

    def increase(self, now_s: float, window_s: float) -> CumulativeHistogram | None:
        since_s = now_s - window_s
        usable = [(t, h) for t, h in self._scrapes if t <= now_s]
        if len(usable) < 2:
            return None
        start = 0
        for i, (t, _) in enumerate(usable):
            if t <= since_s:
                start = i  # the newest scrape at or before the window's start
        if start == len(usable) - 1:
            return None  # nothing scraped inside the window
        total = CumulativeHistogram.zero(usable[start][1].bounds)
        for (_, older), (_, newer) in zip(usable[start:], usable[start + 1:]):
            total = total.plus(newer if newer.is_reset_from(older) else newer.minus(older))
        return total
