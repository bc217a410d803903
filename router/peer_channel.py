"""The peer channel: send this router's load to every peer router, off the request path.

Owns `PeerSender` (one asyncio task per router: every `interval_s`, this router's report,
`router.peer_load.own_report` over its `kv-aware` pools, goes to each peer when it changed, as a
signed UDP datagram where it can (`router.peer_datagram`), and at least every `HEARTBEAT_S` to
each peer's `POST /admin/v1/peer-load` with the admin bearer token, all peers at once), `ReportPoster` (the
thin aiohttp wrapper that does the I/O, replaced by a fake in tests) and the channel's
Prometheus series. Receiving is `router.admin`'s route, into `router.peer_load.PeerLoadView`.
Started and stopped by `router.app.RouterApp`'s lifespan when the router has peers
(`python -m router --peers URL,...`).

A send that fails (connect error, timeout, non-2xx) is counted by reason and not retried: the
next report, `interval_s` later, replaces it (reports are snapshots). A round never waits
longer than `timeout_s` on a peer, and a slow round delays the next rather than stacking them.
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

from router.background import BackgroundLoop, wake
from router.endpoint import EndpointState
from router.peer_datagram import PeerDatagrams, datagram_address
from router.peer_load import DEFAULT_PEER_INTERVAL_S, load_fingerprint, own_report

log = logging.getLogger(__name__)

DEFAULT_SEND_TIMEOUT_S = 0.5
"""Seconds one report may take to reach a peer before the send counts as failed."""

SEND_ERROR_REASONS = ("connect", "timeout", "status")
"""`reason` label values of `fleet_router_peer_report_errors_total`."""

PEER_LOAD_PATH = "/admin/v1/peer-load"

HEARTBEAT_S = 0.25
"""Seconds between two rounds that post the latest report to every peer over HTTP, changed or
not: while this router's load stands still it reports four times a second instead of every
`interval_s`, so an idle pair of routers costs little, a peer still hears of it well within
`router.peer_load.DEFAULT_PEER_MAX_AGE_S`, and where UDP is dropped a peer's view is at most
this old. Changes in between go as datagrams (`router.peer_datagram`)."""


class SendFailed(Exception):
    """A report did not reach a peer; `reason` is one of `SEND_ERROR_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Poster(Protocol):
    """Posts `body` (JSON) to `url`; raises `SendFailed`. The only I/O the sender does."""

    def __call__(self, url: str, body: bytes) -> Awaitable[None]: ...


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

    async def __call__(self, url: str, body: bytes) -> None:
        if self._session is None:
            raise SendFailed("connect", "poster not started")
        try:
            async with self._session.post(url, data=body, headers=self._headers) as response:
                await response.read()
                if response.status >= 300:
                    raise SendFailed("status", f"HTTP {response.status}")
        except asyncio.TimeoutError as err:
            raise SendFailed("timeout", str(err) or "timed out") from err
        except aiohttp.ClientError as err:
            raise SendFailed("connect", str(err)) from err


class PeerMetrics:
    """The channel's series: reports sent and failed (by reason), peers heard from recently."""

    def __init__(self, registry: CollectorRegistry, live_peers: Callable[[], int]) -> None:
        self.sent = Counter("fleet_router_peer_reports_sent",
                            "Load reports this router sent to a peer router, over HTTP or as a UDP datagram "
                            "(router.peer_channel).",
                            registry=registry)  # fmt: skip
        self.errors = Counter("fleet_router_peer_report_errors",
                              "Load reports that did not reach a peer router, by reason: connect, timeout, "
                              "status (not 2xx).", ["reason"], registry=registry)  # fmt: skip
        self.received = Counter("fleet_router_peer_reports_received",
                                "Load reports received from peer routers.", registry=registry)  # fmt: skip
        peers = Gauge("fleet_router_peers_live",
                      "Peer routers whose last load report is recent enough to count (router.peer_load).",
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
        self._last_posted_s = -float("inf")    # when the last report went over HTTP
        self.urls: list[str] = []
        self._addresses: list[tuple[str, int] | None] = []   # per url: where its datagrams go (None: HTTP only)
        self._dirty = True   # the load may have changed since the last round (`notify`)
        self._wake: asyncio.Future[None] | None = None
        self.set_peers(peers)

    def notify(self) -> None:
        """This router's load changed (the proxy calls this at every dispatch, first byte and
        finish): the next round runs as soon as `interval_s` after the last allows. Without
        calls, rounds run only at the `HEARTBEAT_S` posts."""
        self._dirty = True
        if self._wake is not None:
            wake(self._wake)

    def set_peers(self, peers: Sequence[str]) -> None:
        """Send to `peers` (base URLs) from the next round on (`router.peer_discovery` calls this
        when the peer set changes); a new peer gets a report over HTTP in that round, even if unchanged."""
        urls = [p.rstrip("/") + PEER_LOAD_PATH for p in peers]
        if urls != self.urls:
            self.urls = urls
            self._addresses = [datagram_address(u) for u in urls]
            self._last_body = b""
            self._last_posted_s = -float("inf")

    async def start(self) -> None:
        """Open the poster's session (a `ReportPoster`) and start sending (no-op if started)."""
        if isinstance(self._post, ReportPoster):
            await self._post.start()
        self._background.start()

    async def close(self) -> None:
        """Stop sending and close the poster's session."""
        await self._background.stop()
        if isinstance(self._post, ReportPoster):
            await self._post.close()

    async def _run(self) -> None:
        """Rounds at most every `interval_s`, each when the load changed (`notify`) or the next
        HTTP post is due: an idle router does not wake every `interval_s` (polling cost ~18 ms
        of CPU per second per router, docs/benchmarks.md "Router CPU: the peers' datagrams")."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            self._dirty = False
            try:
                await self.send_once(started)
            except Exception:  # the loop survives its parts
                log.exception("peer load report round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))
            if not self._dirty:
                woken = self._wake = loop.create_future()
                timer = loop.call_later(max(0.0, self._last_posted_s + HEARTBEAT_S - loop.time()), wake, woken)
                try:
                    await woken
                finally:
                    timer.cancel()
                    self._wake = None

    async def send_once(self, now_s: float | None = None) -> None:
        """One round (`now_s`: the loop's clock, seconds). A changed report goes to every peer as
        a datagram where it can (`router.peer_datagram`), else over HTTP; every `HEARTBEAT_S`
        the latest report also goes to every peer over HTTP, changed or not (the path that
        works where UDP is dropped). HTTP sends run concurrently."""
        if not self.urls:
            return
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
        post_all = now_s - self._last_posted_s >= HEARTBEAT_S
        if not changed and not post_all:
            return
        if post_all:
            self._last_posted_s = now_s
            posts = self.urls
        else:
            datagrams = self._datagrams
            posts = []
            for url, address in zip(self.urls, self._addresses):
                if address is not None and datagrams is not None and datagrams.send(address, body):
                    self.metrics.sent.inc()
                else:
                    posts.append(url)
            if len(posts) == len(self.urls):
                self._last_posted_s = now_s   # all went over HTTP anyway: the heartbeat counts from here
        if posts:
            await asyncio.gather(*(self._send(url, body) for url in posts))

    async def _send(self, url: str, body: bytes) -> None:
        try:
            await self._post(url, body)
        except SendFailed as err:
            self.metrics.errors.labels(err.reason).inc()
            return
        self.metrics.sent.inc()
