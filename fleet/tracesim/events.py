"""The trace simulators' one event loop: a virtual clock, a heap of timed events, and the engine
stepping every request-level simulator shares.

Owns `EventLoop` (events pushed at a virtual time with a kind and a payload, run in time order
by the handler registered for their kind, merged with a sorted list of request arrivals) and
`EngineStepper` (the STEP_END and WAKE handlers that step each replica's
`fleet.enginesim.model.EngineModel` as `run_virtual` steps it). Used by `fleet.tracesim.engine`
(autoscaling), `fleet.tracesim.rollout` (canary rollouts) and `fleet.tracesim.preemption`
(priorities on a GPU inventory). No I/O, no clock: every time is a virtual second.

Events at the same virtual instant run in the order of their kinds (lowest first), then in the
order they were pushed; a request arriving at the instant of an event runs after it. The kinds
every simulator shares are `STEP_END`, `WAKE` and `READY`; a simulator numbers its own kinds
from `FIRST_OWN_KIND` up.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from typing import Any

from fleet.controller.lifecycle import ReplicaStatus
from fleet.enginesim.model import StepResult
from fleet.tracesim.replica import VirtualReplica

STEP_END, WAKE, READY = range(3)
"""An engine step ended (payload: (replica, `StepResult`)); a replica's engine is due a wake-up
for requests still in its admission (payload: the replica); a replica is due READY (payload:
the replica; the simulator's own handler)."""

FIRST_OWN_KIND = 3
"""The lowest kind number a simulator gives its own events."""

Handler = Callable[[Any, float], None]
"""``handler(payload, now_s)``: one event at virtual second ``now_s``."""


class EventLoop:
    """Timed events in virtual time, each run by the handler registered for its kind.

    ``now_s``: the virtual second of the event or arrival running (or last run)."""

    __slots__ = ("_handlers", "_heap", "_seq", "now_s")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._handlers: dict[int, Handler] = {}
        self.now_s = 0.0

    def on(self, kind: int, handler: Handler) -> None:
        """Run ``handler(payload, now_s)`` for every event of ``kind``."""
        self._handlers[kind] = handler

    def push(self, at_s: float, kind: int, payload: object = None) -> None:
        """Schedule an event of ``kind`` at virtual second ``at_s``."""
        self._seq += 1
        heapq.heappush(self._heap, (at_s, kind, self._seq, payload))

    def run(self, done: Callable[[], bool], *, arrivals: Sequence[float] = (),
            on_arrival: Callable[[int, float], None] | None = None, horizon_s: float = math.inf,
            after_each: Callable[[float], None] | None = None) -> float:  # fmt: skip
        """Run events and arrivals in time order until ``done()`` is true, nothing is left to
        happen, or the next one falls after ``horizon_s`` (virtual seconds; it is left unrun).

        ``arrivals``: sorted arrival times (seconds); ``on_arrival(i, at_s)`` runs for the i-th.
        ``after_each(now_s)`` runs after every event and arrival. Returns the virtual second
        of the last one run. Raises KeyError for an event of a kind with no handler."""
        heap, handlers = self._heap, self._handlers
        n, i = len(arrivals), 0
        while not done():
            next_arrival_s = arrivals[i] if i < n else math.inf
            if heap and heap[0][0] <= next_arrival_s:
                if heap[0][0] > horizon_s:
                    break
                at_s, kind, _, payload = heapq.heappop(heap)
                self.now_s = at_s
                handlers[kind](payload, at_s)
            elif i < n:
                if next_arrival_s > horizon_s:
                    break
                self.now_s = next_arrival_s
                on_arrival(i, next_arrival_s)  # type: ignore[misc]
                i += 1
            else:
                break   # nothing left to happen
            if after_each is not None:
                after_each(self.now_s)
        return self.now_s


StepHook = Callable[[VirtualReplica, StepResult, float], bool]
"""``on_step(replica, result, now_s)``: what the simulator does with a step that ended (tokens,
finished requests); returns whether the replica's engine should be stepped again."""


class EngineStepper:
    """Steps each replica's engine model on ``loop``: a step runs from its start to its
    ``end_s`` (the replica is busy meanwhile), then ``on_step`` sees its result and the next
    step starts if the engine has work; an engine whose waiting requests cannot be admitted yet
    is woken when they can (`VirtualReplica.step`). A TERMINATED replica is never stepped
    again. ``steps``: engine steps run."""

    __slots__ = ("loop", "on_step", "steps")

    def __init__(self, loop: EventLoop, on_step: StepHook) -> None:
        self.loop = loop
        self.on_step = on_step
        self.steps = 0
        loop.on(STEP_END, self._on_step_end)
        loop.on(WAKE, self._on_wake)

    def poke(self, replica: VirtualReplica, now_s: float) -> None:
        """Start ``replica``'s next step at ``now_s`` unless one is running (new work arrived)."""
        if not replica.busy:
            self.step(replica, now_s)

    def step(self, replica: VirtualReplica, now_s: float) -> None:
        """Start the replica's next engine step at ``now_s`` if it has work."""
        result = replica.step(now_s)
        if isinstance(result, StepResult):
            self.steps += 1
            self.loop.push(result.end_s, STEP_END, (replica, result))
        elif result is not None:
            self.loop.push(result, WAKE, replica)

    def _on_wake(self, replica: VirtualReplica, now_s: float) -> None:
        if replica.wake_at_s != now_s:
            return  # superseded by an earlier wake-up
        replica.wake_at_s = None
        if not replica.busy and replica.status is not ReplicaStatus.TERMINATED:
            self.step(replica, now_s)

    def _on_step_end(self, payload: tuple[VirtualReplica, StepResult], now_s: float) -> None:
        replica, result = payload
        replica.busy = False
        if replica.status is ReplicaStatus.TERMINATED:
            return  # stopped while this step ran; its requests were dealt with then
        if self.on_step(replica, result, now_s) and not replica.busy:
            self.step(replica, now_s)
