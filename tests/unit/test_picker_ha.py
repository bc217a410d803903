"""The endpoint picker's HA mode and its own metrics (router/picker/service.py, router/picker/metrics.py,
fleet/k8s/picker_pod.py): two pickers on one Lease (the operator's election, on the fake API and a
fake clock), only the holder answers, a standby declines and the router picks alone, the standby
answers once it takes the Lease over; `/metrics` and `/ready` on loopback."""

from __future__ import annotations

import httpx
import pytest

from fleet.k8s.lease import LeaderElector
from fleet.k8s.picker_pod import LEASE_DURATION_S, RENEW_DEADLINE_S, PickerLease, elector_for
from router.kv.prompt_blocks import RouteRequest
from router.picker.client import PickerClient
from router.picker.metrics import serve_http
from router.picker.service import PickerService
from tests.support.fake_kube import FakeKube
from tests.support.fakes import FakeClock
from tests.support.waits import async_wait_until

REQUEST = RouteRequest(block_hashes=(1, 2), prompt_tokens=128, token_ids=list(range(128)))


def _own_pick() -> int:
    raise AssertionError("the picker answers: the router does not pick")


async def _connected(service: PickerService) -> PickerClient:
    client = PickerClient("127.0.0.1", service.port, deadline_s=2.0)
    client.put_pool("m", "least-outstanding", {"e0": None, "e1": None})
    client.start()
    await async_wait_until(lambda: client.connected and "m" in service.state.pools, 10.0,
                           what="the client connected and its pool reached the picker")
    return client


def _picks(service: PickerService, outcome: str) -> float:
    return service.metrics.registry.get_sample_value("fleet_picker_picks_total", {"outcome": outcome}) or 0.0


async def test_only_the_lease_holder_answers_and_the_standby_takes_over() -> None:
    kube, clock, wall = FakeKube(), FakeClock(), FakeClock(1_800_000_000.0)
    a = LeaderElector(kube, "ns", "picker", "a", clock=clock, wall=wall, lease_duration_s=LEASE_DURATION_S,
                      renew_deadline_s=RENEW_DEADLINE_S)  # fmt: skip
    b = LeaderElector(kube, "ns", "picker", "b", clock=clock, wall=wall, lease_duration_s=LEASE_DURATION_S,
                      renew_deadline_s=RENEW_DEADLINE_S)  # fmt: skip
    leader, standby = PickerService(leading=a.holds), PickerService(leading=b.holds)
    clients: list[PickerClient] = []
    try:
        await leader.start()
        await standby.start()
        assert await a.try_acquire_or_renew() and not await b.try_acquire_or_renew()
        clients = [await _connected(leader), await _connected(standby)]
        to_leader, to_standby = clients
        assert (await to_leader.pick("m", ["e0", "e1"], REQUEST, _own_pick))[2]
        assert await to_standby.pick("m", ["e0", "e1"], REQUEST, lambda: 1) == (1, None, False)   # declined
        assert (_picks(leader, "answered"), _picks(standby, "standby")) == (1.0, 1.0)
        assert standby.state.in_flight() == 0   # a declined pick holds no load
        # the leader stops renewing (its process is gone): past its renew deadline it answers no
        # more; a whole lease after b last saw the record change, b takes it over
        clock.advance(RENEW_DEADLINE_S + 0.5)
        assert not await b.try_acquire_or_renew()
        assert (await to_leader.pick("m", ["e0", "e1"], REQUEST, lambda: 0))[2] is False
        clock.advance(LEASE_DURATION_S - RENEW_DEADLINE_S)
        assert await b.try_acquire_or_renew()
        assert (await to_standby.pick("m", ["e0", "e1"], REQUEST, _own_pick))[2]
        assert standby.metrics.registry.get_sample_value("fleet_picker_leader") == 1.0
        assert leader.metrics.registry.get_sample_value("fleet_picker_leader") == 0.0
    finally:
        for client in clients:
            await client.close()
        await leader.close()
        await standby.close()


async def test_metrics_and_readiness_follow_the_picks_and_the_lease() -> None:
    leading = [True]
    service = PickerService(leading=lambda: leading[0])
    await service.start()
    runner, port = await serve_http(service.metrics, "127.0.0.1", 0)
    client = await _connected(service)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            assert (await http.get("/ready")).status_code == 200
            assert (await http.get("/healthz")).status_code == 200
            await client.pick("m", ["e0", "e1"], REQUEST, _own_pick)
            await client.pick("unknown", ["e0"], REQUEST, lambda: 0)   # no such pool: declined
            text = (await http.get("/metrics")).text
            for line in ('fleet_picker_picks_total{outcome="answered"} 1.0',
                         'fleet_picker_picks_total{outcome="declined"} 1.0',
                         "fleet_picker_pick_decision_seconds_count 2.0", "fleet_picker_routers_connected 1.0",
                         "fleet_picker_picks_in_flight 1.0", "fleet_picker_leader 1.0"):  # fmt: skip
                assert line in text, line
            leading[0] = False
            response = await http.get("/ready")
            assert response.status_code == 503 and response.json() == {"leader": False}
            assert "fleet_picker_leader 0.0" in (await http.get("/metrics")).text
    finally:
        await client.close()
        await runner.cleanup()
        await service.close()


def test_lease_settings_are_checked_with_the_flag_named() -> None:
    with pytest.raises(ValueError, match="--renew-deadline-s"):
        PickerLease("picker", "ns", renew_deadline_s=15.0)
    with pytest.raises(ValueError, match="--retry-period-s"):
        PickerLease("picker", "ns", retry_period_s=0.0)
    elector = elector_for(FakeKube(), PickerLease("picker", "ns", identity="p-0"))
    assert (elector.identity, elector.lease_duration_s, elector.renew_deadline_s) == ("p-0", 15.0, 10.0)
