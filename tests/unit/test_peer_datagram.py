"""The peer channel's UDP path: signed datagrams between two routers' sockets on loopback, the
sender's choice of datagram or HTTP, and the ordering that keeps a late datagram from replacing
a newer report (router.signals.peer_datagram, router.signals.peer_channel, router.signals.peer_load)."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import CollectorRegistry

from router.pools.endpoint import EndpointState
from router.signals.peer_channel import HEARTBEAT_S, PEER_LOAD_PATH, PeerMetrics, PeerSender, datagrams_taken
from router.kv.exact_index import Claim
from router.signals.peer_datagram import (MAC_BYTES, MAX_CLAIM_TTL_S, MAX_DATAGRAM_BYTES, DatagramMetrics, DatagramTally,
                                  PeerDatagrams, datagram_address, datagram_key, decode_claim, encode_claim, seal,
                                  unseal)  # fmt: skip
from router.signals.peer_load import PeerLoadView, parse_report, report_order
from tests.support.waits import async_wait_until


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

        await async_wait_until(lambda: rejected("signature") >= 1 and rejected("report") >= 1, 10,
                               what="a datagram rejected for its signature and one for its report")
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


async def test_a_peer_that_never_answers_holds_up_no_other_peers_reports() -> None:
    """Posts to 10.0.0.2 hang (a deleted pod's address that drops packets: the real poster gives
    up after its timeout, this one never does); 10.0.0.3's changes still go out as datagrams, one
    per change, and 10.0.0.2 is never posted to twice at once."""
    hung = asyncio.Event()
    posted: list[str] = []

    async def post(url: str, body: bytes) -> int:
        posted.append(url)
        if "10.0.0.2" in url:
            await hung.wait()
        return 0

    a = endpoint("a")
    datagrams = Recorder()
    sender = PeerSender("me", ["http://10.0.0.2:8081", "http://10.0.0.3:8081"], lambda: {"m": (a,)}, post,
                        PeerMetrics(CollectorRegistry(), lambda: 0), interval_s=0.01,
                        datagrams=datagrams)  # type: ignore[arg-type]  # fmt: skip
    fast = ("10.0.0.3", 8081)
    await sender.start()
    try:
        for n in range(1, 6):
            a.start(n)                                  # a change, and the proxy says so
            sender.notify()
            # the first round's probe, then one per change
            await async_wait_until(lambda: sum(1 for addr, _ in datagrams.sent if addr == fast) >= n + 1, 10,
                                   what=f"{n + 1} datagrams to 10.0.0.3")
        # a heartbeat later: 10.0.0.3 posted to again,
        await async_wait_until(lambda: sum(1 for url in posted if "10.0.0.3" in url) >= 2, 10,
                               what="a second post to 10.0.0.3")
        assert sum(1 for url in posted if "10.0.0.2" in url) == 1   # 10.0.0.2 not, its post still in flight
    finally:
        await sender.close()                            # cancels the hung post


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
        await async_wait_until(lambda: posted, 10, what="the first round's post")   # over HTTP, and a probe
        assert len(datagrams.sent) == 1
        a.start(10)                                     # a change, and the proxy says so
        sender.notify()
        await async_wait_until(lambda: len(datagrams.sent) >= 2, 10, what="the change sent as a datagram")
        assert len(datagrams.sent) == 2 and len(posted) == 1
        assert loop.time() - posted[0] < HEARTBEAT_S    # went before the heartbeat was due
        # no change: only the heartbeats, over HTTP
        await async_wait_until(lambda: len(posted) >= 3, 10, what="two heartbeat posts")
        assert len(datagrams.sent) - 1 - len(posted) in (0, 1)   # a probe per post
        assert posted[2] - posted[1] >= HEARTBEAT_S * 0.9   # not every interval_s
    finally:
        await sender.close()


def test_a_claim_round_trips_and_a_malformed_one_is_refused() -> None:
    keys = [0, 1, -1, 2**63 - 1, -(2**63), 123456789]
    body = encode_claim("m", "e0", keys, 9.5)
    assert decode_claim(body) == ("m", "e0", keys, 9.5)
    assert decode_claim(encode_claim("m", "e0", keys, 3600.0))[3] == MAX_CLAIM_TTL_S
    assert decode_claim(encode_claim("m", "e0", keys, -1.0))[3] == 0.0
    huge = encode_claim("m", "e0", list(range(10_000)), 1.0)   # more keys than a datagram holds
    assert len(huge) + MAC_BYTES <= MAX_DATAGRAM_BYTES and decode_claim(huge)[2] == list(range(len(decode_claim(huge)[2])))
    for bad in (b'{"router":"r"}', b"K" + b"{}" + b"\n", b'K{"model":"m","endpoint":"e0","ttl_s":1}\nabc',
                b'Knot json\n', b'K{"model":1,"endpoint":"e0","ttl_s":1}\n', b'K{"model":"m","endpoint":"e0","ttl_s":1}',
                b"K" + b"[" * 60_000 + b"\n"):   # nested past the recursion limit: refused, not RecursionError
        with pytest.raises(ValueError):
            decode_claim(bad)


async def test_claims_travel_beside_reports_on_the_same_socket() -> None:
    reports: list[bytes] = []
    claims: list[tuple] = []
    registry = CollectorRegistry()
    receiver = PeerDatagrams("tok", reports.append, DatagramMetrics(registry),
                             on_claim=lambda body: claims.append(decode_claim(body)))  # fmt: skip
    sender = PeerDatagrams("tok", reports.append, DatagramMetrics(CollectorRegistry()))
    await receiver.start("127.0.0.1", 0)
    await sender.start("127.0.0.1", 0)
    port = receiver._transport.get_extra_info("sockname")[1]  # type: ignore[union-attr]
    try:
        assert sender.send_claim(("127.0.0.1", port), encode_claim("m", "e0", [7, 8], 5.0))
        assert sender.send_claim(("127.0.0.1", port), b"K{broken")
        assert sender.send(("127.0.0.1", port), b'{"router":"a"}')

        def rejected() -> float:
            return registry.get_sample_value("fleet_router_peer_datagrams_rejected_total", {"reason": "claim"}) or 0

        await async_wait_until(lambda: claims and rejected() >= 1 and reports, 10,
                               what="a claim, a rejected claim and a report received")
        assert claims == [("m", "e0", [7, 8], 5.0)] and reports == [b'{"router":"a"}'] and rejected() == 1
        assert sender.metrics.claims_sent._value.get() == 2   # type: ignore[attr-defined]
    finally:
        receiver.close()
        sender.close()


async def test_the_sender_sends_a_claim_at_once_to_the_peers_it_reaches_by_datagram() -> None:
    class ClaimRecorder(Recorder):
        def send_claim(self, address: tuple[str, int], body: bytes) -> bool:
            self.sent.append((address, body))
            return True

    datagrams = ClaimRecorder()

    async def post(url: str, body: bytes) -> int:
        return 0

    sender = PeerSender("me", ["http://10.0.0.5:8081", "http://router-b.svc:8081"], dict, post,
                        PeerMetrics(CollectorRegistry(), lambda: 0), datagrams=datagrams)  # type: ignore[arg-type]
    sender.send_claim("m", Claim("e0", [1, 2, 3], until_s=105.0), now_s=100.0)
    assert [(a, decode_claim(b)) for a, b in datagrams.sent] == [(("10.0.0.5", 8081), ("m", "e0", [1, 2, 3], 5.0))]
    PeerSender("me", ["http://10.0.0.5:8081"], dict, post, PeerMetrics(CollectorRegistry(), lambda: 0)).send_claim(
        "m", Claim("e0", [1], 1.0), 0.0)   # no datagram socket: nothing to send, no error
