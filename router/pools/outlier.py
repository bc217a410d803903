"""Outlier ejection: endpoints that keep failing or stalling leave a pool's candidates for a while.

Owns `OutlierSettings` (thresholds and times, Envoy's defaults where Envoy has one), `Outcome`
(what one attempt against an endpoint came to), `OutlierState` (one endpoint's counters and
ejection, held by `router.pools.endpoint.EndpointState.outlier`) and `OutlierDetector` (the policy:
`record` an outcome, `release` ejections that ended). `router.pools.pool.Pool` owns a detector and
calls it; `router.request.attempt` reports each attempt's outcome through `Pool.record_outcome`; the
trace simulator can call the same objects in virtual time. Pure: every time is passed in.

The algorithm is Envoy's consecutive-failure outlier detection (envoyproxy.io, "Outlier
detection" in the architecture overview and `config.cluster.v3.OutlierDetection`):

- `consecutive_5xx` (Envoy: 5): that many 5xx answers in a row eject the endpoint. Errors of
  the router's own side of the connection (connect refused or reset, a first-token timeout) count
  as 5xx, as Envoy counts local-origin errors when `split_external_local_origin_errors` is off.
- `consecutive_gateway_failure` (Envoy: 5): that many 502/503/504 answers, connection failures or
  timeouts in a row. Envoy ships it with `enforcing_consecutive_gateway_failure: 0` (detected,
  not enforced); here it is enforced, since a gateway failure of an engine is never the client's.
- `consecutive_stalls` (no Envoy equivalent; 2): that many first-token timeouts in a row. A stall
  costs each request that meets it the whole first-token deadline, so it ejects sooner than 5xx.
- Any success resets the three counters.
- An ejection lasts `base_ejection_time_s` (Envoy: 30 s) x the endpoint's ejection multiplier,
  at most `max_ejection_time_s` (Envoy: 300 s). The multiplier grows by one per ejection and
  shrinks by one per `interval_s` (Envoy: 10 s) the endpoint spends back in service, so a host
  that keeps failing stays out longer each time and one that recovered starts afresh.
- `max_ejection_percent` bounds the ejected share of a pool's ready endpoints. Envoy's default is
  10% with at least one host ejectable; here the default is 50% (Envoy's default
  `healthy_panic_threshold`, below which Envoy routes to every host anyway), because inference
  pools hold 2-10 replicas, not hundreds of hosts. At least one endpoint may be ejected, but
  never the last ready one: a pool of one endpoint never ejects.

Ejection ends lazily: `release` (called by `Pool.pick` when an ejection is due to end) puts the
endpoint back; there is no timer.

Slow start after an ejection (Envoy's `slow_start_config` of the round-robin and least-request
load balancers, envoyproxy.io "Slow start mode"): for `slow_start_window_s` after it returned, an
endpoint takes `factor` times the share of requests the policy would give it, ramping up as
Envoy's weight factor does,

    factor = max(min_weight_percent / 100, (max(seconds back, 1) / slow_start_window_s) ^ (1 / aggression))

(`slow_start_weight`; Envoy's defaults `aggression` 1.0, a linear ramp, and `min_weight_percent`
10), so an engine still slow when its ejection ends does not take full traffic at once. The share
is kept without randomness (`admit`): each pick it is a candidate for adds `factor` to its credit,
and it stays a candidate only while the credit reaches one. Envoy sets no window by default (slow
start off); here it is 30 s, one base ejection time, so that a returning engine gets its traffic
back over as long as it was out the first time.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class Outcome(enum.Enum):
    """What one attempt against an endpoint came to, as outlier detection counts it."""

    SUCCESS = "success"            # an answer < 500 (a 4xx is the client's fault, not the endpoint's)
    SERVER_ERROR = "5xx"           # a 5xx answer other than 502/503/504
    GATEWAY_FAILURE = "gateway"    # 502/503/504, a connection refused/reset/closed before the head
    STALL = "stall"                # no first token within the request's first-token deadline


@dataclass(frozen=True)
class OutlierSettings:
    """Thresholds and times of outlier ejection (see the module docstring for sources).

    Counts are consecutive attempts; 0 disables that detector. Times are seconds.
    Raises ValueError for a negative count, a non-positive time or a percent outside 0..100.
    """

    consecutive_5xx: int = 5
    consecutive_gateway_failure: int = 5
    consecutive_stalls: int = 2
    interval_s: float = 10.0
    base_ejection_time_s: float = 30.0
    max_ejection_time_s: float = 300.0
    max_ejection_percent: float = 50.0
    slow_start_window_s: float = 30.0
    slow_start_aggression: float = 1.0
    slow_start_min_weight_percent: float = 10.0

    def __post_init__(self) -> None:
        for name in ("consecutive_5xx", "consecutive_gateway_failure", "consecutive_stalls"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("interval_s", "base_ejection_time_s", "max_ejection_time_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0.0 <= self.max_ejection_percent <= 100.0:
            raise ValueError(f"max_ejection_percent must be in 0..100, got {self.max_ejection_percent}")
        if self.slow_start_window_s < 0 or not self.slow_start_aggression > 0:
            raise ValueError("slow_start_window_s must be >= 0 and slow_start_aggression > 0, got "
                             f"{self.slow_start_window_s} and {self.slow_start_aggression}")  # fmt: skip
        if not 0.0 <= self.slow_start_min_weight_percent <= 100.0:
            raise ValueError(f"slow_start_min_weight_percent must be in 0..100, got "
                             f"{self.slow_start_min_weight_percent}")  # fmt: skip

    def max_ejected(self, ready: int) -> int:
        """Most endpoints of a pool with `ready` ready endpoints that may be ejected at once:
        `floor(ready x max_ejection_percent / 100)`, at least 1 (as Envoy) but at most
        `ready - 1` (never the last one); 0 when the percent is 0."""
        if self.max_ejection_percent <= 0.0 or ready <= 1:
            return 0
        return min(ready - 1, max(1, math.floor(ready * self.max_ejection_percent / 100.0)))


class OutlierState:
    """One endpoint's outlier counters and ejection (all times router-clock seconds).

    `consecutive_5xx`, `consecutive_gateway_failures`, `consecutive_stalls`: the current runs
    of each kind of failure (reset by a success). `multiplier`: the ejection-time multiplier
    (grows per ejection, shrinks per healthy `interval_s`). `ejected_until_s`: when the
    current ejection ends, 0.0 when not ejected (`EndpointState.ejected_until_s` mirrors it
    for the picking loop). `ejected_at_s`, `reason`: when and why the latest ejection began
    (reason: `Outcome` value of the failure run that caused it). `ejections_total`,
    `stalls_total`: counts since the endpoint joined the pool. `back_s`: when it last
    returned to service (the multiplier's decay and slow start start there). `slow_start_credit`:
    the share of picks slow start has let it take (`OutlierDetector.admit`)."""

    __slots__ = ("consecutive_5xx", "consecutive_gateway_failures", "consecutive_stalls", "multiplier",
                 "ejected_until_s", "ejected_at_s", "reason", "ejections_total", "stalls_total", "back_s",
                 "slow_start_credit")  # fmt: skip

    def __init__(self) -> None:
        self.consecutive_5xx = 0
        self.consecutive_gateway_failures = 0
        self.consecutive_stalls = 0
        self.multiplier = 0
        self.ejected_until_s = 0.0
        self.ejected_at_s: float | None = None
        self.reason = ""
        self.ejections_total = 0
        self.stalls_total = 0
        self.back_s = 0.0
        self.slow_start_credit = 0.0

    def ejected(self, now_s: float) -> bool:
        """Whether an ejection is in force at `now_s`."""
        return self.ejected_until_s > now_s

    def snapshot(self, now_s: float) -> dict[str, object]:
        """What `GET /admin/v1/pools` shows of it (`ejected_for_s`: seconds left, None when in
        service)."""
        ejected = self.ejected(now_s)
        return {
            "ejected": ejected,
            "ejected_for_s": round(self.ejected_until_s - now_s, 3) if ejected else None,
            "ejection_reason": self.reason or None,
            "ejections_total": self.ejections_total,
            "stalls_total": self.stalls_total,
            "consecutive_failures": max(self.consecutive_5xx, self.consecutive_gateway_failures),
            "consecutive_stalls": self.consecutive_stalls,
        }


class Ejectable(Protocol):
    """What the detector reads and writes of an endpoint (`router.pools.endpoint.EndpointState`)."""

    outlier: OutlierState
    ejected_until_s: float
    slow_start_since_s: float


class OutlierDetector:
    """Envoy-style consecutive-failure ejection over the endpoints of one pool (module docstring)."""

    __slots__ = ("settings",)

    def __init__(self, settings: OutlierSettings | None = None) -> None:
        self.settings = settings if settings is not None else OutlierSettings()

    def record(self, endpoint: Ejectable, outcome: Outcome, now_s: float,
               ready: Sequence[Ejectable]) -> bool:  # fmt: skip
        """Count one attempt's `outcome` against `endpoint`; True when this ejects it (until
        `endpoint.ejected_until_s`). `ready`: the pool's ready endpoints, for
        `max_ejection_percent` (an endpoint not among them, e.g. a draining one, is counted but
        never ejected). An endpoint already ejected is counted, not ejected again."""
        s, state = self.settings, endpoint.outlier
        if outcome is Outcome.SUCCESS:
            state.consecutive_5xx = state.consecutive_gateway_failures = state.consecutive_stalls = 0
            return False
        state.consecutive_5xx += 1
        if outcome is Outcome.SERVER_ERROR:
            state.consecutive_gateway_failures = 0
            state.consecutive_stalls = 0
        else:
            state.consecutive_gateway_failures += 1
            if outcome is Outcome.STALL:
                state.consecutive_stalls += 1
                state.stalls_total += 1
            else:
                state.consecutive_stalls = 0
        if state.ejected(now_s):
            return False
        if 0 < s.consecutive_stalls <= state.consecutive_stalls:
            reason = Outcome.STALL
        elif 0 < s.consecutive_gateway_failure <= state.consecutive_gateway_failures:
            reason = Outcome.GATEWAY_FAILURE
        elif 0 < s.consecutive_5xx <= state.consecutive_5xx:
            reason = Outcome.SERVER_ERROR
        else:
            return False
        if endpoint not in ready:
            return False
        ejected_now = sum(1 for e in ready if e.outlier.ejected(now_s))
        if ejected_now >= s.max_ejected(len(ready)):
            return False
        self._eject(endpoint, reason, now_s)
        return True

    def _eject(self, endpoint: Ejectable, reason: Outcome, now_s: float) -> None:
        s, state = self.settings, endpoint.outlier
        if state.multiplier and state.back_s:
            healthy_intervals = int((now_s - state.back_s) // s.interval_s)
            state.multiplier = max(0, state.multiplier - healthy_intervals)
        state.multiplier += 1
        duration_s = min(s.base_ejection_time_s * state.multiplier, s.max_ejection_time_s)
        state.ejected_until_s = endpoint.ejected_until_s = now_s + duration_s
        state.ejected_at_s = now_s
        state.reason = reason.value
        state.ejections_total += 1
        state.consecutive_5xx = state.consecutive_gateway_failures = state.consecutive_stalls = 0

    @staticmethod
    def release(endpoint: Ejectable, now_s: float) -> bool:
        """End `endpoint`'s ejection if it is due at `now_s`; True when it returned to service (its
        slow start begins: `endpoint.slow_start_since_s`, `admit`)."""
        state = endpoint.outlier
        if state.ejected_until_s == 0.0 or state.ejected_until_s > now_s:
            return False
        state.back_s = endpoint.slow_start_since_s = state.ejected_until_s
        state.ejected_until_s = endpoint.ejected_until_s = 0.0
        state.slow_start_credit = 0.0
        return True

    def slow_start_weight(self, endpoint: Ejectable, now_s: float) -> float:
        """The share (0..1] of its traffic `endpoint` takes at `now_s` (module docstring: Envoy's
        slow start formula); 1.0 outside a slow-start window."""
        s, back_s = self.settings, endpoint.outlier.back_s
        if not back_s or s.slow_start_window_s <= 0 or now_s - back_s >= s.slow_start_window_s:
            return 1.0
        time_factor = max(now_s - back_s, 1.0) / s.slow_start_window_s
        return min(1.0, max(s.slow_start_min_weight_percent / 100.0, time_factor ** (1.0 / s.slow_start_aggression)))

    def admit(self, endpoint: Ejectable, now_s: float) -> bool:
        """Whether `endpoint`, a candidate of a pick at `now_s`, stays one under slow start: its
        credit grows by `slow_start_weight` per pick and it stays while the credit reaches one
        (then spends one); always True outside a slow-start window (which ends here:
        `endpoint.slow_start_since_s` drops to 0.0)."""
        weight = self.slow_start_weight(endpoint, now_s)
        if weight >= 1.0:
            endpoint.slow_start_since_s = 0.0
            return True
        state = endpoint.outlier
        state.slow_start_credit += weight
        if state.slow_start_credit >= 1.0:
            state.slow_start_credit -= 1.0
            return True
        return False
