"""Peer routers found by DNS (router.signals.peer_discovery): the set arithmetic, the discovery's rounds
over a fake resolver (peers added and removed, a name without records, a failed resolution), the
sender taking the new set, and a router resolving ``localhost`` to its peer on loopback
(`GET /admin/v1/peers`)."""

from __future__ import annotations

import asyncio
import socket

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from router.http.app import create_app
from router.pools.endpoint import EndpointState
from router.signals.peer_channel import PEER_LOAD_PATH, PeerMetrics, PeerSender
from router.signals.peer_discovery import (
    DiscoveryMetrics,
    NoRecords,
    PeerDiscovery,
    parse_dns_target,
    peer_urls,
    resolve_addresses,
)
from router.pools.spec import PoolSpec
from tests.support.router import running_app
from tests.support.waits import async_wait_until


def test_peer_urls_leave_out_this_router_and_duplicates() -> None:
    found = ["10.0.0.7", "10.0.0.3", "10.0.0.7", "fd00::0:5", "10.0.0.9"]
    assert peer_urls(found, 9090, ["10.0.0.9"]) == ["http://10.0.0.3:9090", "http://10.0.0.7:9090",
                                                    "http://[fd00::5]:9090"]  # fmt: skip
    assert peer_urls(found, 9090, ["fd00:0::5", "10.0.0.3"]) == ["http://10.0.0.7:9090", "http://10.0.0.9:9090"]
    assert peer_urls([], 9090, []) == []
    assert peer_urls(["10.0.0.9"], 9090, ["10.0.0.9"]) == []   # alone: no peers


@pytest.mark.parametrize(("target", "parsed"), [("fleet-router-peers.ns.svc:9090", ("fleet-router-peers.ns.svc", 9090)),
                                                ("localhost:1", ("localhost", 1)), ("[::1]:80", ("::1", 80))])  # fmt: skip
def test_parse_dns_target(target: str, parsed: tuple[str, int]) -> None:
    assert parse_dns_target(target) == parsed


@pytest.mark.parametrize("target", ["name", "name:", ":9090", "name:0", "name:65536", "name:x"])
def test_bad_dns_targets_are_refused(target: str) -> None:
    with pytest.raises(ValueError, match="NAME:PORT"):
        parse_dns_target(target)


async def test_discovery_follows_the_records_and_keeps_the_set_through_errors() -> None:
    answers: list[object] = [["10.0.0.1", "10.0.0.2"], ["10.0.0.1", "10.0.0.2"], ["10.0.0.1", "10.0.0.3"],
                             OSError("EAI_AGAIN"), NoRecords("NXDOMAIN"), ["10.0.0.1"]]  # fmt: skip
    asked: list[tuple[str, int]] = []

    async def resolve(host: str, port: int) -> list[str]:
        asked.append((host, port))
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer  # type: ignore[return-value]

    changes: list[list[str]] = []
    registry = CollectorRegistry()
    discovery = PeerDiscovery("routers", 9090, ["10.0.0.1"], changes.append, DiscoveryMetrics(registry),
                              resolve=resolve, clock=lambda: 0.0)  # fmt: skip
    assert discovery.peers is None
    assert await discovery.resolve_once() == ["http://10.0.0.2:9090"]
    assert await discovery.resolve_once() == ["http://10.0.0.2:9090"]          # unchanged: no call
    assert await discovery.resolve_once() == ["http://10.0.0.3:9090"]          # .2 left, .3 joined
    assert await discovery.resolve_once() == ["http://10.0.0.3:9090"]          # DNS failed: kept
    assert registry.get_sample_value("fleet_router_peer_dns_errors_total") == 1
    assert await discovery.resolve_once() == []                                # no records: no peers
    assert await discovery.resolve_once() == []                                # only itself
    assert changes == [["http://10.0.0.2:9090"], ["http://10.0.0.3:9090"], []]
    assert asked == [("routers", 9090)] * 6
    assert registry.get_sample_value("fleet_router_peers_discovered") == 0
    with pytest.raises(ValueError):
        PeerDiscovery("routers", 1, [], changes.append, DiscoveryMetrics(CollectorRegistry()), interval_s=0)


async def test_discovery_runs_every_interval_and_survives_a_broken_resolver() -> None:
    calls = 0

    async def resolve(host: str, port: int) -> list[str]:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("resolver bug")
        return [f"10.0.0.{calls}"]

    changes: list[list[str]] = []
    discovery = PeerDiscovery("routers", 1, [], changes.append, DiscoveryMetrics(CollectorRegistry()),
                              resolve=resolve, interval_s=0.01)  # fmt: skip
    await discovery.start()
    assert changes == [["http://10.0.0.1:1"]]      # the first resolution is done before start returns
    await async_wait_until(lambda: calls >= 4, 10, what="four resolutions, one of them failed")
    await discovery.close()
    assert calls >= 4 and changes[-1] == [f"http://10.0.0.{calls}:1"]


async def test_the_sender_takes_a_new_peer_set_and_reports_to_a_new_peer_at_once() -> None:
    posted: list[str] = []

    async def post(url: str, body: bytes) -> None:
        posted.append(url)

    sender = PeerSender("me", [], lambda: {"m": (EndpointState("a", "http://a"),)}, post,
                        PeerMetrics(CollectorRegistry(), lambda: 0))  # fmt: skip
    await sender.send_once(now_s=0.0)
    assert posted == []
    sender.set_peers(["http://10.0.0.2:9090"])
    await sender.send_once(now_s=0.01)
    sender.set_peers(["http://10.0.0.2:9090", "http://10.0.0.3:9090"])
    await sender.send_once(now_s=0.02)             # same report, 10 ms later: to .3 (new) only
    assert posted == ["http://10.0.0.2:9090" + PEER_LOAD_PATH, "http://10.0.0.3:9090" + PEER_LOAD_PATH]
    sender.set_peers([])
    await sender.send_once(now_s=1.0)
    assert len(posted) == 2


async def test_resolve_addresses_uses_the_loops_getaddrinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "127.0.0.1" in await resolve_addresses("localhost", 80)   # /etc/hosts: no DNS query
    loop = asyncio.get_running_loop()

    async def failing(*args: object, **kwargs: object) -> list[object]:
        raise socket.gaierror(error, "from the fake")

    for error, raised in ((socket.EAI_NONAME, NoRecords), (socket.EAI_AGAIN, socket.gaierror)):
        monkeypatch.setattr(loop, "getaddrinfo", failing)
        with pytest.raises(raised):
            await resolve_addresses("fleet-router-peers.fleet.svc", 9090)


async def test_a_router_finds_its_peer_by_name_and_leaves_itself_out() -> None:
    token = "dns-peer-token"
    pool = PoolSpec.model_validate({"policy": "kv-aware", "endpoints": [{"id": "e0", "url": "http://127.0.0.1:9"}]})
    receiver = create_app(token, peers=["http://127.0.0.1:9"], router_id="b", peer_interval_s=0.02)
    receiver.pools.put("m", pool)
    receiver.peer_sender.set_peers([])   # type: ignore[union-attr]  # b only listens here
    async with running_app(receiver) as base_b:
        port_b = int(base_b.rsplit(":", 1)[1])
        # `localhost` is 127.0.0.1 (b's address); a says its own address is 127.0.0.2
        sender = create_app(token, peers_dns=("localhost", port_b), self_addresses=["127.0.0.2"], router_id="a",
                            peer_interval_s=0.02)  # fmt: skip
        alone = create_app(token, peers_dns=("localhost", port_b), self_addresses=["127.0.0.1"], router_id="c")
        sender.pools.put("m", pool)
        async with running_app(sender) as base_a, running_app(alone) as base_c, aiohttp.ClientSession() as client:
            auth = {"authorization": f"Bearer {token}"}
            sender.pools.get("m").endpoints[0].start(3000)   # type: ignore[union-attr]
            e_b = receiver.pools.get("m").endpoints[0]       # type: ignore[union-attr]
            await async_wait_until(lambda: e_b.others_in_flight == 1, 10, what="b to see a's request")
            assert (e_b.others_in_flight, e_b.others_prefill_tokens) == (1, 3000.0)
            async with client.get(base_a + "/admin/v1/peers", headers=auth) as r:
                assert (await r.json())["targets"] == [base_b]
            async with client.get(base_b + "/admin/v1/peers", headers=auth) as r:
                seen = await r.json()
            assert seen["router"] == "b" and seen["live"] == ["a"] and seen["load"] == {"m": {"e0": [1, 1, 3000.0]}}
            async with client.get(base_c + "/admin/v1/peers", headers=auth) as r:
                assert (await r.json())["targets"] == []   # it is 127.0.0.1 itself
            assert alone.metrics.registry.get_sample_value("fleet_router_peers_discovered") == 0
            async with client.get(base_c + "/admin/v1/peers") as r:
                assert r.status == 401
    async with running_app(create_app(token)) as base, aiohttp.ClientSession() as client:
        async with client.get(base + "/admin/v1/peers", headers={"authorization": f"Bearer {token}"}) as r:
            assert r.status == 404

