"""Simulated replicas of the trace simulator: lifecycle, engine, router endpoint, scrapes, nodes.

Owns `VirtualReplica` (one replica in virtual time: its `fleet.enginesim.model.EngineModel`, its
`router.pools.endpoint.EndpointState` as the router sees it, the ids of the requests dispatched
to it, the engine's cumulative `vllm:request_queue_time_seconds` histogram, and the facts of its
life: placed, READY, drain asked, asleep, woken, stopped) and `NodePool` (where replicas start,
and whether warm). Its status is derived from those facts, in the precedence the controller's
record uses (`fleet.controller.lifecycle.Replica.status`): STARTING, READY, DRAINING, STANDBY,
TERMINATED; the states before STARTING pass in no time here. Used by `fleet.tracesim.engine`
and `fleet.tracesim.rollout`, which record the facts; nothing here schedules events. (The
HTTP engine simulator's replica is `fleet.enginesim.server.SimReplica`, a process-level
server, not this.)

Start-up model (docs/autoscaling.md, "Running a policy in virtual time"): a replica asked for at t is
placed at t on a free node slot and becomes READY at t + the warm or the cold start-up time;
warm when the node already holds the engine image and the weights. ``NodePool(warm)``: node
slots of one replica each, the first ``warm`` of them warm; a replica takes the free warm slot
with the lowest index when there is one, else a cold slot (a new one when all are in use: the
cluster has room, its extra nodes just lack the image and weights). A cold slot turns warm once
a replica on it became READY (image and weights stay on the node; node eviction and cluster
scale-down are not modelled).
"""

from __future__ import annotations

import bisect

from autoscaler.engine_metrics import EngineSample
from autoscaler.histograms import CumulativeHistogram
from fleet.controller.lifecycle import ReplicaStatus
from fleet.enginesim.metrics import REQUEST_LATENCY_BUCKETS
from fleet.enginesim.model import EngineModel, FinishedRequest, StepResult
from router.pools.endpoint import EndpointState
from router.signals.engine_load import EngineLoad

QUEUE_TIME_BOUNDS: tuple[float, ...] = (*REQUEST_LATENCY_BUCKETS, float("inf"))
"""Bucket bounds (seconds) of `vllm:request_queue_time_seconds` (vLLM 0.32,
vllm/v1/metrics/buckets.py, as `fleet.enginesim.metrics` exports them)."""


class VirtualReplica:
    """One simulated replica. Plan: ``created_s``: placed (its cost starts); ``ready_at_s``:
    when it is due READY (placement or wake-up plus the modelled time); ``warm``: started on a
    warm node; ``node``: its slot in the `NodePool`; ``for_standby``: started only to refill the
    standby pool (sleeps once READY, never serving first).

    Facts, recorded by the simulator through the ``record_*`` methods (virtual seconds; None:
    not happened): ``ready_s``: became READY since it was placed or last woken; ``drain_s``:
    drain asked since then (going to sleep clears both); ``woke_s``: wake-up asked (latest); ``stopped_s``:
    stopped (cost ends); ``standby_spans``: [asleep from, to or None]. `status` derives from
    them (module docstring).

    The engine is stepped by the simulator (`fleet.tracesim.events.EngineStepper`): ``busy``
    while a step runs, ``wake_at_s`` when a wake-up for requests still in the engine's
    admission is scheduled. ``in_flight_ids``: the requests dispatched here and not finished
    (what a drain timeout aborts). The queue-time histogram is observed when a request
    finishes, as vLLM (and the HTTP simulator, `fleet.enginesim.metrics`) observe it.
    """

    __slots__ = ("_qt_count", "_qt_counts", "_qt_sum", "busy", "created_s", "drain_s", "endpoint", "endpoints",
                 "engine", "for_standby", "id", "in_flight_ids", "index", "node", "ready_at_s", "ready_s",
                 "standby_spans", "stopped_s", "wake_at_s", "warm", "woke_s")  # fmt: skip

    def __init__(self, replica_id: str, index: int, engine: EngineModel, created_s: float, ready_at_s: float,
                 warm: bool, node: int, routers: int = 1) -> None:  # fmt: skip
        self.id = replica_id
        self.index = index
        self.engine = engine
        # One endpoint state per router in front of the pool: each router sees only its own
        # requests in flight, as independent router processes do.
        self.endpoints = [EndpointState(replica_id, f"sim://{replica_id}") for _ in range(routers)]
        self.endpoint = self.endpoints[0]
        self.created_s = created_s
        self.ready_at_s = ready_at_s
        self.ready_s: float | None = None
        self.drain_s: float | None = None
        self.woke_s: float | None = None
        self.stopped_s: float | None = None
        self.standby_spans: list[list[float | None]] = []
        self.warm = warm
        self.node = node
        self.busy = False
        self.wake_at_s: float | None = None
        self.in_flight_ids: set[str] = set()
        self.for_standby = False
        self._qt_counts = [0] * len(QUEUE_TIME_BOUNDS)
        self._qt_sum = 0.0
        self._qt_count = 0

    # ----- facts and the status derived from them --------------------------------------------

    @property
    def status(self) -> ReplicaStatus:
        """Derived from the recorded facts, latest stage first: stopped, asleep, drain asked,
        READY, else STARTING (placed, or woken and not READY again yet)."""
        if self.stopped_s is not None:
            return ReplicaStatus.TERMINATED
        if self.standby_spans and self.standby_spans[-1][1] is None:
            return ReplicaStatus.STANDBY
        if self.drain_s is not None:
            return ReplicaStatus.DRAINING
        if self.ready_s is not None:
            return ReplicaStatus.READY
        return ReplicaStatus.STARTING

    @property
    def woken(self) -> bool:
        """STARTING because it was woken from STANDBY (READY at ``ready_at_s``, its wake-up time)."""
        return self.woke_s is not None and self.status is ReplicaStatus.STARTING

    def record_ready(self, now_s: float) -> None:
        """It passed its start-up (or wake-up) and serves."""
        self.ready_s = now_s

    def record_drain(self, now_s: float) -> None:
        """It was asked to drain: no new requests, in-flight ones finish."""
        self.drain_s = now_s

    def record_sleep(self, now_s: float) -> None:
        """It went to sleep (loaded; requests in flight finish): STANDBY, holding its node slot,
        until woken. It serves again only once READY after a wake-up; a refill's purpose is met."""
        self.standby_spans.append([now_s, None])
        self.ready_s = self.drain_s = None
        self.for_standby = False

    def record_wake(self, now_s: float) -> None:
        """It was asked to wake (a STANDBY replica): STARTING until READY again."""
        self.standby_spans[-1][1] = now_s
        self.woke_s = now_s

    def record_stop(self, now_s: float) -> None:
        """It stopped (from any state): TERMINATED, its cost ends."""
        if self.standby_spans and self.standby_spans[-1][1] is None:
            self.standby_spans[-1][1] = now_s
        self.stopped_s = now_s

    # ----- the engine ------------------------------------------------------------------------

    def step(self, now_s: float) -> StepResult | float | None:
        """Start the engine's next step at ``now_s`` if it has work (as `run_virtual` steps it).

        Returns the `StepResult` of a step that now runs (``busy`` until its ``end_s``); or the
        time a wake-up is newly due (nothing could be scheduled before it: ``wake_at_s`` is set;
        the caller schedules the wake-up); or None (no work, or an earlier wake-up is due)."""
        engine = self.engine
        if not engine.has_work():
            return None
        result = engine.step(now_s)
        if not result.scheduled and not result.preempted:
            ready_s = engine.retry_at_s(now_s)
            if self.wake_at_s is None or ready_s < self.wake_at_s:
                self.wake_at_s = ready_s
                return ready_s
            return None
        self.busy = True
        return result

    @property
    def startup_s(self) -> float:
        """Modelled seconds from placement to READY."""
        return self.ready_at_s - self.created_s

    def observe_finished(self, fr: FinishedRequest) -> None:
        """Count ``fr``'s engine queue time (seconds) in the cumulative histogram."""
        q = fr.queue_s
        self._qt_counts[bisect.bisect_left(QUEUE_TIME_BOUNDS, q)] += 1
        self._qt_sum += q
        self._qt_count += 1

    def sample(self) -> EngineSample:
        """A scrape of this replica's `/metrics`: the gauges now and the queue-time histogram
        (cumulative since start), as `autoscaler.engine_metrics.parse_engine_metrics` returns."""
        cumulative, total = [], 0
        for c in self._qt_counts:
            total += c
            cumulative.append(float(total))
        engine = self.engine
        return EngineSample(
            waiting=float(engine.num_waiting), running=float(engine.num_running),
            kv_cache_usage=engine.pool.usage(),
            queue_time=CumulativeHistogram(QUEUE_TIME_BOUNDS, tuple(cumulative), self._qt_sum, float(self._qt_count)),
        )  # fmt: skip

    def load_sample(self, with_prefill: bool = False) -> EngineLoad:
        """The engine's load as a router polling `/metrics` reads it (`router.signals.engine_load`);
        ``with_prefill`` adds the queued prefill tokens and requests (vLLM does not export them)."""
        engine = self.engine
        tokens = requests = None
        if with_prefill:
            tokens, requests = engine.prefill_queue()
        return EngineLoad(waiting=float(engine.num_waiting), running=float(engine.num_running),
                          kv_cache_usage=engine.pool.usage(), prefill_tokens=tokens, prefilling=requests)  # fmt: skip

    def cost_s(self, until_s: float) -> float:
        """Replica-seconds this replica cost within ``[0, until_s]``: from placement until it
        stopped (or ``until_s``)."""
        end_s = until_s if self.stopped_s is None else min(self.stopped_s, until_s)
        return max(0.0, end_s - self.created_s)

    def standby_s(self, until_s: float) -> float:
        """Seconds this replica spent asleep (STANDBY) within ``[0, until_s]``."""
        total = 0.0
        for start_s, end_s in self.standby_spans:
            total += max(0.0, min(until_s if end_s is None else end_s, until_s) - start_s)  # type: ignore[operator]
        return total

    def __repr__(self) -> str:
        return f"VirtualReplica({self.id}, {self.status.value}, in_flight={self.endpoint.in_flight})"


class NodePool:
    """Node slots of one replica each; the first ``warm`` start warm (module docstring).

    Raises ValueError for ``warm < 0``."""

    def __init__(self, warm: int) -> None:
        if warm < 0:
            raise ValueError(f"warm node slots must be >= 0, got {warm}")
        self.warm = [True] * warm
        self.used = [False] * warm

    def next_is_warm(self) -> bool:
        """Whether a replica asked for now would start warm."""
        return any(w and not u for w, u in zip(self.warm, self.used))

    def take(self) -> tuple[int, bool]:
        """(slot, warm) for a new replica: a free warm slot first, else a free or new cold one."""
        free = [i for i, u in enumerate(self.used) if not u]
        slot = next((i for i in free if self.warm[i]), free[0] if free else None)
        if slot is None:
            slot = len(self.used)
            self.warm.append(False)
            self.used.append(False)
        self.used[slot] = True
        return slot, self.warm[slot]

    def became_ready(self, slot: int) -> None:
        """A replica on ``slot`` became READY: the node now holds image and weights."""
        self.warm[slot] = True

    def release(self, slot: int) -> None:
        self.used[slot] = False
