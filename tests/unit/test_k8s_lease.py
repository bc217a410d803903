"""Leader election on a coordination.k8s.io Lease (fleet/k8s/lease.py), on the fake: one
holder at a time, renewal, take-over only after the holder stopped renewing for the lease
duration as the candidate measures it, release on an orderly stop; the holder stops acting at
its renew deadline (before any standby may take over), its writes are fenced after it, and the
keeper renews on its own thread while the caller's thread is busy."""

from __future__ import annotations

import time

import pytest

from fleet.k8s.client import LEASES, PODS, ApiError, Conflict
from fleet.k8s.lease import FencedKube, FencedPoolSink, LeaderElector, LeaseKeeper, NotLeader
from router.pools.spec import PoolSpec
from tests.support.fakes import FakeClock, FakePoolSink
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


async def test_a_holder_stops_acting_at_its_renew_deadline_before_a_standby_can_take_over():
    kube, clock, wall, a, b = _pair()      # lease 15 s; renew deadline: two thirds, 10 s
    assert await a.try_acquire_or_renew() and a.holds()
    assert not await b.try_acquire_or_renew()
    clock.advance(9.5)
    assert a.holds()
    clock.advance(1)     # no renewal for 10.5 s (its renewals failed, or a tick held its thread): stops
    assert a.is_leader and not a.holds()
    assert await a.try_acquire_or_renew() and a.holds()


async def test_two_holders_never_act_at_once():
    """The holder goes silent; each half second the standby tries, and whoever holds is checked:
    never both. The standby acts from 15 s on; the old holder stopped at 10 s."""
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew()
    assert not await b.try_acquire_or_renew()
    acting = []
    for _ in range(60):
        clock.advance(0.5)
        wall.advance(0.5)
        await b.try_acquire_or_renew()
        assert not (a.holds() and b.holds())
        acting.append((a.holds(), b.holds()))
    assert acting[19] == (False, False) and acting[29] == (False, True)   # 10 s: a stops; 15 s: b acts
    assert b.transitions == 1


async def test_a_failed_round_keeps_acting_until_the_deadline_a_conflict_stops_at_once():
    kube, clock, wall, a, b = _pair()
    assert await a.try_acquire_or_renew()
    clock.advance(2)
    kube.fail_next["get"] = ApiError(500, "InternalError", "etcd is slow")
    assert await a.try_acquire_or_renew() and a.holds()      # says nothing about who holds it
    clock.advance(7)
    kube.fail_next["replace"] = ApiError(503, "ServiceUnavailable", "try later")
    assert await a.try_acquire_or_renew() and a.holds()
    clock.advance(1.5)   # 10.5 s since the last renewal that went through
    kube.fail_next["get"] = ApiError(500, "InternalError", "etcd is slow")
    assert not await a.try_acquire_or_renew()
    assert await a.try_acquire_or_renew() and a.holds()      # the API is back: renewed
    kube.fail_next["replace"] = Conflict(409, "Conflict", "the object has been modified")
    assert not await a.try_acquire_or_renew() and not a.holds()   # someone else wrote it: stop now


def test_the_renew_deadline_must_be_below_the_lease():
    kube, clock = FakeKube(), FakeClock()
    with pytest.raises(ValueError, match="renew deadline"):
        LeaderElector(kube, "ns", "l", "a", clock=clock, wall=clock, lease_duration_s=15, renew_deadline_s=15)
    assert LeaderElector(kube, "ns", "l", "a", clock=clock, wall=clock, lease_duration_s=15).renew_deadline_s == 10


async def test_writes_are_fenced_once_the_deadline_passes():
    kube, clock, wall, a, b = _pair()
    fenced = FencedKube(kube, a.holds)
    sink = FakePoolSink()
    pools = FencedPoolSink(sink, a.holds)
    assert await a.try_acquire_or_renew()
    await fenced.create(PODS, "ns", {"metadata": {"name": "p"}})
    await pools.put_pool("m", PoolSpec(endpoints=[]))
    clock.advance(11)
    for write in (fenced.create(PODS, "ns", {"metadata": {"name": "q"}}),
                  fenced.patch(PODS, "ns", "p", {"metadata": {"labels": {"x": "1"}}}),
                  fenced.delete(PODS, "ns", "p"), pools.put_pool("m", PoolSpec(endpoints=[])),
                  pools.delete_pool("m")):  # fmt: skip
        with pytest.raises(NotLeader, match="renew deadline"):
            await write
    assert [o["metadata"]["name"] for o in (await fenced.list(PODS, "ns"))[0]] == ["p"]   # reads pass
    assert sink.updates == 1 and not sink.deleted


def test_the_keeper_renews_while_the_event_loop_thread_is_busy():
    """The keeper's thread renews while this thread holds the GIL-releasing busy loop that a
    long tick is: no renewal waits for the caller's event loop."""
    kube = FakeKube()
    elector = LeaderElector(kube, "ns", "fleet-operator", "a", clock=time.monotonic, wall=time.time,
                            lease_duration_s=15)  # fmt: skip
    changes = []
    keeper = LeaseKeeper(elector, retry_period_s=0.01, on_change=lambda: changes.append(elector.is_leader))
    keeper.start()
    try:
        deadline = time.monotonic() + 10  # not a wait: this loop spins without a sleep, the case under test
        while elector.renewals < 5:       # a "tick" that never yields: pure Python holding the GIL
            assert time.monotonic() < deadline, "the keeper did not renew"
        assert elector.holds() and changes == [True]
    finally:
        keeper.stop(release=True)
    assert kube.store.get(LEASES, "ns", "fleet-operator")["spec"]["holderIdentity"] == ""
    assert not elector.is_leader
