"""Standby replicas: kept placed, loaded and asleep (vLLM sleep mode level 1), woken on a scale-up.

Owns `StandbyKeeper`, a collaborator of `fleet.controller.reconcile.Controller` over its
`fleet.controller.targets.FleetRecords`. A deployment keeps up to ``spec.standby.maxReplicas``
(`DeploymentSpec.standby_max`: 0 when unset or when its engine cannot sleep) of its current
revision's replicas in STANDBY (`fleet.controller.lifecycle.ReplicaStatus.STANDBY`):

- `shape` (called by the controller's scale step for each revision's `scale_step`): a scale-up
  wakes STANDBY replicas before it creates new ones (`Replica.record_wake`: WARMING, back in the
  pool after the warm-up gate passes again); a scale-down puts READY victims to STANDBY
  (`Replica.record_sleep`) instead of draining them while the standby pool is short.
- `refill_and_trim` (the scale step too): creates replicas marked ``standby_refill`` while the
  pool is short (they sleep once warm, never serving first) and drains STANDBY replicas beyond
  the target or of a revision no longer served.
- `act` (its own step of the tick, before the pools are published): a warm refill goes to
  STANDBY; a STANDBY replica still awake gets ``POST /sleep?level=1`` once the router reports no
  request in flight on it (or the drain timeout passed: vLLM aborts what is left); a woken one
  gets ``POST /wake_up`` in a task (answered once the weights are back), then its warm-up runs
  (`fleet.controller.health.HealthKeeper.start_warmup`); a failed call fails the replica with the engine's reason.

The decisions themselves are pure functions over any replica with a status (`standby_target`,
`shape_step`, `trim_and_refill`): the keeper applies them to the controller's records and the
trace simulator (`fleet.tracesim.engine`) to its virtual replicas, so both run one standby
lifecycle.

Everything it decides is a fact on the replica record (``slept_at_s``, ``sleep_sent_at_s``,
``woke_at_s``), so a restarted controller carries on: a ``/sleep`` or ``/wake_up`` sent twice is
a no-op in vLLM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TypeVar

from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.pools import PoolSink
from fleet.controller.scale import HasStatus, ScaleStep
from fleet.controller.targets import DeploymentRecord, FleetRecords
from warmup.client import EngineAPI, EngineRequestError

log = logging.getLogger("fleet.controller")

R = TypeVar("R", bound=HasStatus)

SLEEP_TIMEOUT_S = 60.0
"""Longest wait for ``POST /sleep`` (vLLM copies the weights to CPU memory before it answers)."""

WAKE_TIMEOUT_S = 120.0
"""Longest wait for ``POST /wake_up``: llm-d measured ~3 s for 64 GiB (`fleet.enginesim.sleep`);
a wake that takes 40 times that has gone wrong."""


def standby_target(most: int, wanted: int | None) -> int:
    """Standby replicas a deployment keeps: ``most`` (``spec.standby.maxReplicas``; 0: off), or
    fewer when its scaling policy asked for fewer (``wanted``, `ScalingDecision.standby`; None:
    ``most``), clamped to ``[0, most]``."""
    return most if wanted is None else max(0, min(most, wanted))


def shape_step(step: ScaleStep[R], asleep: Sequence[R],
               target: int) -> tuple[ScaleStep[R], list[R], list[R]]:  # fmt: skip
    """The scale step ``step`` with the standby pool applied: a scale-up wakes sleepers before it
    creates (the oldest of ``asleep`` first: STANDBY replicas in creation order); a scale-down puts
    READY victims to sleep instead of draining them while fewer than ``target`` are asleep (a
    victim still starting drains: only a loaded, warmed replica sleeps).

    Returns (what is left to create and drain, the sleepers to wake, the victims to put to sleep)."""
    create, drain = step.create, list(step.drain)
    wake = list(asleep[:create])
    create -= len(wake)
    room = target - (len(asleep) - len(wake))   # a refill not yet warm gives way (`trim_and_refill`)
    sleep: list[R] = []
    if room > 0 and drain:
        keep = []
        for r in drain:
            if room > 0 and r.status is ReplicaStatus.READY:
                sleep.append(r)
                room -= 1
            else:
                keep.append(r)
        drain = keep
    return ScaleStep(create=create, drain=drain), wake, sleep


def trim_and_refill(asleep: Sequence[R], refills: Sequence[R], target: int) -> tuple[list[R], int]:
    """The pool sized to ``target``: ``asleep`` (STANDBY, creation order) beyond it drain, the
    newest first; then refills (``refills``: replicas created to refill the pool and not asleep
    yet, creation order) beyond what is still short drain, the newest first (a sleeping replica
    came first). Returns (replicas to drain, refills to create)."""
    drain = list(asleep[target:])[::-1]
    surplus = len(asleep) + len(refills) - target
    drain += list(refills)[::-1][: max(0, surplus)]
    return drain, max(0, -surplus)


class StandbyKeeper:
    """Keeps each deployment's standby replicas (see the module docstring)."""

    def __init__(self, records: FleetRecords, *, engine_api: EngineAPI, pool_sink: PoolSink,
                 clock: Callable[[], float], drain_timeout_s: float, save: Callable[[], None],
                 start_warmup: Callable[[Replica], None], fail: Callable[[Replica, ReplicaStatus, str], None],
                 wake: Callable[[], None]) -> None:  # fmt: skip
        self.records = records
        self.engine_api = engine_api
        self.pool_sink = pool_sink
        self.clock = clock
        self.drain_timeout_s = drain_timeout_s
        self._save = save
        self._start_warmup = start_warmup
        self._fail = fail
        self._wake_loop = wake
        self._wakes: dict[str, asyncio.Task[None]] = {}

    # ----- the scale step ---------------------------------------------------------------------

    def target(self, ds: DeploymentRecord) -> int:
        """Standby replicas ``ds`` keeps: its stable revision's `standby_max` (0: off), or fewer
        when the autoscaler's policy asked for fewer (``ds.standby_wanted``, clamped to
        ``[0, standby_max]``)."""
        ld = ds.revs.specs.get(ds.revs.stable, ds.loaded)
        return standby_target(ld.deployment.spec.standby_max, ds.standby_wanted)

    def standby_of(self, ds: DeploymentRecord, spec_hash: str) -> list[Replica]:
        """STANDBY replicas of one revision, the oldest first."""
        return [r for r in self.records.of_deployment(ds.loaded.deployment.name)
                if r.spec_hash == spec_hash and r.status.standby() and r.engine_alive]  # fmt: skip

    def refills_of(self, ds: DeploymentRecord, spec_hash: str) -> list[Replica]:
        """Replicas of one revision created to refill the pool and not yet asleep."""
        return [r for r in self.records.of_deployment(ds.loaded.deployment.name)
                if r.spec_hash == spec_hash and r.standby_refill and not r.status.terminal()
                and r.status is not ReplicaStatus.DRAINING]  # fmt: skip

    def shape(self, ds: DeploymentRecord, spec_hash: str, step: ScaleStep[Replica], now: float) -> ScaleStep[Replica]:
        """``step`` with standby applied: wakes before creates, sleeps before drains. Returns what
        is left for the controller to create and drain."""
        left, wake, sleep = shape_step(step, self.standby_of(ds, spec_hash), self.target(ds))
        for r in wake:
            r.record_wake(now)
            log.info("replica %s wakes from standby", r.id)
        for r in sleep:
            r.record_sleep(now)
            log.info("replica %s goes to standby", r.id)
        return left

    def refill_and_trim(self, ds: DeploymentRecord, targets: set[str], current: str, now: float) -> int:
        """Standby replicas of revisions no longer served, and beyond the target, drain (the
        newest first), and refills no longer needed; returns how many refills of ``current`` (the
        revision standby is kept of) to create."""
        want = self.target(ds)
        for r in self.records.of_deployment(ds.loaded.deployment.name):
            gone = r.spec_hash not in targets or r.spec_hash != current or want == 0
            if gone and (r.status.standby() or (r.standby_refill and r.status.counts_toward_desired())):
                r.drain_requested_at_s = now
        if want == 0 or current not in targets:
            return 0
        drain, create = trim_and_refill(self.standby_of(ds, current), self.refills_of(ds, current), want)
        for r in drain:
            r.drain_requested_at_s = now
        return create

    def describe(self, ds: DeploymentRecord) -> dict[str, object]:
        """For the state file and `fleet status`: ``target`` (standby replicas kept), ``asleep``
        (STANDBY now), ``unsupported`` (why ``spec.standby`` is off here, or None)."""
        spec = ds.revs.specs.get(ds.revs.stable, ds.loaded).deployment.spec
        return {"target": self.target(ds), "asleep": len(self.standby_of(ds, ds.revs.stable)),
                "unsupported": spec.standby_unsupported() if spec.standby is not None else None}  # fmt: skip

    # ----- its own step -----------------------------------------------------------------------

    async def act(self) -> None:
        now = self.clock()
        replicas = list(self.records.replicas.values())
        for r in replicas:   # a warm refill sleeps before the pool ever sees it
            if r.standby_refill and r.status is ReplicaStatus.READY:
                r.record_sleep(now)
        awake = [r for r in replicas if r.status.standby() and r.sleep_sent_at_s is None and r.engine_alive
                 and r.endpoint is not None and r.stop_requested_at_s is None]  # fmt: skip
        if awake:
            in_flight: dict[str, int] = {}
            try:
                in_flight = await self.pool_sink.in_flight()
            except Exception as err:  # noqa: BLE001 - router unreachable: wait for the drain timeout
                log.warning("cannot read in-flight requests from the router: %s", err)
                in_flight = {r.id: 1 for r in awake}
            for r in awake:
                if in_flight.get(r.id, 0) and now - r.slept_at_s < self.drain_timeout_s:
                    continue
                await self._sleep(r)
        for r in replicas:
            if (r.status is ReplicaStatus.WARMING and r.woke_at_s is not None and r.id not in self._wakes
                    and (r.warmup_started_at_s is None or r.warmup_started_at_s < r.woke_at_s)):
                self._wakes[r.id] = task = asyncio.get_running_loop().create_task(
                    self.engine_api.wake_up(r.endpoint, WAKE_TIMEOUT_S), name=f"wake-{r.id}")
                task.add_done_callback(lambda _: self._wake_loop())
        for rid, task in list(self._wakes.items()):
            if not task.done():
                continue
            del self._wakes[rid]
            r = self.records.replicas.get(rid)
            if task.cancelled() or r is None or r.status is not ReplicaStatus.WARMING:
                continue
            exc = task.exception()
            if exc is not None:
                self._fail(r, ReplicaStatus.FAILED_WARMUP, f"POST /wake_up failed: {exc}")
            else:
                self._start_warmup(r)

    async def _sleep(self, r: Replica) -> None:
        try:
            await self.engine_api.sleep(r.endpoint, 1, SLEEP_TIMEOUT_S)
        except EngineRequestError as err:
            self._fail(r, ReplicaStatus.FAILED_UNHEALTHY, f"POST /sleep failed: {err}")
            return
        r.sleep_sent_at_s = self.clock()
        self._save()

    def cancel(self) -> None:
        """Cancel wake-up calls in flight (the controller is being dropped)."""
        for task in self._wakes.values():
            task.cancel()
        self._wakes.clear()
