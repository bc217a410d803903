"""What the trace simulator replays: a trace mapped onto a simulated fleet, and its size.

Owns `Workload` (the requests the simulator replays, in arrival order, with how they were
derived from the trace), `scale_rate` (a trace with ``k`` times the arrival rate and the same
time axis), `clip` (requests that fit the engine), `prompt_ids` (token ids of a request,
built when the request is dispatched, so 100k requests never hold their prompts at once),
`replica_capacity_per_s` (one replica's throughput on the request mix, measured with the
engine model in virtual time) and `FleetSizing` (fixed fleets sized for the peak and the
mean). Called by `fleet.tracesim.engine` and `fleet simulate`. Pure: no I/O beyond reading
the trace through `fleet.tracesim.traces.load_trace`.

How a trace meets the fleet (stated in docs/autoscaling.md):

1. ``clip(max_model_len)``: output tokens at most a quarter of the context, the prompt cut
   to what is left (as `loadtests/bench_routing.py` does).
2. ``scale_rate(k)``: k times the arrival rate on the SAME time axis, so bursts last as long
   as they did and a minute of start-up is still a minute of the burst. Between two
   consecutive trace arrivals (the gap ``g`` after request i) lie ``k`` requests: request i
   itself at its time and ``k - 1`` more at seeded uniform offsets in ``[0, g)``; the j-th
   copy takes the token counts of the request ``j * n / k`` positions further along the
   trace (cyclically), so a long prompt is not repeated ``k`` times in a row. Per-gap (and
   so per-minute) counts are exactly ``k`` times the trace's.
3. ``speedup`` (optional): arrivals ``speedup`` times closer together (this shortens bursts
   against start-up times and policy windows; `scale_rate` does not).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from fleet.enginesim.model import Arrival, EngineModel, run_virtual
from fleet.enginesim.profiles import Profile
from fleet.tracesim.traces import Trace, TraceRequest

CAPACITY_SAMPLE = 2000
"""Most requests of the trace's mix used to measure one replica's capacity (a stride sample;
the saturated throughput of 2,000 and of all 8,819 `code` requests differ by under 2 %)."""

PEAK_BIN_S = 60.0
"""Bin of the busiest arrival rate that fixed-for-peak is sized for (seconds): the busiest minute."""


def clip(trace: Trace, max_model_len: int) -> Trace:
    """Requests that fit the engine: output at most ``max_model_len // 4`` tokens, prompt cut
    to ``max_model_len - output`` (the same rule as loadtests/bench_routing.py)."""
    out = []
    for r in trace.requests:
        output = min(r.output_tokens, max_model_len // 4)
        prompt = min(r.prompt_tokens, max_model_len - output)
        blocks = r.prefix_blocks[: -(-prompt // r.prefix_block_tokens)]   # the last one may be cut
        out.append(replace(r, prompt_tokens=prompt, output_tokens=output, prefix_blocks=blocks))
    return Trace(trace.name, tuple(out))


def scale_rate(trace: Trace, k: int, seed: int = 0) -> Trace:
    """``k`` times the arrival rate on the same time axis (module docstring, step 2).

    Raises ValueError for ``k < 1``."""
    if k < 1:
        raise ValueError(f"rate scale must be an integer >= 1, got {k}")
    if k == 1:
        return trace
    reqs = trace.requests
    n = len(reqs)
    rng = random.Random(f"scale-rate:{seed}:{k}")
    out: list[TraceRequest] = []
    for i, r in enumerate(reqs):
        gap_s = reqs[i + 1].arrival_s - r.arrival_s if i + 1 < n else 0.0
        batch = [r]
        for j in range(1, k):
            other = reqs[(i + j * n // k) % n]
            batch.append(replace(other, arrival_s=r.arrival_s + rng.random() * gap_s))
        batch.sort(key=lambda x: x.arrival_s)
        out.extend(batch)
    return Trace(trace.name, tuple(out))


def jitter_arrivals(trace: Trace, max_s: float, seed: int = 0) -> Trace:
    """Every arrival later by a seeded uniform draw in ``[0, max_s)`` seconds, re-sorted: arrivals
    closer than ``max_s`` may swap, as they do when a live replay's requests race to the router
    (loadtests/sim_routing.py ``--arrival-jitter-ms``). A routing policy's hits on the Mooncake
    trace move by a few tenths of a point with the order (docs/routing.md, "New conversations
    where the least was stored"), so comparisons average over draws. ``max_s`` 0: the trace as it is.

    Raises ValueError for a negative ``max_s``."""
    if max_s < 0:
        raise ValueError(f"arrival jitter must be >= 0 s, got {max_s}")
    if max_s == 0:
        return trace
    rng = random.Random(seed)
    moved = [replace(r, arrival_s=r.arrival_s + rng.random() * max_s) for r in trace.requests]
    moved.sort(key=lambda r: r.arrival_s)
    return Trace(trace.name, tuple(moved))


def prompt_ids(index: int, r: TraceRequest, seed: int = 0) -> list[int]:
    """``r.prompt_tokens`` token ids: the prefix blocks first (``r.prefix_block_tokens`` ids
    each, which depend on the block id and the seed only, so equal leading blocks hit the
    prefix cache), then ids unique to request ``index`` (no accidental prefix hits: the Azure
    traces carry no prompt content)."""
    ids: list[int] = []
    width = r.prefix_block_tokens
    for block in r.prefix_blocks:
        key = (seed, block, width)
        ids.extend(10 + hash((key, j)) % 31990 for j in range(width))
    ids = ids[: r.prompt_tokens]
    base = 1_000_000 + (seed % 1000 * 10_000_000 + index) * 10_000
    ids.extend(range(base, base + r.prompt_tokens - len(ids)))
    return ids


def replica_capacity_per_s(trace: Trace, profile: Profile, slowdown: float = 1.0,
                           sample: int = CAPACITY_SAMPLE) -> float:  # fmt: skip
    """Requests per second one replica completes when saturated with ``trace``'s request mix:
    a stride sample of at most ``sample`` requests all queued at 0 s, run through the engine
    model in virtual time; completed requests / makespan (as loadtests/bench_routing.py)."""
    reqs = trace.requests
    stride = max(1, math.ceil(len(reqs) / sample))
    picked = reqs[::stride]
    model = EngineModel(profile.config, profile.cost, slowdown=slowdown)
    finished = run_virtual(model, [Arrival(0.0, str(i), prompt_ids(i, r), r.output_tokens) for i, r in enumerate(picked)])
    return len(finished) / max(f.finished_s for f in finished)


@dataclass(frozen=True)
class FleetSizing:
    """Fixed fleets for a workload: ``peak`` = ceil(busiest minute's arrival rate / capacity),
    ``mean`` = ceil(mean arrival rate / capacity); rates in requests/s."""

    capacity_per_s: float
    mean_rate_per_s: float
    peak_rate_per_s: float

    @property
    def peak(self) -> int:
        return max(1, math.ceil(self.peak_rate_per_s / self.capacity_per_s - 1e-9))

    @property
    def mean(self) -> int:
        return max(1, math.ceil(self.mean_rate_per_s / self.capacity_per_s - 1e-9))


def busiest_rate_per_s(trace: Trace, bin_s: float = PEAK_BIN_S) -> float:
    """Arrivals per second in the busiest ``bin_s`` bin (bins from the first arrival)."""
    counts = Counter(int(r.arrival_s // bin_s) for r in trace.requests)
    return max(counts.values()) / bin_s if counts else 0.0


@dataclass(frozen=True)
class Workload:
    """The requests a simulation replays, and how they came from the trace.

    ``trace``: the requests after clip, rate scale and speedup (arrival order);
    ``source``: the trace's name; ``rate_scale``, ``speedup``: the factors applied;
    ``clipped``: requests whose prompt or output was cut to fit ``max_model_len``.
    """

    trace: Trace
    source: str
    rate_scale: int = 1
    speedup: float = 1.0
    clipped: int = 0

    @classmethod
    def from_trace(cls, trace: Trace, profile: Profile, *, rate_scale: int = 1, speedup: float = 1.0,
                   seed: int = 0) -> Workload:  # fmt: skip
        """Clip to the profile's ``max_model_len``, scale the rate, then compress time.

        Raises ValueError for ``rate_scale < 1`` or ``speedup <= 0``."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        fitted = clip(trace, profile.config.max_model_len)
        clipped = sum(1 for a, b in zip(trace.requests, fitted.requests)
                      if (a.prompt_tokens, a.output_tokens) != (b.prompt_tokens, b.output_tokens))  # fmt: skip
        scaled = scale_rate(fitted, rate_scale, seed)
        if speedup != 1.0:
            scaled = scaled.compressed(speedup)
        return cls(scaled, trace.name, rate_scale, speedup, clipped)

    @property
    def requests(self) -> tuple[TraceRequest, ...]:
        return self.trace.requests

    @property
    def duration_s(self) -> float:
        return self.trace.duration_s

    def sizing(self, capacity_per_s: float) -> FleetSizing:
        return FleetSizing(capacity_per_s, self.trace.mean_rate_per_s(), busiest_rate_per_s(self.trace))

    def describe(self) -> dict[str, Any]:
        """JSON-ready: where the requests came from and their shape (rates in requests/s)."""
        reqs = self.trace.requests
        n = len(reqs)
        return {
            "trace": self.source, "requests": n, "duration_s": self.duration_s, "rate_scale": self.rate_scale,
            "speedup": self.speedup, "clipped": self.clipped, "mean_rate_per_s": self.trace.mean_rate_per_s(),
            "peak_rate_per_s": busiest_rate_per_s(self.trace), "peak_bin_s": PEAK_BIN_S,
            "mean_prompt_tokens": sum(r.prompt_tokens for r in reqs) / n if n else 0.0,
            "mean_output_tokens": sum(r.output_tokens for r in reqs) / n if n else 0.0,
        }  # fmt: skip


HISTORY_BIN_S = 5.0
"""Step of the arrival rates a history trace is given to a policy in (seconds): Fleet's decision interval."""

HISTORY_WINDOW_S = 30.0
"""Each rate of a history counts the arrivals of the window this long ending at its step, as
`autoscaler.signals.Signals.arrival_rate_per_s` does over ``spec.autoscaling.windowSeconds``."""


def history_rates(traces: Sequence[Trace], bin_s: float = HISTORY_BIN_S,
                  window_s: float = HISTORY_WINDOW_S) -> tuple[tuple[float, float], ...]:  # fmt: skip
    """Arrival rates of ``traces`` laid back to back before 0 s, the last ending at 0 s, each
    taking its span rounded up to whole hours (a day file takes a day): (time in seconds,
    requests/s over the ``window_s`` before the end of its ``bin_s`` step), every step, empty
    ones included; `SimConfig.history`."""
    spans = [math.ceil(max(t.duration_s, 1.0) / 3600.0) * 3600.0 for t in traces]
    start_s = -sum(spans)
    counts: list[int] = []
    for trace, span_s in zip(traces, spans):
        part = [0] * math.ceil(span_s / bin_s)
        for r in trace.requests:
            part[min(len(part) - 1, int(r.arrival_s // bin_s))] += 1
        counts.extend(part)
    width = max(1, round(window_s / bin_s))
    out: list[tuple[float, float]] = []
    running = 0
    for i, c in enumerate(counts):
        running += c - (counts[i - width] if i >= width else 0)
        out.append((start_s + i * bin_s, running / (width * bin_s)))
    return tuple(out)
