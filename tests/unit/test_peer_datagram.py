"""The peer channel's UDP path: signed datagrams between two routers' sockets on loopback, the
sender's choice of datagram or HTTP, and the ordering that keeps a late datagram from replacing
a newer report (router.peer_datagram, router.peer_channel, router.peer_load)."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from router.endpoint import EndpointState
from router.peer_channel import HEARTBEAT_S, PEER_LOAD_PATH, PeerMetrics, PeerSender
from router.peer_datagram import (MAC_BYTES, MAX_DATAGRAM_BYTES, DatagramMetrics, PeerDatagrams, datagram_address,
                                  datagram_key, seal, unseal)  # fmt: skip
from router.peer_load import PeerLoadView, parse_report, report_order


def endpoint(id: str, in_flight: int = 0) -> EndpointState:
    e = EndpointState(id, f"http://{id}")
    e.in_flight = in_flight
    return e


def test_a_sealed_body_opens_only_with_the_same_token() -> None:
    key = datagram_key("token-a")
    data = seal(key, b'{"router":"r"}')
    assert len(data) == MAC_BYTES + 14 and unseal(key, data) == b'{"router":"r"}'
    with pytest.raises(ValueError, match="signature"):
        unseal(datagram_key("token-b"), data)
    with pytest.raises(ValueError, match="signature"):
        unseal(key, data[:-1] + b"]")
    with pytest.raises(ValueError, match="short"):
        unseal(key, data[:MAC_BYTES])
    assert key != b"token-a" and len(key) == 32


def test_datagrams_go_to_peers_named_by_address_only() -> None:
    assert datagram_address("http://10.0.0.5:8081" + PEER_LOAD_PATH) == ("10.0.0.5", 8081)
    assert datagram_address("http://[::1]:9000") == ("::1", 9000)
    assert datagram_address("http://router-1.svc:8081") is None   # a name: HTTP only (no resolving per send)
    assert datagram_address("http://10.0.0.5") is None


async def test_two_sockets_exchange_signed_reports_and_drop_the_rest() -> None:
    got: list[bytes] = []

    def on_report(body: bytes) -> None:
        if not body.startswith(b"{"):
            raise ValueError("not a report")
        got.append(body)

    registry = CollectorRegistry()
    receiver = PeerDatagrams("tok", on_report, DatagramMetrics(registry))
    sender = PeerDatagrams("tok", got.append, DatagramMetrics(CollectorRegistry()))
    stranger = PeerDatagrams("other-token", got.append, DatagramMetrics(CollectorRegistry()))
    await receiver.start("127.0.0.1", 0)
    await sender.start("127.0.0.1", 0)
    await stranger.start("127.0.0.1", 0)
    assert receiver.open and sender.open
    port = receiver._transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
    try:
        assert sender.send(("127.0.0.1", port), b'{"router":"a"}')
        assert stranger.send(("127.0.0.1", port), b'{"router":"b"}')
        assert sender.send(("127.0.0.1", port), b"not json")
        assert not sender.send(("127.0.0.1", port), b"x" * MAX_DATAGRAM_BYTES)   # too large: the caller posts it

        def rejected(reason: str) -> float:
            return registry.get_sample_value("fleet_router_peer_datagrams_rejected_total", {"reason": reason}) or 0

        deadline = asyncio.get_running_loop().time() + 10
        while (rejected("signature") < 1 or rejected("report") < 1) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        assert got == [b'{"router":"a"}']
        assert rejected("signature") == 1 and rejected("report") == 1
    finally:
        for d in (receiver, sender, stranger):
            d.close()
    assert not receiver.open


async def test_a_port_already_bound_leaves_the_channel_on_http() -> None:
    first = PeerDatagrams("tok", lambda b: None, DatagramMetrics(CollectorRegistry()))
    await first.start("127.0.0.1", 0)
    port = first._transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
    second = PeerDatagrams("tok", lambda b: None, DatagramMetrics(CollectorRegistry()))
    try:
        await second.start("127.0.0.1", port)
        assert not second.open and not second.send(("127.0.0.1", port), b"{}")
    finally:
        first.close()


class Recorder:
    """A `PeerDatagrams` stand-in that records what would have been sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[tuple[str, int], bytes]] = []

    def send(self, address: tuple[str, int], body: bytes) -> bool:
        self.sent.append((address, body))
        return True


async def test_changes_go_as_datagrams_and_every_peer_gets_the_heartbeat_over_http() -> None:
    posted: list[tuple[str, bytes]] = []

    async def post(url: str, body: bytes) -> None:
        posted.append((url, body))

    a = endpoint("a", 1)
    datagrams = Recorder()
    registry = CollectorRegistry()
    sender = PeerSender("me", ["http://10.0.0.2:8081", "http://router-3.svc:8081"], lambda: {"m": (a,)}, post,
                        PeerMetrics(registry, lambda: 0), datagrams=datagrams)  # type: ignore[arg-type]  # fmt: skip
    await sender.send_once(now_s=0.0)               # first round: every peer over HTTP
    assert [u for u, _ in posted] == ["http://10.0.0.2:8081" + PEER_LOAD_PATH, "http://router-3.svc:8081" + PEER_LOAD_PATH]
    assert datagrams.sent == []
    a.start(100)
    await sender.send_once(now_s=0.01)              # a change: a datagram to the address, HTTP to the name
    assert [addr for addr, _ in datagrams.sent] == [("10.0.0.2", 8081)]
    assert [u for u, _ in posted[2:]] == ["http://router-3.svc:8081" + PEER_LOAD_PATH]
    await sender.send_once(now_s=0.02)              # unchanged, heartbeat not due: nothing
    assert len(datagrams.sent) == 1 and len(posted) == 3
    await sender.send_once(now_s=HEARTBEAT_S)       # the heartbeat: both over HTTP, the latest report
    assert len(datagrams.sent) == 1 and len(posted) == 5 and posted[4][1] == datagrams.sent[0][1]
    orders = [report_order(json.loads(b)) for _, b in posted[:2]] + [report_order(json.loads(datagrams.sent[0][1]))]
    boot = orders[0][0]  # type: ignore[index]
    assert orders == [(boot, 1), (boot, 1), (boot, 2)]
    assert parse_report(json.loads(datagrams.sent[0][1])) == ("me", {"m": {"a": (2, 1, 100.0)}})
    assert registry.get_sample_value("fleet_router_peer_reports_sent_total") == 6


def test_a_late_report_never_replaces_a_newer_one_from_the_same_boot() -> None:
    view = PeerLoadView("me")
    mine = {"m": (endpoint("a"),)}
    assert view.receive("p", {"m": {"a": (5, 0, 0.0)}}, mine, 1.0, ("b1", 7))
    assert not view.receive("p", {"m": {"a": (9, 0, 0.0)}}, mine, 1.1, ("b1", 6))   # a datagram overtaken by HTTP
    assert mine["m"][0].others_in_flight == 5
    assert view.receive("p", {"m": {"a": (5, 0, 0.0)}}, mine, 1.9, ("b1", 7))       # the same one again: refreshed
    assert view.peers(2.5) == ["p"]
    assert view.receive("p", {"m": {"a": (1, 0, 0.0)}}, mine, 2.0, ("b2", 1))       # the peer restarted
    assert mine["m"][0].others_in_flight == 1
    assert view.receive("p", {"m": {"a": (2, 0, 0.0)}}, mine, 2.1)                   # no order: taken as newest
    assert mine["m"][0].others_in_flight == 2


def test_a_report_order_is_both_fields_or_neither() -> None:
    assert report_order({"router": "r", "pools": {}}) is None
    assert report_order({"router": "r", "boot": "x", "seq": 3, "pools": {}}) == ("x", 3)
    for bad in ({"boot": "x"}, {"seq": 1}, {"boot": 1, "seq": 1}, {"boot": "x", "seq": -1}, {"boot": "x", "seq": True}):
        with pytest.raises(ValueError, match="boot must be a string"):
            report_order(bad)


async def test_the_sender_wakes_for_a_change_and_otherwise_only_for_the_heartbeat() -> None:
    posted: list[float] = []
    loop = asyncio.get_running_loop()

    async def post(url: str, body: bytes) -> None:
        posted.append(loop.time())

    a = endpoint("a")
    datagrams = Recorder()
    sender = PeerSender("me", ["http://10.0.0.2:8081"], lambda: {"m": (a,)}, post,
                        PeerMetrics(CollectorRegistry(), lambda: 0), interval_s=0.01,
                        datagrams=datagrams)  # type: ignore[arg-type]  # fmt: skip
    await sender.start()
    try:
        deadline = loop.time() + 10
        while not posted and loop.time() < deadline:    # the first round posts over HTTP
            await asyncio.sleep(0.005)
        assert posted and datagrams.sent == []
        a.start(10)                                     # a change, and the proxy says so
        sender.notify()
        while not datagrams.sent and loop.time() < deadline:
            await asyncio.sleep(0.005)
        assert len(datagrams.sent) == 1
        assert loop.time() - posted[0] < HEARTBEAT_S    # went before the heartbeat was due
        sent = len(datagrams.sent)
        while len(posted) < 3 and loop.time() < deadline:   # no change: only the heartbeats, over HTTP
            await asyncio.sleep(0.01)
        assert len(posted) >= 3 and len(datagrams.sent) == sent
        assert posted[2] - posted[1] >= HEARTBEAT_S * 0.9   # not every interval_s
    finally:
        await sender.close()
