"""Percentiles and summaries of latency samples for the benchmarks and the trace replayer.

Owns `percentile` (nearest-rank, the definition load-test tools such as wrk and vLLM's
benchmark scripts report) and `summarize`. Pure functions over lists of seconds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: the smallest sample with at least ``q`` % of samples <= it.

    ``q`` in [0, 100]. Raises ValueError on an empty sequence or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no samples")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within [0, 100], got {q}")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99 and max of ``values`` (None for each when empty)."""
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": sum(ordered) / len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1],
    }
