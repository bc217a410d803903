"""Poll each endpoint's `/metrics` for its load, off the request path.

Owns `EnginePoller` (one asyncio task per router: every `interval_s`, a `GET /metrics` to each
endpoint of every pool whose policy reads the engines' load, parsed by
`router.signals.engine_load.parse_engine_load` and turned into the endpoint's `EndpointState.others_*` by
one `router.signals.engine_load.EngineLoadView`), `EngineMetricsFetcher` (the thin aiohttp wrapper that
does the I/O, replaced by a fake in tests) and the poller's Prometheus series. Started and
stopped by `router.http.app.RouterApp`'s lifespan; reads the pools from `router.pools.pool.PoolTable`.

A poll that fails (connect error, timeout, non-200, a text without vLLM's gauges) is counted by
reason and changes nothing: the endpoint's estimate expires `max_age_s` after its last good
sample and `kv-aware` then counts only this router's own load there. A round does not wait for
its polls, and an endpoint has at most one poll in flight: an engine that stops answering (a
stalled engine whose `/metrics` hangs until `timeout_s`) delays no other endpoint's samples, and
its polls do not stack up.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Iterator
from typing import Protocol

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from router.signals.background import BackgroundLoop
from router.pools.endpoint import EndpointState
from router.signals.engine_load import DEFAULT_MAX_AGE_S, DEFAULT_POLL_INTERVAL_S, EngineLoadError, EngineLoadView, \
    parse_engine_load

log = logging.getLogger(__name__)

DEFAULT_POLL_TIMEOUT_S = 0.5
"""Seconds one `/metrics` poll may take before it counts as failed (a loaded vLLM answers in a
few milliseconds; its exposition is ~40 KB)."""

MAX_CONCURRENT_POLLS = 64
"""Most `/metrics` polls in flight at once: a pool of thousands of endpoints is polled less often
(an endpoint whose poll still waits for a slot is not polled again) instead of in one burst."""

POLL_ERROR_REASONS = ("connect", "timeout", "status", "parse")
"""`reason` label values of `fleet_router_engine_load_poll_errors_total`."""


class PollFailed(Exception):
    """A `/metrics` poll failed; `reason` is one of `POLL_ERROR_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Fetcher(Protocol):
    """Returns the text of `url`; raises `PollFailed`. The only I/O the poller does."""

    def __call__(self, url: str) -> Awaitable[str]: ...


class EngineMetricsFetcher:
    """`GET {url}` over one aiohttp session of its own (not the proxy's), `timeout_s` in all.

    `start()` opens the session, `close()` closes it; a call raises `PollFailed` with the reason.
    """

    def __init__(self, timeout_s: float = DEFAULT_POLL_TIMEOUT_S) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, url: str) -> str:
        if self._session is None:
            raise PollFailed("connect", "fetcher not started")
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise PollFailed("status", f"HTTP {response.status}")
                return await response.text()
        except asyncio.TimeoutError as err:
            raise PollFailed("timeout", str(err) or "timed out") from err
        except aiohttp.ClientError as err:
            raise PollFailed("connect", str(err)) from err


class PollMetrics:
    """The poller's series: polls by result, poll duration, and at scrape time the age of each
    model's oldest sample among its polled endpoints (`+Inf` for an endpoint never sampled)."""

    def __init__(self, registry: CollectorRegistry, ages: Callable[[], dict[str, float]]) -> None:
        self.polls = Counter("fleet_router_engine_load_polls",
                             "Polls of an endpoint's /metrics for its load (router.signals.engine_poll).",
                             registry=registry)  # fmt: skip
        self.errors = Counter("fleet_router_engine_load_poll_errors",
                              "Failed polls of an endpoint's /metrics, by reason: connect, timeout, status "
                              "(not 200), parse (no vLLM load gauges).", ["reason"], registry=registry)  # fmt: skip
        self.duration = Histogram("fleet_router_engine_load_poll_seconds",
                                  "Seconds one /metrics poll of an endpoint took (successful ones).",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
                                  registry=registry)  # fmt: skip
        self._ages = ages
        registry.register(self)  # type: ignore[arg-type]  # duck-typed Collector

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("fleet_router_engine_load_age_seconds", "", labels=["model"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "fleet_router_engine_load_age_seconds",
            "Seconds since the oldest good load sample among a model's polled endpoints (+Inf: an "
            "endpoint never sampled). Past the estimate's max age kv-aware counts only this router's load.",
            labels=["model"])  # fmt: skip
        for model, age_s in sorted(self._ages().items()):
            family.add_metric([model], age_s)
        yield family


class EnginePoller:
    """Polls the load of every endpoint whose pool's policy reads it (`uses_engine_load`).

    Args:
        endpoints: returns the endpoints to poll now, by model (`PoolTable.load_endpoints`).
        clock: the router's monotonic clock (seconds): the sample's `now_s`.
        registry: where `PollMetrics` registers.
        fetch: the I/O (default `EngineMetricsFetcher(timeout_s)`; tests pass a fake).
        interval_s: seconds between the starts of two rounds (`DEFAULT_POLL_INTERVAL_S`).
        max_age_s: how long a sample's estimate is used (`DEFAULT_MAX_AGE_S`).
        timeout_s: most seconds one poll may take (`DEFAULT_POLL_TIMEOUT_S`).

    Raises:
        ValueError: `interval_s` or `timeout_s` <= 0.
    """

    def __init__(self, endpoints: Callable[[], dict[str, tuple[EndpointState, ...]]], clock: Callable[[], float],
                 registry: CollectorRegistry, *, fetch: Fetcher | None = None,
                 interval_s: float = DEFAULT_POLL_INTERVAL_S, max_age_s: float = DEFAULT_MAX_AGE_S,
                 timeout_s: float = DEFAULT_POLL_TIMEOUT_S) -> None:  # fmt: skip
        if interval_s <= 0 or timeout_s <= 0:
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s} and {timeout_s}")
        self._endpoints = endpoints
        self._clock = clock
        self.interval_s = interval_s
        self.view = EngineLoadView(max_age_s)
        self._fetcher = EngineMetricsFetcher(timeout_s) if fetch is None else None
        self._fetch: Fetcher = fetch if fetch is not None else self._fetcher  # type: ignore[assignment]
        self.metrics = PollMetrics(registry, self.ages)
        self._background = BackgroundLoop("engine-load-poller", self._run)
        self._slots: asyncio.Semaphore | None = None
        self._polling: dict[str, asyncio.Task[None]] = {}   # endpoint URL -> its poll in flight

    def ages(self) -> dict[str, float]:
        """Per model: seconds since the oldest good sample among its polled endpoints."""
        now_s = self._clock()
        out: dict[str, float] = {}
        for model, endpoints in self._endpoints().items():
            if endpoints:
                out[model] = max(now_s - (e.others_until_s - self.view.max_age_s) if e.others_until_s else math.inf
                                 for e in endpoints)  # fmt: skip
        return out

    async def start(self) -> None:
        """Open the fetcher's session and start polling (a no-op if already started)."""
        if self._fetcher is not None:
            await self._fetcher.start()
        self._background.start()

    async def close(self) -> None:
        """Stop polling, cancel the polls in flight and close the fetcher's session."""
        await self._background.stop()
        polls = list(self._polling.values())
        for task in polls:
            task.cancel()
        await asyncio.gather(*polls, return_exceptions=True)
        self._polling.clear()
        if self._fetcher is not None:
            await self._fetcher.close()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                self._round()   # its polls go on as tasks: an engine that does not answer holds up no round
            except Exception:  # the loop survives its parts (docs/STYLE: loops survive)
                log.exception("engine load poll round failed")
            await asyncio.sleep(max(0.0, self.interval_s - (loop.time() - started)))

    async def poll_once(self) -> None:
        """One round, and wait for its polls: poll every endpoint to poll now that has no poll in
        flight, concurrently (at most `MAX_CONCURRENT_POLLS`). The poller's own loop runs the same
        round without waiting."""
        polls = self._round()
        if polls:
            await asyncio.wait(polls)

    def _round(self) -> list[asyncio.Task[None]]:
        """`poll_once`'s round: the polls started (returned, not awaited)."""
        endpoints = [e for group in self._endpoints().values() for e in group]
        polling = self._polling
        for url in [u for u, task in polling.items() if task.done()]:
            del polling[url]
        if not endpoints:
            return []
        if self._slots is None:
            self._slots = asyncio.Semaphore(MAX_CONCURRENT_POLLS)
        loop = asyncio.get_running_loop()
        started = []
        for e in endpoints:
            if e.url not in polling:
                task = polling[e.url] = loop.create_task(self._poll(e, self._slots))
                started.append(task)
        return started

    async def _poll(self, endpoint: EndpointState, slots: asyncio.Semaphore) -> None:
        async with slots:
            started_s = self._clock()
            try:
                text = await self._fetch(endpoint.url + "/metrics")
            except PollFailed as err:
                self.metrics.errors.labels(err.reason).inc()
                return
            except Exception:  # a task of its own: nothing above it would log this
                log.exception("engine load poll of %s failed", endpoint.url)
                return
        try:
            sample = parse_engine_load(text)
        except EngineLoadError:
            self.metrics.errors.labels("parse").inc()
            return
        now_s = self._clock()
        self.metrics.polls.inc()
        self.metrics.duration.observe(now_s - started_s)
        self.view.observe(endpoint, sample, now_s)
