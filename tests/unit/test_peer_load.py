"""Routers that tell each other the load they sent: reports, their sum per endpoint, the sender,
and two routers on loopback exchanging them (router.signals.peer_load, router.signals.peer_channel, the admin
API's POST /admin/v1/peer-load)."""

from __future__ import annotations

import json
import math

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from router.http.app import create_app
from router.pools.endpoint import EndpointState
from router.signals.peer_channel import HEARTBEAT_S, PEER_LOAD_PATH, PeerMetrics, PeerSender, SendFailed
from router.signals.peer_load import MAX_REPORT_ENDPOINTS, PeerLoadView, load_fingerprint, own_report, parse_report
from router.pools.spec import PoolSpec
from tests.support.router import running_app
from tests.support.waits import async_wait_until


def endpoint(id: str, in_flight: int = 0, prefilling: int = 0, prefill_tokens: int = 0) -> EndpointState:
    e = EndpointState(id, f"http://{id}")
    e.in_flight, e.prefilling, e.prefill_tokens = in_flight, prefilling, prefill_tokens
    return e


def test_a_report_round_trips() -> None:
    report = own_report("r1", {"m": (endpoint("a", 3, 1, 900), endpoint("b"))})
    assert parse_report(report) == ("r1", {"m": {"a": (3, 1, 900.0), "b": (0, 0, 0.0)}})


@pytest.mark.parametrize("doc", [None, [], {"router": 1, "pools": {}}, {"router": "r", "pools": {"m": []}},
                                 {"router": "r", "pools": {"m": {"a": [1, 2]}}},
                                 {"router": "r", "pools": {"m": {"a": [1, -2, 3]}}},
                                 {"router": "r", "pools": {"m": {"a": [1, "2", 3]}}},
                                 {"router": "r", "pools": {"m": {"a": [math.inf, 0, 0]}}},   # int() would overflow
                                 {"router": "r", "pools": {"m": {"a": [1, 0, math.nan]}}}])  # fmt: skip
def test_bad_reports_are_refused(doc: object) -> None:
    with pytest.raises(ValueError):
        parse_report(doc)


def test_a_report_of_many_empty_pools_counts_against_the_limit() -> None:
    with pytest.raises(ValueError, match="pools and endpoints"):
        parse_report({"router": "r", "pools": {f"m{i}": {} for i in range(MAX_REPORT_ENDPOINTS + 1)}})
    assert parse_report({"router": "r", "pools": {"m": {}}}) == ("r", {"m": {}})


def test_the_view_sums_fresh_peers_and_drops_quiet_ones() -> None:
    view = PeerLoadView("me", max_age_s=1.0)
    a = endpoint("a", in_flight=1)
    mine = {"m": (a,)}
    view.receive("p1", {"m": {"a": (2, 1, 500.0)}}, mine, now_s=10.0)
    view.receive("p2", {"m": {"a": (3, 2, 700.0)}}, mine, now_s=10.5)
    assert (a.others_in_flight, a.others_prefilling, a.others_prefill_tokens) == (5, 3, 1200.0)
    assert a.others_until_s == 11.0                       # p1's report is the oldest counted
    assert a.in_flight == 1                               # this router's own count is untouched
    view.receive("p2", {"m": {"a": (1, 0, 0.0)}}, mine, now_s=11.2)   # p1 went quiet 1.2 s ago
    assert (a.others_in_flight, a.others_until_s) == (1, 12.2)
    assert view.peers(11.2) == ["p2"]
    view.receive("me", {"m": {"a": (9, 9, 9.0)}}, mine, now_s=11.3)  # its own report, looped back
    assert a.others_in_flight == 1
    with pytest.raises(ValueError):
        PeerLoadView("me", max_age_s=0)


async def test_the_sender_posts_to_every_peer_and_counts_failures() -> None:
    posted: list[tuple[str, bytes]] = []

    async def post(url: str, body: bytes) -> None:
        if "down" in url:
            raise SendFailed("connect", "refused")
        posted.append((url, body))

    registry = CollectorRegistry()
    metrics = PeerMetrics(registry, lambda: 0)
    sender = PeerSender("me", ["http://up:1/", "http://down:2"], lambda: {"m": (endpoint("a", 2),)}, post,
                        metrics, interval_s=0.01)  # fmt: skip
    await sender.send_once(now_s=0.0)
    assert [u for u, _ in posted] == ["http://up:1" + PEER_LOAD_PATH]
    await sender.send_once(now_s=0.1)      # unchanged, and sent 0.1 s ago: not again yet
    assert len(posted) == 1
    await sender.send_once(now_s=0.1 + HEARTBEAT_S)
    assert len(posted) == 2
    assert parse_report(json.loads(posted[0][1])) == ("me", {"m": {"a": (2, 0, 0.0)}})
    assert registry.get_sample_value("fleet_router_peer_reports_sent_total") == 2
    assert registry.get_sample_value("fleet_router_peer_report_errors_total", {"reason": "connect"}) == 2
    loads = iter(range(1000))


    def changing() -> dict[str, tuple[EndpointState, ...]]:   # a load that changes every round, and says so
        sender.notify()
        return {"m": (endpoint("a", next(loads)),)}

    sender._endpoints = changing
    await sender.start()
    await async_wait_until(lambda: len(posted) >= 4, 10, what="four rounds posted")
    await sender.close()
    with pytest.raises(ValueError):
        PeerSender("me", [], dict, post, metrics, interval_s=0)


async def test_two_routers_on_loopback_see_each_others_load() -> None:
    token = "peer-test-token"
    pool = PoolSpec.model_validate({"policy": "kv-aware", "endpoints": [{"id": "e0", "url": "http://127.0.0.1:9"}]})
    apps = [create_app(token, peers=["http://127.0.0.1:9"], router_id=f"r{i}", peer_interval_s=0.02) for i in (0, 1)]
    for app in apps:
        app.pools.put("m", pool)
        assert app.poller is None   # with peers the engines are not polled
        app.peer_sender.set_peers([])   # type: ignore[union-attr]  # the peers' ports are known once they listen
    async with running_app(apps[0]) as base0, running_app(apps[1]) as base1:
        apps[0].peer_sender.set_peers([base1])  # type: ignore[union-attr]
        apps[1].peer_sender.set_peers([base0])  # type: ignore[union-attr]
        e0 = apps[0].pools.get("m").endpoints[0]  # type: ignore[union-attr]
        e1 = apps[1].pools.get("m").endpoints[0]  # type: ignore[union-attr]
        e0.start(4000)                            # router 0 dispatches a long prompt
        await async_wait_until(lambda: e1.others_in_flight == 1, 10, what="router 1 to see router 0's request")
        assert (e1.others_in_flight, e1.others_prefilling, e1.others_prefill_tokens) == (1, 1, 4000.0)
        assert e0.others_in_flight == 0
        reached_fastapi: list[str] = []
        fastapi_app = apps[1].api

        async def counting(scope, receive, send):   # reports skip FastAPI (the hot admin path)
            reached_fastapi.append(scope.get("path", ""))
            await fastapi_app(scope, receive, send)

        apps[1].api = counting  # type: ignore[assignment]
        received = apps[1].metrics.registry.get_sample_value("fleet_router_peer_reports_received_total")
        e0.finish(4000, got_first_byte=False)     # a change: router 0 reports it
        await async_wait_until(lambda: e1.others_in_flight == 0, 10, what="router 1 to see router 0's request end")
        assert apps[1].metrics.registry.get_sample_value("fleet_router_peer_reports_received_total") > received
        async with aiohttp.ClientSession() as client:
            async with client.post(base1 + PEER_LOAD_PATH, data=b"{}", headers={"authorization": f"Bearer {token}"}) as r:
                assert r.status == 422 and (await r.json())["detail"].startswith("bad peer load report")
            async with client.post(base1 + PEER_LOAD_PATH, data=b"[" * 20 + b"]" * 20,
                                   headers={"authorization": f"Bearer {token}"}) as r:  # fmt: skip
                assert r.status == 422                  # nested past PEER_REPORT_DEPTH
            async with client.post(base1 + PEER_LOAD_PATH, data=b"{}") as r:
                assert r.status == 401
        assert PEER_LOAD_PATH not in reached_fastapi
        assert apps[1].metrics.registry.get_sample_value("fleet_router_peers_live") == 1
        assert apps[1].metrics.registry.get_sample_value("fleet_router_peer_reports_received_total") >= 1
        async with aiohttp.ClientSession() as client:   # a report is answered with the datagrams taken from its sender
            report = b'{"router":"r9","pools":{}}'
            async with client.post(base1 + PEER_LOAD_PATH, data=report, headers={"authorization": f"Bearer {token}"}) as r:
                assert r.status == 200 and await r.json() == {"datagrams": 0}


async def test_a_router_without_peers_refuses_reports() -> None:
    app = create_app("t")
    async with running_app(app) as base, aiohttp.ClientSession() as client:
        async with client.post(base + PEER_LOAD_PATH, data=b"{}", headers={"authorization": "Bearer t"}) as r:
            assert r.status == 404


async def test_the_sender_reencodes_a_report_only_when_the_load_changed() -> None:
    posted: list[bytes] = []

    async def post(url: str, body: bytes) -> None:
        posted.append(body)

    a = endpoint("a", 1)
    sender = PeerSender("me", ["http://p:1"], lambda: {"m": (a,)}, post, PeerMetrics(CollectorRegistry(), lambda: 0))
    assert load_fingerprint({"m": (a,)}) == load_fingerprint({"m": (endpoint("a", 1),)})
    await sender.send_once(now_s=0.0)
    a.start(500)                                     # dispatched: in flight, prefilling, prefill tokens
    await sender.send_once(now_s=0.01)
    a.first_byte(500)                                # only the prefill counts move
    await sender.send_once(now_s=0.02)
    await sender.send_once(now_s=0.03)               # unchanged, sent 10 ms ago: nothing
    await sender.send_once(now_s=0.02 + HEARTBEAT_S)  # the heartbeat resends the same bytes
    assert [parse_report(json.loads(b))[1]["m"]["a"] for b in posted] == [(1, 0, 0.0), (2, 1, 500.0), (2, 0, 0.0),
                                                                          (2, 0, 0.0)]  # fmt: skip
    assert posted[3] is posted[2]
