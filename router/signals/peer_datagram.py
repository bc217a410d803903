"""The peer channel's fast path: load reports as signed UDP datagrams.

Owns `PeerDatagrams`: one UDP socket per router, bound to the port number its admin API listens
on (UDP and TCP ports are separate namespaces, so a peer that knows the admin URL
``http://10.0.0.5:8081`` sends to UDP ``10.0.0.5:8081``). `router.signals.peer_channel.PeerSender` sends
each changed report on it (`send`); reports that arrive go to the same handler as
``POST /admin/v1/peer-load`` (`router.http.app.create_app`'s ``peer_report``). Opened by
`router.http.app.RouterApp.listening` once the HTTP listener is bound; closed with the app.

**Why.** A report over HTTP cost ~320 us of the sender's CPU (aiohttp) and ~215 us of the
receiver's, measured on the 2-core dev machine (docs/benchmarks.md, "Router CPU with KV events"):
with two routers changing their load three times per request that is ~2.8 ms of router CPU per
request on HTTP alone. A datagram costs a `sendto` and an HMAC on each side.

**What stays on HTTP.** The sender also posts its latest report over HTTP, every
`router.signals.peer_channel.HEARTBEAT_S` to a peer that has not confirmed it takes this router's
datagrams and every `router.signals.peer_channel.HTTP_HEARTBEAT_S` to one that has: a peer answers a post
with how many of the sender's datagrams it took (`DatagramTally`), and a count that grew since the
last answer confirms the path. So a path that drops UDP (a NetworkPolicy admitting TCP only)
delays what a peer knows by about a second at most instead of cutting it off; reports too large
for one datagram (`MAX_DATAGRAM_BYTES`) and peers named by host name rather than address go over
HTTP only. Reports carry ``boot`` and ``seq`` (`router.signals.peer_load`), so a late datagram never
replaces a newer report.

**Claims.** The same socket carries each dispatch's claim (`router.kv.exact_index.Claim`: the blocks
of a prompt sent for prefill that the engine has not reported stored), sent at once to every
peer with an address (`router.signals.peer_channel.PeerSender.send_claim`) and taken into the pool's KV
view (`ExactIndex.expect_keys`), so that a peer too sends the next request sharing the prefix
where it is being computed (docs/routing.md, "Prefixes on their way"). A claim is a hint: it has
no HTTP path. Its keys are Python's hash of a tuple of ints, the same in every router process of
one Python version (the router image's).

**Wire.** ``HMAC-SHA256(key, body) || body``: 32 bytes of MAC, then the report's JSON (or a claim,
`encode_claim`). The key is
derived from the admin token (`datagram_key`): only a holder of the token can send a report, as
only a holder can post one. A datagram that is short, badly signed, not JSON or not a report is
dropped and counted (``fleet_router_peer_datagrams_rejected_total{reason}``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter

from router.protocol.jsonlimit import loads_bounded

log = logging.getLogger(__name__)

MAC_BYTES = 32
MAX_DATAGRAM_BYTES = 60_000
"""Largest datagram sent (MAC included): under UDP's 65,507-byte payload limit over IPv4. A report
of about 1,500 endpoints fits; a larger one goes over HTTP."""

REJECT_REASONS = ("short", "signature", "report", "claim")
"""`reason` label values of `fleet_router_peer_datagrams_rejected_total`."""

CLAIM_MARK = b"K"
"""First byte of a claim's body (a load report's is ``{``)."""

CLAIM_HEAD_DEPTH = 2
"""Deepest nesting a claim's JSON head may have (it is one flat object): a deeper one is refused
before `json.loads` recurses into it."""

MAX_CLAIM_TTL_S = 60.0
"""Longest a claim taken from a peer lasts, whatever its ``ttl_s`` says."""


def encode_claim(model: str, endpoint_id: str, keys: Sequence[int], ttl_s: float) -> bytes:
    """A claim's body (`router.kv.exact_index.Claim`): ``K``, a JSON head ``{"model", "endpoint",
    "ttl_s"}``, a newline, then the router keys as signed 64-bit little-endian ints, in prompt
    order. Keys beyond what one datagram holds (~7,400: a 118,000-token prompt at 16-token
    blocks) are left out, the last first."""
    head = json.dumps({"model": model, "endpoint": endpoint_id, "ttl_s": round(max(0.0, ttl_s), 3)},
                      separators=(",", ":")).encode()  # fmt: skip
    room = (MAX_DATAGRAM_BYTES - MAC_BYTES - len(CLAIM_MARK) - len(head) - 1) // 8
    packed = array("q", keys[:room])
    if sys.byteorder == "big":
        packed.byteswap()
    return CLAIM_MARK + head + b"\n" + packed.tobytes()


def decode_claim(body: bytes) -> tuple[str, str, list[int], float]:
    """(model, endpoint id, keys, ttl in seconds, at most `MAX_CLAIM_TTL_S`) of a claim's body.

    Raises:
        ValueError: not a claim (mark, head or key bytes malformed).
    """
    if not body.startswith(CLAIM_MARK):
        raise ValueError("not a claim")
    head, sep, packed = body[len(CLAIM_MARK):].partition(b"\n")
    try:
        doc = loads_bounded(head, CLAIM_HEAD_DEPTH)
    except ValueError as err:
        raise ValueError(f"claim head: {err}") from None
    if not sep or len(packed) % 8 or not isinstance(doc, dict):
        raise ValueError("claim: no head, or keys not 8 bytes each")
    model, endpoint_id, ttl_s = doc.get("model"), doc.get("endpoint"), doc.get("ttl_s")
    if not isinstance(model, str) or not isinstance(endpoint_id, str) or not isinstance(ttl_s, (int, float)):
        raise ValueError("claim head: model and endpoint must be strings, ttl_s a number")
    keys = array("q")
    keys.frombytes(packed)
    if sys.byteorder == "big":
        keys.byteswap()
    return model, endpoint_id, keys.tolist(), min(max(0.0, float(ttl_s)), MAX_CLAIM_TTL_S)


def datagram_key(admin_token: str) -> bytes:
    """The HMAC key of the datagrams, derived from the admin token (never the token itself)."""
    return hashlib.sha256(b"fleet-router-peer-load\0" + admin_token.encode()).digest()


def seal(key: bytes, body: bytes) -> bytes:
    """`body` signed for the wire: MAC then body."""
    return hmac.digest(key, body, "sha256") + body


def unseal(key: bytes, data: bytes) -> bytes:
    """The body of a sealed datagram.

    Raises:
        ValueError: shorter than a MAC ("short") or the MAC does not match ("signature"); the
            message is the reason.
    """
    if len(data) <= MAC_BYTES:
        raise ValueError("short")
    mac, body = data[:MAC_BYTES], data[MAC_BYTES:]
    if not hmac.compare_digest(mac, hmac.digest(key, body, "sha256")):
        raise ValueError("signature")
    return body


def datagram_address(url: str) -> tuple[str, int] | None:
    """(address, port) to send a peer's datagrams to, from its base URL; None when the URL names
    a host rather than an IP address (resolving it on every send would block the loop) or has
    no port."""
    try:
        parts = urlsplit(url)
        port = parts.port
        host = parts.hostname or ""
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return (host, port) if port else None


class DatagramTally:
    """Datagrams taken from each peer router, by the router id its reports carry: the count this
    router answers a peer's HTTP report with (``{"datagrams": N}``), by which the peer learns its
    datagrams arrive (`router.signals.peer_channel`). Remembers the `max_peers` ids heard from last (a
    peer that restarts may come back under a new id)."""

    def __init__(self, max_peers: int = 256) -> None:
        self.max_peers = max_peers
        self._counts: OrderedDict[str, int] = OrderedDict()

    def add(self, peer_id: str) -> None:
        """One more datagram taken from `peer_id`."""
        counts = self._counts
        counts[peer_id] = counts.get(peer_id, 0) + 1
        counts.move_to_end(peer_id)
        if len(counts) > self.max_peers:
            counts.popitem(last=False)

    def count(self, peer_id: str) -> int:
        """Datagrams taken from `peer_id` so far (0 if none, or forgotten)."""
        return self._counts.get(peer_id, 0)


class DatagramMetrics:
    """Datagrams sent and rejected (reports received are counted by the peer channel)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.sent = Counter("fleet_router_peer_datagrams_sent",
                            "Load reports this router sent to a peer router as a UDP datagram "
                            "(router.signals.peer_datagram).", registry=registry)  # fmt: skip
        self.rejected = Counter("fleet_router_peer_datagrams_rejected",
                                "UDP datagrams dropped on the peer port, by reason: short, signature "
                                "(not signed with this router's admin token), report (not a load report).",
                                ["reason"], registry=registry)  # fmt: skip
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        self.claims_sent = Counter("fleet_router_peer_claims_sent",
                                   "Claims of prompts this router sent to an endpoint for prefill "
                                   "(router.kv.exact_index.Claim) sent to a peer router as a UDP datagram.",
                                   registry=registry)  # fmt: skip
        self.claims_received = Counter("fleet_router_peer_claims_received",
                                       "Claims taken from peer routers into a pool's KV view "
                                       "(router.kv.exact_index.ExactIndex.expect_keys).", registry=registry)  # fmt: skip


class PeerDatagrams(asyncio.DatagramProtocol):
    """This router's UDP socket for load reports and claims: receives (into `on_report`,
    `on_claim`) and sends.

    Args:
        admin_token: the admin API's token (the MAC key is derived from it).
        on_report: takes a report's body (JSON bytes); raises ValueError for a bad one.
        metrics: where datagrams are counted.
        on_claim: takes a claim's body (`decode_claim`); raises ValueError for a bad one. None:
            claims are dropped.
    """

    def __init__(self, admin_token: str, on_report: Callable[[bytes], None], metrics: DatagramMetrics,
                 on_claim: Callable[[bytes], None] | None = None) -> None:  # fmt: skip
        self._key = datagram_key(admin_token)
        self._on_report = on_report
        self._on_claim = on_claim
        self.metrics = metrics
        self._transport: asyncio.DatagramTransport | None = None

    @property
    def open(self) -> bool:
        return self._transport is not None

    async def start(self, host: str, port: int) -> None:
        """Bind UDP `host:port` (the admin listener's); a port taken by another process is logged
        and the channel stays on HTTP (`open` is False)."""
        loop = asyncio.get_running_loop()
        try:
            await loop.create_datagram_endpoint(lambda: self, local_addr=(host, port))
        except OSError as err:
            log.warning("peer load reports stay on HTTP: cannot bind UDP %s:%d: %s", host, port, err)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

    def send(self, address: tuple[str, int], body: bytes) -> bool:
        """Send one report; False when it cannot go as a datagram (socket not open, too large)."""
        if self._transport is None or len(body) + MAC_BYTES > MAX_DATAGRAM_BYTES:
            return False
        self._transport.sendto(seal(self._key, body), address)
        self.metrics.sent.inc()
        return True

    def send_claim(self, address: tuple[str, int], body: bytes) -> bool:
        """Send one claim (`encode_claim`); False when the socket is not open. A claim is a hint:
        it has no HTTP path, and one lost is a prefix the peer may compute twice."""
        if self._transport is None or len(body) + MAC_BYTES > MAX_DATAGRAM_BYTES:
            return False
        self._transport.sendto(seal(self._key, body), address)
        self.metrics.claims_sent.inc()
        return True

    # ----- asyncio.DatagramProtocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        try:
            body = unseal(self._key, data)
        except ValueError as err:
            self.metrics.rejected.labels(str(err)).inc()
            return
        if body.startswith(CLAIM_MARK):
            try:
                if self._on_claim is not None:
                    self._on_claim(body)
            except ValueError:
                self.metrics.rejected.labels("claim").inc()
            return
        try:
            self._on_report(body)
        except ValueError:
            self.metrics.rejected.labels("report").inc()

    def error_received(self, exc: Exception) -> None:
        """An ICMP error for an earlier send (a peer's port closed): the next report tries again."""
        log.debug("peer load datagram: %s", exc)
