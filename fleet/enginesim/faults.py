"""Fault switches of the engine SIMULATOR, for reliability tests of the control plane and router.

Owns `FaultPlan`, the faults one simulated replica is told to show:

- ``fail_at_start``: after the start-up delay the replica never listens; a one-replica process
  exits with code 1 and a log line, as vLLM does when engine initialisation fails.
- ``crash_after_requests``: once it has answered N requests the replica dies: its listener
  closes and in-flight connections are cut (a one-replica process exits with code 1).
- ``slowdown``: every engine step takes this factor longer (a degraded GPU, a noisy
  neighbour); can also be changed at run time with ``POST /sim/faults``.
- ``stall``: the engine stops stepping while its HTTP server keeps answering: requests are
  accepted and get nothing (no token, not even a streamed response's first event), ``/health``
  still answers 200 (a hung GPU or collective, an engine core process SIGSTOPped behind a live
  API server: vLLM's ``/health`` asks the engine core only whether it is dead, not whether it
  makes progress). Switched on and off at run time with ``POST /sim/faults {"stall": true}``;
  on release the engine resumes where it stopped.

Read by `fleet.enginesim.server`. Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPlan:
    fail_at_start: bool = False
    crash_after_requests: int | None = None
    slowdown: float = 1.0
    stall: bool = False

    def __post_init__(self) -> None:
        if self.crash_after_requests is not None and self.crash_after_requests < 1:
            raise ValueError(f"crash_after_requests must be >= 1, got {self.crash_after_requests}")
        if self.slowdown <= 0:
            raise ValueError(f"slowdown must be > 0, got {self.slowdown}")

    def describe(self) -> str:
        """A short line for start-up output; empty when there is no fault."""
        parts = []
        if self.fail_at_start:
            parts.append("fails at start")
        if self.crash_after_requests is not None:
            parts.append(f"crashes after {self.crash_after_requests} request(s)")
        if self.slowdown != 1.0:
            parts.append(f"slowdown x{self.slowdown:g}")
        if self.stall:
            parts.append("stalled")
        return ", ".join(parts)
