"""The peer channel: send this router's load to every peer router, off the request path.

Owns `PeerSender` (one asyncio task per router: at most every `interval_s`, this router's report,
`router.signals.peer_load.own_report` over its `kv-aware` pools, goes to each peer when it changed, as a
signed UDP datagram where it can (`router.signals.peer_datagram`), and to each peer at least every
`HEARTBEAT_S`: over HTTP (`POST /admin/v1/peer-load` with the admin bearer token) until the peer
confirms it takes this router's datagrams, then as a datagram, with an HTTP post every
`HTTP_HEARTBEAT_S`), `ReportPoster` (the thin aiohttp wrapper that does the I/O, replaced by a
fake in tests) and the channel's Prometheus series. A peer confirms with its answer to a post,
``{"datagrams": N}``, the datagrams it took from this router so far: a count that grew since the
previous answer. A count that stopped growing (UDP dropped on the way) puts the peer back on HTTP
at every heartbeat. Receiving is `router.http.admin`'s route, into `router.signals.peer_load.PeerLoadView`.
Started and stopped by `router.http.app.RouterApp`'s lifespan when the router has peers
(`python -m router --peers URL,...`).

A send that fails (connect error, timeout, non-2xx) is counted by reason and not retried: the
next report, `interval_s` later, replaces it (reports are snapshots). A round does not wait for
its posts, and a peer has at most one post in flight: a peer that stops answering (each post
gives up after `timeout_s`) delays no other peer's reports, and its posts do not stack up.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Gauge

from router.signals.background import BackgroundLoop, wake
from router.pools.endpoint import EndpointState
from router.kv.exact_index import Claim
from router.signals.peer_datagram import PeerDatagrams, datagram_address, encode_claim
from router.signals.peer_load import DEFAULT_PEER_INTERVAL_S, load_fingerprint, own_report

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 0.5
"""Seconds one report may take to reach a peer before the send counts as failed."""

SEND_ERROR_REASONS = ("connect", "timeout", "status")
"""`reason` label values of `fleet_router_peer_report_errors_total`."""

PEER_LOAD_PATH = "/admin/v1/peer-load"

HEARTBEAT_S = 0.25
"""Longest time (seconds) between two reports to a peer, changed or not: while this router's load
stands still it reports four times a second instead of every `interval_s`, so an idle pair of
routers costs little and a peer still hears of it well within
`router.signals.peer_load.DEFAULT_PEER_MAX_AGE_S`. Over HTTP to a peer that has not confirmed it takes
this router's datagrams, as a datagram to one that has."""

HTTP_HEARTBEAT_S = 1.0
"""Seconds between two HTTP posts to a peer that confirmed it takes this router's datagrams: the
path that still works where UDP starts being dropped, and what tells the sender so (the peer's
count stops growing). At `router.signals.peer_load.DEFAULT_PEER_MAX_AGE_S`, so such a peer's view lapses
for at most about a heartbeat before it is back on HTTP. A post costs ~320 us of the sender's CPU
and ~215 us of the receiver's, a datagram a fraction of that (docs/benchmarks.md, "Router CPU:
the peers' datagrams")."""


class SendFailed(Exception):
    """A report did not reach a peer; `reason` is one of `SEND_ERROR_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Poster(Protocol):
    """Posts `body` (JSON) to `url` and returns the ``datagrams`` count of the answer (None if it
    carries none: a router that does not count datagrams); raises `SendFailed`. The only I/O the sender
    does besides datagrams."""

    def __call__(self, url: str, body: bytes) -> Awaitable[int | None]: ...


class ReportPoster:
    """`POST {url}` with the admin bearer token over one aiohttp session of its own."""

    def __init__(self, admin_token: str, timeout_s: float = DEFAULT_SEND_TIMEOUT_S) -> None:
        self._headers = {"authorization": f"Bearer {admin_token}", "content-type": "application/json"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, url: str, body: bytes) -> int | None:
        if self._session is None:
            raise SendFailed("connect", "poster not started")
        try:
            async with self._session.post(url, data=body, headers=self._headers) as response:
                answer = await response.read()
                if response.status >= 300:
                    raise SendFailed("status", f"HTTP {response.status}")
        except asyncio.TimeoutError as err:
            raise SendFailed("timeout", str(err) or "timed out") from err
        except aiohttp.ClientError as err:
            raise SendFailed("connect", str(err)) from err
        return datagrams_taken(answer)


def datagrams_taken(answer: bytes) -> int | None:
    """The ``datagrams`` count of a peer's answer to a report (None: not there, or not a count)."""
    try:
        taken = json.loads(answer).get("datagrams") if answer else None
    except (ValueError, AttributeError):
        return None
    return taken if type(taken) is int and taken >= 0 else None


class _Peer:
    """What the sender keeps per peer (seconds on the loop's clock)."""

    __slots__ = ("url", "address", "posted_s", "datagram_s", "taken", "confirmed", "post")

    def __init__(self, url: str) -> None:
        self.url = url
        self.address = datagram_address(url)   # where its datagrams go (None: HTTP only)
        self.posted_s = -float("inf")          # the last post over HTTP
        self.datagram_s = -float("inf")        # the last datagram
        self.taken = 0                         # its last answer's count of our datagrams
        self.confirmed = False                 # that count grew at the last answer
        self.post: asyncio.Task[None] | None = None   # the post in flight (at most one)

    def posting(self) -> bool:
        """Whether a post to this peer is still in flight."""
        return self.post is not None and not self.post.done()

    def heartbeat_due_s(self) -> float:
        """When this peer is next owed a report if nothing changes."""
        return max(self.posted_s, self.datagram_s if self.confirmed else -float("inf")) + HEARTBEAT_S


class PeerMetrics:
    """The channel's series: reports sent and failed (by reason), peers heard from recently."""

    def __init__(self, registry: CollectorRegistry, live_peers: Callable[[], int]) -> None:
        self.sent = Counter("fleet_router_peer_reports_sent",
                            "Load reports this router sent to a peer router, over HTTP or as a UDP datagram "
                            "(router.signals.peer_channel).",
                            registry=registry)  # fmt: skip
        self.errors = Counter("fleet_router_peer_report_errors",
                              "Load reports that did not reach a peer router, by reason: connect, timeout, "
                              "status (not 2xx).", ["reason"], registry=registry)  # fmt: skip
        self.received = Counter("fleet_router_peer_reports_received",
                                "Load reports received from peer routers.", registry=registry)  # fmt: skip
        peers = Gauge("fleet_router_peers_live",
                      "Peer routers whose last load report is recent enough to count (router.signals.peer_load).",
                      registry=registry)  # fmt: skip
        peers.set_function(live_peers)


class PeerSender:
    """Sends this router's load report to every peer every `interval_s` (module docstring).

    Args:
        router_id: this router's id in its reports (unique among the peers).
        peers: base URLs of the peer routers (no trailing slash needed).
        endpoints: the endpoints to report, by model (`PoolTable.load_endpoints`).
        post: the I/O (a `ReportPoster`; tests pass a fake).
        metrics: where sends are counted.
        interval_s: seconds between the starts of two rounds (`DEFAULT_PEER_INTERVAL_S`).

    Raises:
        ValueError: `interval_s` <= 0.
    """

    def __init__(self, router_id: str, peers: Sequence[str],
                 endpoints: Callable[[], dict[str, tuple[EndpointState, ...]]], post: Poster, metrics: PeerMetrics,
                 interval_s: float = DEFAULT_PEER_INTERVAL_S, datagrams: PeerDatagrams | None = None) -> None:  # fmt: skip
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.router_id = router_id
        self._endpoints = endpoints
        self._post = post
        self.metrics = metrics
        self.interval_s = interval_s
        self._datagrams = datagrams
        self._background = BackgroundLoop("peer-load-sender", self._run)
        self._boot = secrets.token_hex(8)
        self._seq = 0
        self._last_body = b""
        self._last_load: tuple | None = None   # `load_fingerprint` of `_last_body`
        self.urls: list[str] = []
        self._peers: list[_Peer] = []
        self._dirty = True   # the load may have changed since the last round (`notify`)
        self._posts: set[asyncio.Task[None]] = set()   # posts in flight, to every peer (`close` cancels them)
        self._wake: asyncio.Future[None] | None = None
        self.set_peers(peers)

    def notify(self) -> None:
        """This router's load changed (`router.request.attempt` and `router.request.relay` call
        this at every dispatch, first byte and finish, through
        `router.request.proxy.Proxy.on_load_change`): the next round runs as soon as `interval_s`
        after the last allows. Without calls, rounds run only at the `HEARTBEAT_S` posts."""
        self._dirty = True
        if self._wake is not None:
            wake(self._wake)

    def confirmed(self) -> list[str]:
        """Base URLs of the peers that confirmed, at their last answer, that they take this
        router's datagrams (their heartbeat goes as a datagram; `GET /admin/v1/peers`)."""
        return [peer.url.removesuffix(PEER_LOAD_PATH) for peer in self._peers if peer.confirmed]

    def set_peers(self, peers: Sequence[str]) -> None:
        """Send to `peers` (base URLs) from the next round on (`router.signals.peer_discovery` calls this
        when the peer set changes); a new peer gets a report over HTTP in that round, even if
        unchanged; a peer already known keeps what it confirmed."""
        urls = [p.rstrip("/") + PEER_LOAD_PATH for p in peers]
        if urls != self.urls:
            known = {peer.url: peer for peer in self._peers}
            self.urls = urls
            self._peers = [known.get(u) or _Peer(u) for u in urls]
            if self._wake is not None:
                wake(self._wake)

    def send_claim(self, model: str, claim: Claim, now_s: float) -> None:
        """Send `claim` (made by `model`'s policy at this dispatch, `now_s` on the clock its
        `until_s` is on) at once to every peer reached by datagrams (`router.signals.peer_datagram`):
        only a datagram, never HTTP. No-op without a datagram socket."""
        datagrams = self._datagrams
        if datagrams is None or not self._peers:
            return
        body = encode_claim(model, claim.endpoint_id, claim.keys, claim.until_s - now_s)
        for peer in self._peers:
            if peer.address is not None:
                datagrams.send_claim(peer.address, body)

    async def start(self) -> None:
        """Open the poster's session (a `ReportPoster`) and start sending (no-op if started)."""
        if isinstance(self._post, ReportPoster):
            await self._post.start()
        self._background.start()

    async def close(self) -> None:
        """Stop sending, cancel the posts in flight and close the poster's session."""
        await self._background.stop()
        for task in list(self._posts):
            task.cancel()
        await asyncio.gather(*self._posts, return_exceptions=True)
        if isinstance(self._post, ReportPoster):
            await self._post.close()

    async def _run(self) -> None:
        """Rounds at most every `interval_s`, each when the load changed (`notify`) or some peer's
        heartbeat is due: an idle router does not wake every `interval_s` (polling cost ~18 ms
        of CPU per second per router, docs/benchmarks.md "Router CPU: the peers' datagrams")."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._dirty = False
            try:
                self._round(started)   # its posts go on as tasks: a peer that does not answer holds up no round
            except Exception:  # the loop survives its parts
                log.exception("peer load report round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
            if not self._dirty:
                woken = self._wake = loop.create_future()
                due_s = min((peer.heartbeat_due_s() for peer in self._peers), default=loop.time() + HEARTBEAT_S)
                timer = loop.call_later(max(0.0, due_s - loop.time()), wake, woken)
                try:
                    await woken
                finally:
                    timer.cancel()
                    self._wake = None

    async def send_once(self, now_s: float | None = None) -> None:
        """One round (`now_s`: the loop's clock, seconds), and wait for its posts. A changed report
        goes to every peer as a datagram where it can (`router.signals.peer_datagram`), else over HTTP; a
        peer owed its heartbeat gets the latest report, changed or not, over HTTP if it has not
        confirmed our datagrams (then with a datagram beside it, which its answer will count) or if
        its `HTTP_HEARTBEAT_S` is up, else as a datagram. A peer with a post still in flight gets
        no other post: the report goes as a datagram where it can, else waits for a later round.
        HTTP sends run concurrently. The sender's own loop runs the same round without waiting."""
        posts = self._round(now_s)
        if posts:
            await asyncio.wait(posts)

    def _round(self, now_s: float | None = None) -> list[asyncio.Task[None]]:
        """`send_once`'s round: the datagrams sent, the posts started (returned, not awaited)."""
        if not self._peers:
            return []
        if now_s is None:
            now_s = asyncio.get_running_loop().time()
        endpoints = self._endpoints()
        load = load_fingerprint(endpoints)   # checked every round; the JSON only when it changed
        changed = load != self._last_load or not self._last_body
        if changed:
            self._seq += 1
            report = own_report(self.router_id, endpoints, (self._boot, self._seq))
            self._last_body, self._last_load = json.dumps(report, separators=(",", ":")).encode(), load
        body = self._last_body
        datagrams = self._datagrams
        posts: list[asyncio.Task[None]] = []
        for peer in self._peers:
            if not changed and now_s < peer.heartbeat_due_s():
                continue
            busy = peer.posting()
            if not busy and now_s - peer.posted_s >= (HTTP_HEARTBEAT_S if peer.confirmed else HEARTBEAT_S):
                posts.append(self._start_post(peer, body, now_s))
                if not peer.confirmed and peer.address is not None and datagrams is not None:
                    if datagrams.send(peer.address, body):   # a probe: the post's answer counts it
                        peer.datagram_s = now_s
                continue
            if peer.address is not None and datagrams is not None and datagrams.send(peer.address, body):
                peer.datagram_s = now_s
                self.metrics.sent.inc()
            elif not busy:
                posts.append(self._start_post(peer, body, now_s))
        return posts

    def _start_post(self, peer: _Peer, body: bytes, now_s: float) -> asyncio.Task[None]:
        peer.posted_s = now_s
        task = peer.post = asyncio.get_running_loop().create_task(self._send(peer, body))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)
        return task

    async def _send(self, peer: _Peer, body: bytes) -> None:
        try:
            taken = await self._post(peer.url, body)
        except SendFailed as err:
            self.metrics.errors.labels(err.reason).inc()
            return
        except Exception:  # a task of its own: nothing above it would log this
            log.exception("peer load report to %s failed", peer.url)
            return
        self.metrics.sent.inc()
        if taken is None:
            peer.confirmed = False
            return
        peer.confirmed = taken > peer.taken
        peer.taken = taken
