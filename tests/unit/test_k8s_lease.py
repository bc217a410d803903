"""Leader election on a coordination.k8s.io Lease (fleet/k8s/lease.py), on the fake: one
holder at a time, renewal, take-over only after the holder stopped renewing for the lease
duration as the candidate measures it, release on an orderly stop."""

from __future__ import annotations

import pytest

from fleet.k8s.client import LEASES
from fleet.k8s.lease import LeaderElector
from tests.support.fakes import FakeClock
from tests.support.fake_kube import FakeKube


def _pair():
    kube, clock = FakeKube(), FakeClock()
    wall = FakeClock(1_800_000_000.0)
    a = LeaderElector(kube, "ns", "fleet-operator", "a", clock=clock, wall=wall, lease_duration_s=15)
    b = LeaderElector(kube, "ns", "fleet-operator", "b", clock=clock, wall=wall, lease_duration_s=15)
    return kube, clock, wall, a, b


async def test_one_holder_renews_the_other_waits_then_takes_over():
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    for _ in range(5):   # a renews every 5 s: b never sees it expire
        clock.advance(5)
        wall.advance(5)
        assert await a.try_acquire_or_renew()
        assert not await b.try_acquire_or_renew()
    clock.advance(14)    # a stopped renewing 14 s ago: not yet
    assert not await b.try_acquire_or_renew()
    clock.advance(2)
    assert await b.try_acquire_or_renew()
    lease = kube.store.get(LEASES, "ns", "fleet-operator")["spec"]
    assert lease["holderIdentity"] == "b" and lease["leaseTransitions"] == 1
    assert not await a.try_acquire_or_renew()   # a comes back: b holds it
    assert not a.is_leader


async def test_a_stale_write_loses_the_race():
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()  # b first sees the record: its clock for expiry starts now
    clock.advance(16)
    stale = kube.store.get(LEASES, "ns", "fleet-operator")
    assert await b.try_acquire_or_renew()      # b takes the expired lease
    with pytest.raises(Exception, match="409"):  # a write from the version a read before: refused
        await kube.replace(LEASES, "ns", "fleet-operator", stale)


async def test_expiry_is_judged_by_the_candidates_own_observation():
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew()
    clock.advance(100)       # a long-dead holder, but b has never looked: it waits a full duration
    assert not await b.try_acquire_or_renew()
    clock.advance(15)
    assert await b.try_acquire_or_renew()


async def test_release_hands_over_at_once():
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew()
    await a.release()
    assert not a.is_leader
    assert await b.try_acquire_or_renew()


async def test_a_holder_stops_acting_once_its_last_renewal_is_a_lease_old():
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew() and a.holds()
    clock.advance(14)
    assert a.holds()
    clock.advance(2)     # no renewal for 16 s (say, a tick held the event loop): a standby may act now
    assert a.is_leader and not a.holds()
    assert await a.try_acquire_or_renew() and a.holds()
