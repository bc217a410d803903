"""Leader election through a coordination.k8s.io/v1 Lease, so that two operator pods can run
and at most one acts at any moment.

Owns `LeaderElector`: `try_acquire_or_renew` (create the Lease when there is none; renew it
while we hold it; take it over when its holder has not renewed it for ``lease_duration_s`` as
*we* measure time: the record is judged by when this process saw it change, not by the holder's
clock, as client-go's leaderelection does), `holds` (whether we may act: our last renewal is
younger than ``renew_deadline_s``, which is shorter than the lease, so a holder stops acting
before any standby can take over; client-go's RenewDeadline) and `release` (on an orderly stop:
clear the holder so a standby takes over at once). Every write carries the resourceVersion it
read: two candidates racing get one 409 and one win. Time comes from an injected clock.

`LeaseKeeper` runs the rounds every ``retry_period_s`` on a thread and event loop of their own,
so a reconcile tick, however long, cannot delay a renewal (the loop's thread gives the GIL up
every few milliseconds). `FencedKube` and `FencedPoolSink` refuse every write (`NotLeader`) once
`holds` is false: what a tick still does after the renew deadline never reaches the cluster or
the routers. Called by the operator (`fleet.k8s.operator`).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
from collections.abc import Callable

from fleet.k8s.client import LEASES, ApiError, Conflict, Kube, NotFound

log = logging.getLogger("fleet.k8s.lease")


def _micro_time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One candidate for the Lease ``namespace/name``."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *, clock: Callable[[], float],
                 wall: Callable[[], float], lease_duration_s: float = 15.0,
                 renew_deadline_s: float | None = None) -> None:  # fmt: skip
        """``clock``: monotonic seconds (expiry); ``wall``: Unix seconds (the Lease's times);
        ``renew_deadline_s``: how long after its last renewal a holder still acts (default
        two thirds of the lease, client-go's 10 s of 15). Raises ValueError unless
        0 < renew_deadline_s < lease_duration_s."""
        if renew_deadline_s is None:
            renew_deadline_s = lease_duration_s * 2 / 3
        if not 0 < renew_deadline_s < lease_duration_s:
            raise ValueError(f"the renew deadline ({renew_deadline_s:g} s) must be above 0 and below the lease "
                             f"duration ({lease_duration_s:g} s)")  # fmt: skip
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.clock = clock
        self.wall = wall
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.is_leader = False
        self._observed: tuple[str, str] | None = None   # (holder, renewTime) last seen
        self._observed_at_s = 0.0
        self.renewed_at_s: float | None = None          # clock() when our last successful write was sent
        self.transitions = 0
        self.renewals = 0
        self.longest_renewal_gap_s = 0.0                # between two renewals of one holding (a figure)

    def _spec(self, acquire: bool, transitions: int) -> dict:
        now = _micro_time(self.wall())
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": int(self.lease_duration_s),
                "renewTime": now, "leaseTransitions": transitions}  # fmt: skip
        if acquire:
            spec["acquireTime"] = now
        return spec

    async def try_acquire_or_renew(self) -> bool:
        """One round; returns whether this candidate holds the Lease now."""
        try:
            lease = await self.kube.get(LEASES, self.namespace, self.name)
        except NotFound:
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace}, "spec": self._spec(True, 0)}
            try:
                await self.kube.create(LEASES, self.namespace, body)
            except Conflict:
                return self._set(False)
            self._renewed(self.clock(), False)
            return self._set(True)
        except ApiError as err:
            log.warning("cannot read lease %s: %s", self.name, err)
            return self._keep()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = (holder, spec.get("renewTime") or "")
        now_s = self.clock()
        if record != self._observed:
            self._observed, self._observed_at_s = record, now_s
        duration_s = float(spec.get("leaseDurationSeconds") or self.lease_duration_s)
        expired = not holder or now_s >= self._observed_at_s + duration_s
        if holder != self.identity and not expired:
            return self._set(False)
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
        acquire = holder != self.identity
        new_spec = {**spec, **self._spec(acquire, transitions)}
        body = {**lease, "spec": new_spec}
        try:
            await self.kube.replace(LEASES, self.namespace, self.name, body)
        except Conflict as err:   # someone else wrote the Lease since we read it
            log.info("lease %s: %s", self.name, err)
            return self._set(False)
        except ApiError as err:   # the API server failed us: try again; we act until the renew deadline
            log.warning("cannot renew lease %s: %s", self.name, err)
            return self._keep()
        if acquire:
            self.transitions = transitions
        self._observed, self._observed_at_s = (self.identity, new_spec["renewTime"]), now_s
        self._renewed(now_s, not acquire)
        return self._set(True)

    def _renewed(self, now_s: float, held: bool) -> None:
        if held and self.is_leader and self.renewed_at_s is not None:
            self.longest_renewal_gap_s = max(self.longest_renewal_gap_s, now_s - self.renewed_at_s)
        self.renewed_at_s = now_s
        self.renewals += 1

    def _keep(self) -> bool:
        """A round that failed for a reason that says nothing about who holds the Lease."""
        return self._set(self.holds())

    def holds(self) -> bool:
        """Whether this candidate may act now: it holds the Lease and its last renewal (the time
        the write was sent) is less than ``renew_deadline_s`` old. A standby takes over only a
        whole lease duration after it last saw the record change, which is later: the two
        never act at once (as long as the two clocks run at the same rate)."""
        return self.is_leader and self.renewed_at_s is not None and \
            self.clock() < self.renewed_at_s + self.renew_deadline_s

    async def release(self) -> None:
        """Give the Lease up (orderly stop) so that a standby acquires it on its next round."""
        if not self.is_leader:
            return
        try:
            lease = await self.kube.get(LEASES, self.namespace, self.name)
            if (lease.get("spec") or {}).get("holderIdentity") == self.identity:
                lease["spec"]["holderIdentity"] = ""
                await self.kube.replace(LEASES, self.namespace, self.name, lease)
        except ApiError as err:
            log.warning("cannot release lease %s: %s", self.name, err)
        self.is_leader = False

    def _set(self, leader: bool) -> bool:
        if leader != self.is_leader:
            log.info("%s %s the lease %s", self.identity, "holds" if leader else "does not hold", self.name)
        self.is_leader = leader
        return leader


class LeaseKeeper:
    """`LeaderElector.try_acquire_or_renew` every ``retry_period_s`` on a thread with an event loop
    of its own (the reconcile loop's thread may be busy for seconds; this one is not).
    ``on_change``: called on this thread whenever `LeaderElector.is_leader` flips (the operator
    passes a thread-safe wake-up). `stop` ends the thread, releasing the Lease when asked."""

    def __init__(self, elector: LeaderElector, retry_period_s: float, on_change: Callable[[], None]) -> None:
        self.elector = elector
        self.retry_period_s = retry_period_s
        self.on_change = on_change
        self._stop = threading.Event()
        self._release = True
        self._thread = threading.Thread(target=self._run, name=f"lease-{elector.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, release: bool = True, timeout_s: float = 10.0) -> None:
        """Stop renewing (blocking: call it from a worker thread in async code); ``release``:
        give the Lease up so a standby takes over at once."""
        self._release = release
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            while not self._stop.is_set():
                was = self.elector.is_leader
                try:
                    loop.run_until_complete(self.elector.try_acquire_or_renew())
                except Exception:  # noqa: BLE001 - a failed round is retried; holds() bounds acting
                    log.exception("lease round failed")
                if self.elector.is_leader != was:
                    self.on_change()
                self._stop.wait(self.retry_period_s)
            if self._release:
                loop.run_until_complete(self.elector.release())
        finally:
            loop.close()


class NotLeader(ApiError):
    """A write refused before it was sent: this operator may no longer hold the Lease."""

    def __init__(self, what: str) -> None:
        super().__init__(0, "NotLeader", f"{what} not sent: the lease's renew deadline has passed")


class FencedKube:
    """A `fleet.k8s.client.Kube` whose writes (create, replace, patch, patch_status, delete) raise
    `NotLeader` unless ``holds()``; reads pass through."""

    def __init__(self, kube: Kube, holds: Callable[[], bool]) -> None:
        self._kube = kube
        self._holds = holds

    def __getattr__(self, name: str):
        return getattr(self._kube, name)

    def _check(self, what: str, res, name: str) -> None:
        if not self._holds():
            raise NotLeader(f"{what} {res.plural}/{name}")

    async def create(self, res, namespace, body):
        self._check("create", res, (body.get("metadata") or {}).get("name") or "")
        return await self._kube.create(res, namespace, body)

    async def replace(self, res, namespace, name, body):
        self._check("replace", res, name)
        return await self._kube.replace(res, namespace, name, body)

    async def patch(self, res, namespace, name, patch):
        self._check("patch", res, name)
        return await self._kube.patch(res, namespace, name, patch)

    async def patch_status(self, res, namespace, name, patch):
        self._check("status patch", res, name)
        return await self._kube.patch_status(res, namespace, name, patch)

    async def delete(self, res, namespace, name, *args, **kw):
        self._check("delete", res, name)
        return await self._kube.delete(res, namespace, name, *args, **kw)


class FencedPoolSink:
    """The router admin API (`fleet.controller.pools.PoolSink`) whose pool writes raise
    `NotLeader` unless ``holds()``; reads (in-flight counts, stats) pass through."""

    def __init__(self, sink, holds: Callable[[], bool]) -> None:
        self._sink = sink
        self._holds = holds

    def __getattr__(self, name: str):
        return getattr(self._sink, name)

    async def put_pool(self, model, pool) -> None:
        if not self._holds():
            raise NotLeader(f"pool {model}")
        await self._sink.put_pool(model, pool)

    async def delete_pool(self, model) -> None:
        if not self._holds():
            raise NotLeader(f"pool deletion {model}")
        await self._sink.delete_pool(model)
