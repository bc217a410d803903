"""Peer routers found by name: the addresses of a name, resolved every few seconds, as peer URLs.

Owns `PeerDiscovery` (one asyncio task per router: every `interval_s` it resolves ``NAME``
through a `Resolver`, turns the addresses into the base URLs of the peer routers,
``http://ADDRESS:PORT``, this router's own addresses left out, and hands the set to
`router.signals.peer_channel.PeerSender.set_peers` when it changed), the pure set arithmetic
(`peer_urls`, `parse_dns_target`), the DNS resolver (`resolve_addresses`: the event loop's
``getaddrinfo``, which runs in the loop's thread pool, off the event loop) and the discovery's
Prometheus series. Started and stopped by `router.http.app.RouterApp`'s lifespan when the router
has ``--peers-dns NAME:PORT`` (DNS) or, in a router pod, ``--peers-endpoints SERVICE:PORT``
(the resolver `fleet.k8s.peer_endpoints.EndpointsPeers` reads the Service's Endpoints through the
Kubernetes API; injected by `fleet.k8s.routerpod`, since router/ imports nothing of Kubernetes).

With DNS, ``NAME`` is a headless Service selecting the router pods (the chart's
``<release>-router-peers``, publishNotReadyAddresses false): its A/AAAA records are the pod IPs
of the Ready router pods, so a router joins its peers' sets once it is Ready and leaves them when
it is not (at most `interval_s` plus the DNS cache's TTL later; CoreDNS answers with TTL 30 s by
default for a headless Service, "cache 30" in its Corefile). The Endpoints resolver reads the same
facts at their source, without cluster DNS. A name with no records (NXDOMAIN, no address, no
Endpoints object: `NoRecords`) is an empty peer set; any other resolution error (`OSError`) keeps
the last set, counted in ``fleet_router_peer_dns_errors_total`` and logged once while it lasts:
an outage of the name service does not cut the peer channel. Peers that stop answering drop out
of the load sum anyway (`router.signals.peer_load.DEFAULT_PEER_MAX_AGE_S`).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Collection, Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from router.signals.background import BackgroundLoop

log = logging.getLogger(__name__)

DEFAULT_PEER_DNS_INTERVAL_S = 5.0
"""Seconds between two resolutions of the peers' name: a new router pod gets its peers' load
within this (plus the DNS TTL) of turning Ready. Until then it routes on its own load alone, as
a router without peers does."""

SLOW_RESOLVE_S = 1.0
"""A resolution taking longer than this is logged as a warning."""

_NO_RECORDS = {getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA") if hasattr(socket, name)}
"""getaddrinfo's errors for a name that resolves to nothing (NXDOMAIN, or no A/AAAA record)."""


class NoRecords(Exception):
    """The name has no addresses (NXDOMAIN or no A/AAAA record): no peers, not a failure."""


class Resolver(Protocol):
    """Resolves `host` to its addresses (IPv4 or IPv6 literals); raises `NoRecords` when it has
    none and `OSError` when resolution failed. The only I/O the discovery does."""

    def __call__(self, host: str, port: int) -> Awaitable[list[str]]: ...


async def resolve_addresses(host: str, port: int) -> list[str]:
    """The addresses of `host` (A and AAAA records, via the event loop's ``getaddrinfo`` in its
    thread pool), in the resolver's order.

    Raises:
        NoRecords: the name resolves to nothing.
        OSError: resolution failed otherwise (e.g. ``EAI_AGAIN``: no DNS server answered).
    """
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        if err.errno in _NO_RECORDS:
            raise NoRecords(f"{host}: {err.strerror}") from err
        raise
    return [str(info[4][0]) for info in infos]


def parse_dns_target(target: str) -> tuple[str, int]:
    """``NAME:PORT`` (``[V6]:PORT`` for an IPv6 literal) as (name, port).

    Raises:
        ValueError: no port, a port outside 1-65535, or an empty name.
    """
    name, sep, port = target.strip().rpartition(":")
    if not sep or not name or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"peers DNS target must be NAME:PORT with a port in 1-65535, got {target!r}")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    return name, int(port)


def _canonical(address: str) -> str:
    """`address` in its canonical text form (IPv6 compressed, zone kept); non-IPs unchanged."""
    bare, sep, zone = address.partition("%")
    try:
        return str(ipaddress.ip_address(bare)) + sep + zone
    except ValueError:
        return address


def peer_urls(addresses: Iterable[str], port: int, self_addresses: Collection[str]) -> list[str]:
    """Base URLs ``http://ADDRESS:PORT`` of the peers at `addresses` (IPv6 in brackets), without
    duplicates and without this router's own `self_addresses`, sorted. Pure."""
    own = {_canonical(a) for a in self_addresses}
    peers = {_canonical(a) for a in addresses} - own
    return sorted(f"http://[{a}]:{port}" if ":" in a else f"http://{a}:{port}" for a in peers)


class DiscoveryMetrics:
    """The discovery's series: peers found by the last resolution, failed resolutions."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.discovered = Gauge("fleet_router_peers_discovered",
                                "Peer routers found by the last resolution of --peers-dns or --peers-endpoints (this router "
                                "left out; router.signals.peer_discovery).", registry=registry)  # fmt: skip
        self.errors = Counter("fleet_router_peer_dns_errors",
                              "Resolutions of --peers-dns or --peers-endpoints that failed (the last peer set is kept).",
                              registry=registry)  # fmt: skip
        self.duration = Gauge("fleet_router_peer_dns_duration_seconds",
                              "Seconds the last resolution of --peers-dns or --peers-endpoints took.", registry=registry)  # fmt: skip


class PeerDiscovery:
    """Keeps the peer set equal to the routers that `host` resolves to (module docstring).

    Args:
        host, port: the name to resolve and the peers' admin API port (`parse_dns_target`).
        self_addresses: this router's own addresses (its pod IP), left out of the set.
        on_change: called with the new sorted peer URLs whenever the set changes (and once after
            the first resolution).
        metrics: where resolutions are counted.
        resolve: the I/O (`resolve_addresses`: DNS; `fleet.k8s.peer_endpoints.EndpointsPeers`: a
            Service's Endpoints; tests pass a fake).
        clock: monotonic seconds, for the duration metric.
        interval_s: seconds between the starts of two resolutions (`DEFAULT_PEER_DNS_INTERVAL_S`).

    Raises:
        ValueError: `interval_s` <= 0.
    """

    def __init__(self, host: str, port: int, self_addresses: Collection[str],
                 on_change: Callable[[list[str]], None], metrics: DiscoveryMetrics,
                 resolve: Resolver = resolve_addresses, clock: Callable[[], float] | None = None,
                 interval_s: float = DEFAULT_PEER_DNS_INTERVAL_S) -> None:  # fmt: skip
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.host, self.port = host, port
        self.self_addresses = tuple(self_addresses)
        self._on_change = on_change
        self.metrics = metrics
        self._resolve = resolve
        self._clock = clock
        self.interval_s = interval_s
        self.peers: list[str] | None = None
        """The current peer URLs; None before the first successful resolution."""
        self._last_error: str | None = None
        self._background = BackgroundLoop("peer-dns-discovery", self._run)

    async def start(self) -> None:
        """Resolve once now (so the router starts with its peers), then every `interval_s`."""
        try:
            await self.resolve_once()
        except Exception:  # a bad name or resolver bug must not stop the router from serving
            log.exception("peer discovery failed")
        self._background.start()

    async def close(self) -> None:
        """Stop resolving."""
        await self._background.stop()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.interval_s)
            started = loop.time()
            try:
                await self.resolve_once()
            except Exception:  # the loop survives its parts
                log.exception("peer discovery round failed")
            if loop.time() - started > SLOW_RESOLVE_S:
                log.warning("resolving %s took %.1f s", self.host, loop.time() - started)

    async def resolve_once(self) -> list[str] | None:
        """One resolution: update the peer set (calling `on_change` if it changed) and return it;
        on a resolution error keep the last set and return it (None if there was none yet)."""
        clock = self._clock or asyncio.get_running_loop().time
        started = clock()
        try:
            addresses = await self._resolve(self.host, self.port)
        except NoRecords:
            addresses = []
        except OSError as err:
            self.metrics.errors.inc()
            if str(err) != self._last_error:   # a lasting failure is logged once, each new one again
                log.warning("resolving peers at %s failed (keeping %d peers): %s", self.host, len(self.peers or ()), err)
            self._last_error = str(err)
            return self.peers
        finally:
            self.metrics.duration.set(clock() - started)
        self._last_error = None
        peers = peer_urls(addresses, self.port, self.self_addresses)
        if peers != self.peers:
            if self.peers is not None:
                log.info("peer routers at %s: %s (was %s)", self.host, peers, self.peers)
            self.peers = peers
            self.metrics.discovered.set(len(peers))
            self._on_change(peers)
        return peers
