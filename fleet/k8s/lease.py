"""Leader election through a coordination.k8s.io/v1 Lease, so that two operator pods can run
and exactly one acts.

Owns `LeaderElector`: `try_acquire_or_renew` (create the Lease when there is none; renew it
while we hold it; take it over when its holder has not renewed it for ``lease_duration_s`` as
*we* measure time: the record is judged by when this process saw it change, not by the holder's
clock, as client-go's leaderelection does) and `release` (on an orderly stop: clear the holder
so a standby takes over at once). Every write carries the resourceVersion it read: two
candidates racing get one 409 and one win. Time comes from an injected clock. Called by the
operator (`fleet.k8s.operator`).
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable

from fleet.k8s.client import LEASES, ApiError, Conflict, Kube, NotFound

log = logging.getLogger("fleet.k8s.lease")


def _micro_time(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """One candidate for the Lease ``namespace/name``."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str, *, clock: Callable[[], float],
                 wall: Callable[[], float], lease_duration_s: float = 15.0) -> None:  # fmt: skip
        """``clock``: monotonic seconds (expiry); ``wall``: Unix seconds (the Lease's times)."""
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.clock = clock
        self.wall = wall
        self.lease_duration_s = lease_duration_s
        self.is_leader = False
        self._observed: tuple[str, str] | None = None   # (holder, renewTime) last seen
        self._observed_at_s = 0.0
        self.renewed_at_s: float | None = None          # clock() of our last successful write
        self.transitions = 0

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
            self.renewed_at_s = self.clock()
            return self._set(True)
        except ApiError as err:
            log.warning("cannot read lease %s: %s", self.name, err)
            return self._set(False)
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
        except (Conflict, ApiError) as err:
            log.info("lease %s: %s", self.name, err)
            return self._set(False)
        if acquire:
            self.transitions = transitions
        self._observed, self._observed_at_s = (self.identity, new_spec["renewTime"]), now_s
        self.renewed_at_s = now_s
        return self._set(True)

    def holds(self) -> bool:
        """Whether this candidate may act now: it holds the Lease and its last renewal is less
        than a lease duration old (after that a standby may take over)."""
        return self.is_leader and self.renewed_at_s is not None and \
            self.clock() < self.renewed_at_s + self.lease_duration_s

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
