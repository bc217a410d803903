"""The peer channel's UDP path: signed datagrams between two routers' sockets on loopback, the
sender's choice of datagram or HTTP, and the ordering that keeps a late datagram from replacing
a newer report (router.peer_datagram, router.peer_channel, router.peer_load)."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from router.endpoint import EndpointState
from router.peer_channel import HEARTBEAT_S, PEER_LOAD_PATH, PeerMetrics, PeerSender, datagrams_taken
from router.peer_datagram import (MAC_BYTES, MAX_DATAGRAM_BYTES, DatagramMetrics, DatagramTally, PeerDatagrams,
                                  datagram_address,
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


async def test_changes_go_as_datagrams_and_the_heartbeat_too_once_a_peer_confirms_it_takes_them() -> None:
    """The peer at an address answers each post with the datagrams it took (all of them, until UDP
    "breaks"); the peer named by host name gets no datagrams and answers 0."""
    posted: list[tuple[str, bytes]] = []
    udp_works = [True]
    arrived = [0]

    class Lossy(Recorder):
        def send(self, address: tuple[str, int], body: bytes) -> bool:
            arrived[0] += udp_works[0]
            return super().send(address, body)

    async def post(url: str, body: bytes) -> int:
        posted.append((url, body))
        return arrived[0] if "10.0.0.2" in url else 0

    a = endpoint("a", 1)
    datagrams = Lossy()
    registry = CollectorRegistry()
    by_ip, by_name = "http://10.0.0.2:8081" + PEER_LOAD_PATH, "http://router-3.svc:8081" + PEER_LOAD_PATH
    sender = PeerSender("me", ["http://10.0.0.2:8081", "http://router-3.svc:8081"], lambda: {"m": (a,)}, post,
                        PeerMetrics(registry, lambda: 0), datagrams=datagrams)  # type: ignore[arg-type]  # fmt: skip

    def since(n_posted: int, n_sent: int) -> tuple[list[str], int]:
        return [u for u, _ in posted[n_posted:]], len(datagrams.sent) - n_sent

    await sender.send_once(now_s=0.0)      # first round: both over HTTP, the address also a probe datagram
    assert since(0, 0) == ([by_ip, by_name], 1)
    a.start(100)
    await sender.send_once(now_s=0.01)     # a change: a datagram to the address, HTTP to the name
    assert since(2, 1) == ([by_name], 1)
    await sender.send_once(now_s=0.02)     # unchanged, no heartbeat due: nothing
    assert since(3, 2) == ([], 0)
    await sender.send_once(now_s=0.27)     # heartbeats: the address confirmed (its answer counted the probe),
    assert since(3, 2) == ([by_name], 1)   # so a datagram; the name over HTTP
    for t in (0.53, 0.79):
        await sender.send_once(now_s=t)
    assert since(3, 2) == ([by_name, by_name, by_name], 3)
    await sender.send_once(now_s=1.05)     # HTTP_HEARTBEAT_S since the address's last post: HTTP again
    assert since(6, 5) == ([by_ip, by_name], 0)
    udp_works[0] = False                   # datagrams stop arriving
    for t in (1.31, 1.57, 1.83):
        await sender.send_once(now_s=t)
    assert since(8, 5) == ([by_name] * 3, 3)
    await sender.send_once(now_s=2.09)     # the post's count did not grow: back on HTTP at every heartbeat,
    await sender.send_once(now_s=2.35)     # each post with a probe beside it
    assert since(11, 8) == ([by_ip, by_name, by_ip, by_name], 1)
    orders = [report_order(json.loads(b)) for _, b in posted[:2]] + [report_order(json.loads(datagrams.sent[1][1]))]
    boot = orders[0][0]  # type: ignore[index]
    assert orders == [(boot, 1), (boot, 1), (boot, 2)]
    assert parse_report(json.loads(datagrams.sent[1][1])) == ("me", {"m": {"a": (2, 1, 100.0)}})
    # Every report counts once: posts, and datagrams but the two probes (their posts count).
    assert registry.get_sample_value("fleet_router_peer_reports_sent_total") == len(posted) + len(datagrams.sent) - 2


def test_an_answer_without_a_count_is_none() -> None:
    assert datagrams_taken(b'{"datagrams":7}') == 7
    for answer in (b"", b"{}", b"[]", b"not json", b'{"datagrams":-1}', b'{"datagrams":"7"}', b'{"datagrams":true}'):
        assert datagrams_taken(answer) is None


def test_the_tally_counts_datagrams_per_peer_and_forgets_the_oldest() -> None:
    tally = DatagramTally(max_peers=2)
    for peer in ("a", "a", "b", "c"):
        tally.add(peer)
    assert (tally.count("a"), tally.count("b"), tally.count("c")) == (0, 1, 1)   # "a" was heard from longest ago


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
    """A peer whose answers carry no count (a router from before it) never confirms: every
    heartbeat goes over HTTP, with a probe datagram beside it; a change goes as a datagram at once."""
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
        while not posted and loop.time() < deadline:    # the first round posts over HTTP, and probes
            await asyncio.sleep(0.005)
        assert posted and len(datagrams.sent) == 1
        a.start(10)                                     # a change, and the proxy says so
        sender.notify()
        while len(datagrams.sent) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.005)
        assert len(datagrams.sent) == 2 and len(posted) == 1
        assert loop.time() - posted[0] < HEARTBEAT_S    # went before the heartbeat was due
        while len(posted) < 3 and loop.time() < deadline:   # no change: only the heartbeats, over HTTP
            await asyncio.sleep(0.01)
        assert len(posted) >= 3 and len(datagrams.sent) - 1 - len(posted) in (0, 1)   # a probe per post
        assert posted[2] - posted[1] >= HEARTBEAT_S * 0.9   # not every interval_s
    finally:
        await sender.close()
