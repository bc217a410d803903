"""A SYNTHETIC multi-day trace with a daily cycle, made from a real one: the held-out trace of
the standby policy's proof (docs/benchmarks.md, "Standby on a held-out day (simulated)").

No multi-day LLM trace ships with Fleet (only the one-hour Azure 2023 `code` and `conv` and
Mooncake, loadtests/traces/), so this builds one and says plainly what is real and what is not:

- Real (resampled): every request's prompt and output tokens, its second within its minute,
  and the minute-to-minute burstiness, all taken from a real trace's minutes (default: Azure
  2023 `code`, the bursty one; loadtests/traces/azure-llm-2023/README.md). Each synthetic
  minute copies one source minute drawn at random (seeded) and keeps each of its requests with
  probability ``shape(t) x level(day)``: a thinned real minute, so its bursts keep their shape.
- Assumed (not measured from any trace): the daily shape `daily_shape` (busiest at 14:00, quietest
  at 04:00 at `TROUGH_FRACTION` of the peak; two cosine harmonics) and a level per day drawn
  from ``[1 - DAY_LEVEL_JITTER, 1 + DAY_LEVEL_JITTER]``. It stands for "busy by day, quiet by
  night", the pattern production LLM services report; its exact form is our choice. At the
  peak the mean rate is the source trace's own. No weekly cycle: four days hold none.

Run (files are large and not kept in the repository; the same seed writes the same files)::

    python -m loadtests.daily_trace --days 4 --seed 7 --out /tmp/daily

writes ``day-1.jsonl`` ... ``day-4.jsonl`` (Fleet's JSONL form, `fleet.tracesim.traces`), each
starting at its midnight. Tune on days 1-3, report on day 4 (the proof primes the forecast
with the earlier days: `fleet simulate --history`).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from fleet.tracesim.traces import Trace, TraceRequest, load_trace, write_jsonl

DAY_S = 86_400.0
MINUTE_S = 60.0
PEAK_HOUR = 14.0
"""Hour of the day the shape peaks at (assumed)."""
TROUGH_FRACTION = 0.3
"""The quietest minute's expected rate over the busiest's (assumed)."""
DAY_LEVEL_JITTER = 0.1
"""Each day's level is drawn uniformly from 1 +- this (assumed)."""
DEFAULT_SOURCE = Path("loadtests/traces/azure-llm-2023/code.csv")


def daily_shape(t_s: float) -> float:
    """Share of the peak rate expected at ``t_s`` seconds after a midnight, in
    ``[TROUGH_FRACTION, 1]``: a first harmonic peaking at `PEAK_HOUR` plus a second that
    flattens the night, rescaled so the day's extremes are exactly the trough and 1."""
    return _rescale(_raw_shape(t_s))


def _raw_shape(t_s: float) -> float:
    phase = 2 * math.pi * ((t_s / 3600.0 - PEAK_HOUR) % 24.0) / 24.0
    return math.cos(phase) + 0.25 * math.cos(2 * phase)


_RAW = [_raw_shape(m * MINUTE_S) for m in range(1440)]
_RAW_MIN, _RAW_MAX = min(_RAW), max(_RAW)


def _rescale(raw: float) -> float:
    unit = (raw - _RAW_MIN) / (_RAW_MAX - _RAW_MIN)
    return TROUGH_FRACTION + (1 - TROUGH_FRACTION) * unit


def source_minutes(trace: Trace) -> list[list[TraceRequest]]:
    """The trace's requests grouped by minute, arrival times made relative to their minute
    (empty minutes kept: idle minutes are part of the burstiness)."""
    minutes: list[list[TraceRequest]] = [[] for _ in range(int(trace.duration_s // MINUTE_S) + 1)]
    for r in trace.requests:
        m = int(r.arrival_s // MINUTE_S)
        minutes[m].append(replace(r, arrival_s=r.arrival_s - m * MINUTE_S))
    return minutes


def make_days(source: Trace, days: int, seed: int) -> list[Trace]:
    """``days`` traces of one day each (arrivals from that day's midnight), module docstring.
    Raises ValueError for ``days < 1`` or a source shorter than a minute."""
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    minutes = source_minutes(source)
    if len(minutes) < 2:
        raise ValueError(f"{source.name}: shorter than a minute")
    minutes = minutes[:-1]  # the last one is partial
    rng = random.Random(f"daily-trace:{seed}")
    out = []
    for day in range(days):
        level = 1 + rng.uniform(-DAY_LEVEL_JITTER, DAY_LEVEL_JITTER)
        requests: list[TraceRequest] = []
        for m in range(1440):
            keep = min(1.0, daily_shape(m * MINUTE_S) * level)
            for r in rng.choice(minutes):
                if rng.random() < keep:
                    requests.append(replace(r, arrival_s=m * MINUTE_S + r.arrival_s))
        out.append(Trace(f"{source.name}-daily-{day + 1}", tuple(requests)))
    return out


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--source", type=Path, default=DEFAULT_SOURCE, help="real trace to resample (default: Azure code)")
    p.add_argument("--days", type=int, default=4)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", type=Path, required=True, help="directory for day-N.jsonl")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for day, trace in enumerate(make_days(load_trace(args.source), args.days, args.seed), start=1):
        path = args.out / f"day-{day}.jsonl"
        write_jsonl(trace, path)
        print(f"{path}: {len(trace.requests)} requests, {len(trace.requests) / DAY_S:.2f} req/s mean")


if __name__ == "__main__":
    main()
