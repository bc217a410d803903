"""How long a new replica takes to become ready, learned from the replicas that did.

Owns `StartupEstimate` (what a policy reads: warm and cold start-up seconds and which one the
next replica will need) and `StartupTracker` (observations per kind, median of the newest
few; the spec's initial estimates until the first observation). Called by
`fleet.controller.autoscaling`, which observes each replica once it is READY (placement until warm-up
passed), and by the trace simulator with its modelled start-up times.

Warm vs cold: a warm start finds the engine image and the weights already on the node, a cold
one pulls and copies them first (minutes for a 30 GB image or a large model,
docs/anchors.md). A median of the last five is robust to one slow start (a node with a
busy disk) and follows a lasting change within three starts.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

DEFAULT_KEEP = 5
"""Observations kept per kind (warm, cold) for the median."""


@dataclass(frozen=True)
class StartupEstimate:
    """Seconds from placement until READY for a warm and a cold start; ``next_warm``: whether
    the next replica will start warm (a node with image and weights has room for it);
    ``wake_s``: seconds until a STANDBY replica woken now serves, None when none is asleep (the
    next replica asked for then wakes instead of starting)."""

    warm_s: float
    cold_s: float
    next_warm: bool = True
    wake_s: float | None = None

    @property
    def lead_time_s(self) -> float:
        """Seconds until a replica asked for now would serve: the wake-up, the warm or the cold
        estimate, the fastest kind of capacity at hand first."""
        if self.wake_s is not None:
            return self.wake_s
        return self.warm_s if self.next_warm else self.cold_s


class StartupTracker:
    """Observed start-up times by kind; `estimate(next_warm)` gives the current estimate."""

    def __init__(self, warm_s: float, cold_s: float, keep: int = DEFAULT_KEEP) -> None:
        self._initial = {True: warm_s, False: cold_s}
        self._observed: dict[bool, deque[float]] = {True: deque(maxlen=keep), False: deque(maxlen=keep)}
        self._seen: set[str] = set()

    def observe(self, replica_id: str, warm: bool, seconds: float) -> bool:
        """Record one replica's start-up (once per id); False if that id was seen before."""
        if replica_id in self._seen or seconds < 0:
            return False
        self._seen.add(replica_id)
        self._observed[warm].append(seconds)
        return True

    def _kind(self, warm: bool) -> float:
        observed = self._observed[warm]
        return statistics.median(observed) if observed else self._initial[warm]

    def estimate(self, next_warm: bool = True) -> StartupEstimate:
        warm_s, cold_s = self._kind(True), self._kind(False)
        if not self._observed[False] and self._observed[True]:
            cold_s = max(cold_s, warm_s)  # a cold start is never faster than an observed warm one
        return StartupEstimate(warm_s, cold_s, next_warm)
