"""Replica lifecycle: the facts recorded about a replica and the status derived from them.

Owns `ReplicaStatus` (PENDING … READY, STANDBY, DRAINING, TERMINATED, FAILED_*) and `Replica`, the
record the controller keeps per replica. The controller records facts as they happen (placed,
asked to run, image and weights present, healthy, warm-up passed, drain asked, exited); `Replica.status` derives the status
from them, so status can never disagree with what happened (SkyServe's
``ReplicaStatusProperty.to_replica_status`` is the model).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class ReplicaStatus(enum.Enum):
    PENDING = "PENDING"          # wanted, not yet placed
    PLACED = "PLACED"            # devices assigned, the backend not yet asked to run it
    PULLING = "PULLING"          # asked to run; engine image being made present on the node
    CACHING = "CACHING"          # image present; weights being made present on the node
    STARTING = "STARTING"        # image and weights present, engine starting, /health not yet passing
    WARMING = "WARMING"          # /health passes, warm-up requests running
    READY = "READY"              # in the router's pool
    STANDBY = "STANDBY"          # out of the pool, asleep (vLLM sleep mode level 1): holds its devices, wakes in seconds
    DRAINING = "DRAINING"        # out of the pool, in-flight requests finishing, then stopped
    TERMINATED = "TERMINATED"    # stopped on purpose
    FAILED_PLACEMENT = "FAILED_PLACEMENT"
    FAILED_START = "FAILED_START"        # engine exited or timed out before /health passed
    FAILED_WARMUP = "FAILED_WARMUP"      # a warm-up request failed
    FAILED_CRASHED = "FAILED_CRASHED"    # engine exited after it had started
    FAILED_UNHEALTHY = "FAILED_UNHEALTHY"  # /health kept failing after the replica was ready

    def failed(self) -> bool:
        return self.name.startswith("FAILED_")

    def terminal(self) -> bool:
        """No further transition: the replica's process is gone for good."""
        return self is ReplicaStatus.TERMINATED or self.failed()

    def serving(self) -> bool:
        """Receives new requests from the router."""
        return self is ReplicaStatus.READY

    def standby(self) -> bool:
        """Asleep out of the pool: holds its devices (GPU-hours count it) but serves nothing."""
        return self is ReplicaStatus.STANDBY

    def counts_toward_desired(self) -> bool:
        """Occupies one of the deployment's desired (serving) replica slots."""
        return not self.terminal() and self not in (ReplicaStatus.DRAINING, ReplicaStatus.STANDBY)


@dataclass
class Failure:
    status: ReplicaStatus
    reason: str
    at_s: float
    log_tail: list[str] = field(default_factory=list)


@dataclass
class Replica:
    """What happened to one replica, in controller clock seconds. Status is derived, never set."""

    id: str
    deployment: str
    revision: str
    created_at_s: float
    spec_hash: str = ""                    # what it serves (`fleet.spec.LoadedDeployment.serving_hash`); adoption checks it
    # Facts, in the order they usually happen.
    placed_at_s: float | None = None
    assignment: str | None = None          # human-readable devices, e.g. "cpu:0" or "gpu:GPU-1a2b..."
    placement: dict | None = None          # `ReplicaPlacement.to_dict()`: the devices it holds
    image_ready_at_s: float | None = None
    weights_ready_at_s: float | None = None
    launched_at_s: float | None = None     # the backend was asked to run it
    node: str | None = None
    endpoint: str | None = None            # http://host:port of its engine, from the backend
    kv_events: dict | None = None          # its KV event addresses (`ReplicaFacts.kv_events`), from the backend
    detail: dict[str, str] = field(default_factory=dict)   # backend specifics for people (pid, port, log)
    unschedulable: str | None = None       # the scheduler's words while it cannot place it (ReplicaFacts)
    adopted_at_s: float | None = None      # a restarted controller found it running and kept it
    healthy_at_s: float | None = None
    warmup_started_at_s: float | None = None
    warmup_passed_at_s: float | None = None
    standby_refill: bool = False           # created to refill the standby pool: sleeps once warm, never serves first
    slept_at_s: float | None = None        # left the pool to sleep: STANDBY from then on
    sleep_sent_at_s: float | None = None   # the engine answered POST /sleep (after the router's in-flight drained)
    woke_at_s: float | None = None         # asked to wake after its latest sleep; READY again once warm-up passes after it
    drain_requested_at_s: float | None = None
    drain_reason: str | None = None        # why, when it is not a scale-down (e.g. its GPU was quarantined)
    preempted_for: str | None = None       # the deployment it was drained for (`fleet.controller.preemption`)
    stop_requested_at_s: float | None = None
    kill_sent_at_s: float | None = None
    exited_at_s: float | None = None
    exit_code: int | None = None
    consecutive_health_failures: int = 0
    failure: Failure | None = None

    @property
    def status(self) -> ReplicaStatus:
        if self.failure is not None:
            return self.failure.status
        if self.exited_at_s is not None:
            return ReplicaStatus.TERMINATED
        if self.drain_requested_at_s is not None:
            return ReplicaStatus.DRAINING
        if self.asleep:
            return ReplicaStatus.STANDBY
        if self.woke_at_s is not None:        # woken: serves again only after a fresh warm-up pass
            if self.warmup_passed_at_s is not None and self.warmup_passed_at_s >= self.woke_at_s:
                return ReplicaStatus.READY
            return ReplicaStatus.WARMING
        if self.warmup_passed_at_s is not None:
            return ReplicaStatus.READY
        if self.healthy_at_s is not None:
            return ReplicaStatus.WARMING
        if self.placed_at_s is None:
            return ReplicaStatus.PENDING
        if self.launched_at_s is None:
            return ReplicaStatus.PLACED
        if self.image_ready_at_s is None:
            return ReplicaStatus.PULLING
        if self.weights_ready_at_s is None:
            return ReplicaStatus.CACHING
        return ReplicaStatus.STARTING

    @property
    def engine_alive(self) -> bool:
        """The backend was asked to run it and it has not been seen to exit."""
        return self.launched_at_s is not None and self.exited_at_s is None

    @property
    def asleep(self) -> bool:
        """Asked to sleep and not asked to wake since."""
        return self.slept_at_s is not None and (self.woke_at_s is None or self.woke_at_s < self.slept_at_s)

    def record_sleep(self, now_s: float) -> None:
        """It left the pool and was asked to sleep (a READY replica only).

        Raises:
            ValueError: it is not READY.
        """
        if self.status is not ReplicaStatus.READY:
            raise ValueError(f"replica {self.id} is {self.status.value}: only a READY replica can go to standby")
        self.slept_at_s, self.sleep_sent_at_s, self.standby_refill = now_s, None, False

    def record_wake(self, now_s: float) -> None:
        """It was asked to wake (a STANDBY replica only): WARMING until a warm-up passes after `now_s`.

        Raises:
            ValueError: it is not STANDBY.
        """
        if self.status is not ReplicaStatus.STANDBY:
            raise ValueError(f"replica {self.id} is {self.status.value}: only a STANDBY replica can be woken")
        self.woke_at_s = now_s

    def wake_to_ready_s(self) -> float | None:
        """Seconds from the latest wake to the READY after it; None if never woken or not READY since."""
        if self.woke_at_s is None or self.warmup_passed_at_s is None or self.warmup_passed_at_s < self.woke_at_s:
            return None
        return self.warmup_passed_at_s - self.woke_at_s

    def time_to_ready_s(self) -> float | None:
        """Seconds from creation to its first READY, or None if it never got there or if that
        READY was overwritten by one after a wake (`ready_after`)."""
        if self.warmup_passed_at_s is None or self.woke_at_s is not None:
            return None
        return self.warmup_passed_at_s - self.created_at_s

    def ready_after(self) -> tuple[str, float] | None:
        """(the event, seconds from it to READY) of its latest READY: ``("wake", s)`` for a
        replica woken from STANDBY (`wake_to_ready_s`: the wake is what a person waits on, not
        the creation hours before), else ``("creation", s)`` (`time_to_ready_s`); None when it
        has not been READY since that event."""
        if self.woke_at_s is not None:
            wake_s = self.wake_to_ready_s()
            return None if wake_s is None else ("wake", wake_s)
        ttr = self.time_to_ready_s()
        return None if ttr is None else ("creation", ttr)

    def fail(self, status: ReplicaStatus, reason: str, now_s: float, log_tail: list[str] | None = None) -> None:
        """Record a failure (the first one wins: later symptoms of the same fault are ignored)."""
        if not status.failed():
            raise ValueError(f"{status} is not a failure status")
        if self.failure is None:
            self.failure = Failure(status, reason, now_s, list(log_tail or []))

    def to_dict(self) -> dict:
        """JSON-ready snapshot, for the state file and `fleet status`."""
        d = {k: v for k, v in self.__dict__.items() if k != "failure"}
        d["status"] = self.status.value
        d["failure"] = (
            None if self.failure is None else {
                "status": self.failure.status.value, "reason": self.failure.reason,
                "at_s": self.failure.at_s, "log_tail": self.failure.log_tail,
            }
        )
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Replica:
        """The record `to_dict` wrote (read back by a restarted controller). Raises KeyError or
        TypeError on a record that is not one."""
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and k != "failure"}
        r = cls(**fields)
        f = d.get("failure")
        if f:
            r.failure = Failure(ReplicaStatus(f["status"]), f["reason"], f["at_s"], list(f.get("log_tail") or []))
        return r
