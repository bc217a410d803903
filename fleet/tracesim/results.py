"""What one simulated run measured, and the figures made from it.

Owns `RequestLog` (per request: arrival, dispatch, first token, end, replica, failed),
`TickRecord` (per autoscaler decision: target, READY / starting / draining replicas, the
decision), `SimResult` (a run: both, plus the replicas' cost) and `Summary` (the table row:
share of requests within the TTFT SLO, p50 / p99 TTFT, replica-hours, scaling actions,
failed requests). Filled by `fleet.tracesim.engine`; read by `fleet simulate`, the plot
(`fleet.tracesim.plot`) and the tests. Pure data and arithmetic.

Definitions:

- TTFT: arrival at the router until the first token reached the client (router queue +
  engine queue + prefill), as `router.stats.windows` measures it live. Percentiles are nearest-rank
  over the requests that got a first token (`router.stats.windows.nearest_rank`); failed requests
  (503 from the router, cut off at a drain timeout) have no TTFT, are counted apart, and
  count as outside the SLO.
- Share within SLO: requests with TTFT <= ``ttft_slo_s`` / all requests (failed included).
- Replica-hours: each replica from placement (start-up included: a starting GPU is paid for)
  until it stopped (after its drain), clipped to the trace's span ``[0, horizon_s]``; time
  asleep (STANDBY) included, as a sleeping replica holds its GPUs; standby-hours: that part.
- Scaling actions: decisions that changed the target (up or down), like the live loop's
  `fleet_autoscaler_decisions_total{direction!="hold"}`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from autoscaler.policy import ScalingDecision
from router.stats.windows import nearest_rank as _nearest_rank


def nearest_rank(sorted_values: list[float], q: float) -> float | None:
    """The q-quantile (0 < q <= 1) of ascending values by nearest rank, as the router computes
    it (`router.stats.windows.nearest_rank`); None when there are none."""
    return _nearest_rank(sorted_values, q) if sorted_values else None


class RequestLog:
    """Per-request timeline, indexed by the request's position in the workload. Times are
    virtual seconds; NaN where the event did not happen (never dispatched, no token)."""

    __slots__ = ("arrival_s", "cached_tokens", "dispatch_s", "end_s", "failed", "first_token_s",
                 "predicted_cached_tokens", "prompt_tokens", "replica")

    def __init__(self, arrivals_s: list[float]) -> None:
        n = len(arrivals_s)
        nan = math.nan
        self.arrival_s = list(arrivals_s)
        self.dispatch_s = [nan] * n
        self.first_token_s = [nan] * n
        self.end_s = [nan] * n
        self.replica = [-1] * n
        self.failed = [False] * n
        self.prompt_tokens = [0] * n
        self.cached_tokens = [0] * n             # found in the engine's prefix cache
        self.predicted_cached_tokens = [0] * n   # what the routing policy expected there

    def prefix_hit_rate(self) -> float:
        """Prompt tokens found in the prefix cache / prompt tokens, over dispatched requests."""
        total = sum(self.prompt_tokens)
        return sum(self.cached_tokens) / total if total else 0.0

    def __len__(self) -> int:
        return len(self.arrival_s)

    def ttfts_s(self) -> list[float]:
        """TTFT of every request that got a first token, in request order."""
        return [f - a for a, f in zip(self.arrival_s, self.first_token_s) if not math.isnan(f)]


@dataclass(frozen=True)
class TickRecord:
    """One autoscaler decision at ``at_s``: the target after it, the replicas by phase at the
    time, and the decision itself."""

    at_s: float
    desired: int
    ready: int
    starting: int
    draining: int
    decision: ScalingDecision
    standby: int = 0


@dataclass(frozen=True)
class Summary:
    """One row of the comparison table (module docstring for definitions)."""

    name: str
    requests: int
    within_slo: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    replica_hours: float
    mean_replicas: float
    scale_ups: int
    scale_downs: int
    failed: int
    max_replicas: int
    prefix_hit_rate: float = 0.0
    standby_hours: float = 0.0
    wakes: int = 0

    @property
    def scaling_actions(self) -> int:
        return self.scale_ups + self.scale_downs

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "scaling_actions": self.scaling_actions}


@dataclass
class SimResult:
    """A finished run. ``horizon_s``: the trace's span (replica-hours are counted over
    ``[0, horizon_s]``); ``end_s``: when the last request finished; ``replica_cost_s``:
    replica-seconds within the horizon (standby included); ``standby_cost_s``: the part of it
    asleep (STANDBY); ``startups``: (replica id, warm, seconds) of every replica that started
    during the run; ``wakes``: (replica id, seconds from wake-up to READY) of every standby
    replica woken; ``wall_s``: real seconds the run took."""

    name: str
    policy: str
    ttft_slo_s: float
    requests: RequestLog
    ticks: list[TickRecord]
    horizon_s: float
    end_s: float
    replica_cost_s: float
    startups: list[tuple[str, bool, float]] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    steps: int = 0
    standby_cost_s: float = 0.0
    wakes: list[tuple[str, float]] = field(default_factory=list)

    def summary(self) -> Summary:
        log = self.requests
        ttfts = sorted(log.ttfts_s())
        within = sum(1 for t in ttfts if t <= self.ttft_slo_s + 1e-12)
        ups = sum(1 for t in self.ticks if t.decision.desired > t.decision.previous)
        downs = sum(1 for t in self.ticks if t.decision.desired < t.decision.previous)
        hours = self.replica_cost_s / 3600.0
        return Summary(
            name=self.name, requests=len(log), within_slo=within / len(log) if len(log) else 1.0,
            ttft_p50_s=nearest_rank(ttfts, 0.5), ttft_p99_s=nearest_rank(ttfts, 0.99), replica_hours=hours,
            mean_replicas=self.replica_cost_s / self.horizon_s if self.horizon_s > 0 else 0.0,
            scale_ups=ups, scale_downs=downs, failed=sum(log.failed),
            max_replicas=max((t.ready + t.starting for t in self.ticks), default=0),
            prefix_hit_rate=log.prefix_hit_rate(), standby_hours=self.standby_cost_s / 3600.0, wakes=len(self.wakes),
        )  # fmt: skip

    def timeline(self, bin_s: float = 60.0) -> dict[str, list[float]]:
        """Per ``bin_s`` bin of arrival time: ``t_s`` (bin start), ``arrivals_per_s``,
        ``ttft_p99_s`` (of the requests that arrived in the bin and got a first token; NaN
        without any), ``within_slo`` (share of the bin's requests), ``failed`` (requests of the
        bin that failed), and per decision ``tick_s``, ``desired``, ``ready``."""
        log = self.requests
        bins = max(1, math.ceil(max(self.horizon_s, 1e-9) / bin_s))
        counts = [0] * bins
        ttfts: list[list[float]] = [[] for _ in range(bins)]
        misses = [0] * bins
        failed = [0] * bins
        for a, f, lost in zip(log.arrival_s, log.first_token_s, log.failed):
            b = min(bins - 1, int(a // bin_s))
            counts[b] += 1
            failed[b] += lost
            if not math.isnan(f):
                ttfts[b].append(f - a)
                misses[b] += (f - a) > self.ttft_slo_s + 1e-12
            else:
                misses[b] += 1
        p99 = [nearest_rank(sorted(v), 0.99) if v else math.nan for v in ttfts]
        return {
            "t_s": [b * bin_s for b in range(bins)],
            "arrivals_per_s": [c / bin_s for c in counts],
            "ttft_p99_s": [math.nan if v is None else v for v in p99],
            "within_slo": [1 - m / c if c else math.nan for m, c in zip(misses, counts)],
            "failed": failed,
            "tick_s": [t.at_s for t in self.ticks],
            "desired": [t.desired for t in self.ticks],
            "ready": [t.ready for t in self.ticks],
        }

    def to_dict(self, timeline_bin_s: float = 60.0) -> dict[str, Any]:
        """JSON-ready: summary, parameters, start-ups, scaling actions and the timeline."""
        actions = [{"at_s": t.at_s, "previous": t.decision.previous, "desired": t.decision.desired,
                    "reason": t.decision.reason, "detail": t.decision.detail}
                   for t in self.ticks if t.decision.desired != t.decision.previous]  # fmt: skip
        return {
            "name": self.name, "policy": self.policy, "summary": self.summary().to_dict(), "params": self.params,
            "horizon_s": self.horizon_s, "end_s": self.end_s, "wall_s": self.wall_s, "engine_steps": self.steps,
            "startups": [{"replica": r, "warm": w, "seconds": s} for r, w, s in self.startups],
            "scaling_actions": actions,
            "timeline": {k: [None if isinstance(v, float) and math.isnan(v) else v for v in values]  # NaN (an empty bin) -> null
                         for k, values in self.timeline(timeline_bin_s).items()},
        }  # fmt: skip
