"""A router's connection to the endpoint picker: ask per request, fall back when it does not answer.

Owns `PickerClient`, `PickerTicket`, `Locate` and `parse_address` (``--picker HOST:PORT``).
`router.http.app.create_app` makes one when the router is started with `--picker HOST:PORT` (a
static address) or, in a router pod, with a `Locate` (the picker Service's ready address read
through the Kubernetes API, `fleet.k8s.service_endpoints.ServiceLocator`, injected by
`fleet.k8s.routerpod`: router/ never imports fleet/); `router.pools.pool.PoolTable` tells it every
pool (`put_pool`), and `router.request.proxy` asks it for the first pick of each request (`pick`)
and reports the request's first byte and end (`PickerTicket.first_byte`, `finish`). One TCP
connection, pipelined (`router.picker.wire`); reconnected with backoff (`RECONNECT_MIN_S` doubling
to `RECONNECT_MAX_S`, reset only by a connection that brought an answer, so a proxy that accepts
and closes with no picker behind it is not spun against); every pool is sent again on each
connection. With a `Locate`, the address is asked before each connection and every
`DEFAULT_LOCATE_INTERVAL_S` while connected: when it changes (an HA failover moved the Service's
ready address to the new leader) the connection is closed and the next one goes to the new
address; when the locator fails the last address is kept; when it finds none the router picks
alone until it finds one. A pick not answered within `DEFAULT_DEADLINE_S`, or asked while the
connection is down, is the router's own (its policy on its own approximate index and load); a
late one is reported to the picker (`PLACED`), so the picker counts the request's load and claim
where it went.

Metrics on the router's registry: `fleet_router_picker_picks_total{outcome}` (`answered`; fell back:
`timed_out`, `unreachable`, `declined`: the picker has no such pool yet, or is a standby) and
`fleet_router_picker_pick_seconds` (round trip of the answered picks).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.kv.prompt_blocks import RouteRequest
from router.kv.prompt_keys import prompt_keys
from router.picker.wire import AnswerFrame, FrameReader, WireError, encode_finish, encode_first_byte, encode_pick, \
    encode_placed, encode_pool

log = logging.getLogger(__name__)

DEFAULT_DEADLINE_S = 0.005
"""How long a router waits for the picker's answer before it picks for itself (seconds): the
round trip on loopback is ~0.1-0.3 ms idle (docs/routing.md, "Endpoint picker"); a picker that
takes 5 ms is overloaded or gone, and the request does not wait for it."""
DEFAULT_BLOCK_TOKENS = 16
"""Block size the prompt's keys are chained with before the picker has said its engines' (vLLM's
default `--block-size`)."""
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 2.0
"""Backoff between two connection attempts: doubling from `RECONNECT_MIN_S` to `RECONNECT_MAX_S`."""
DEFAULT_LOCATE_INTERVAL_S = 2.0
"""Seconds between two reads of the picker's address while connected (with a `Locate`): an HA
failover is followed within this long after the Service's Endpoints changed (the new leader turns
Ready within its readiness probe's period, router-picker.yaml)."""
PICK_RTT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01)


Address = tuple[str, int]
Locate = Callable[[], Awaitable[Address | None]]
"""Where the picker is now: an async callable returning (host, port), or None when no picker is
ready. An OSError it raises means "unknown now": the client keeps the last address."""


def parse_address(target: str, flag: str = "--picker") -> Address:
    """``HOST:PORT`` (``[V6]:PORT`` for an IPv6 literal) as (host, port).

    Raises:
        ValueError: naming ``flag``: no port, a port outside 1-65535, or an empty host.
    """
    host, sep, port = target.strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{flag} must be HOST:PORT with a port in 1-65535, got {target!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


class PickerTicket:
    """One answered pick, held at the picker until `finish`: `first_byte()` once the request's
    first byte reaches the client, `finish()` when it leaves the endpoint (each at most once)."""

    __slots__ = ("_client", "_ticket", "_connection", "_sent_first")

    def __init__(self, client: PickerClient, ticket: int, connection: int) -> None:
        self._client = client
        self._ticket = ticket
        self._connection = connection
        self._sent_first = False

    def first_byte(self) -> None:
        if not self._sent_first:
            self._sent_first = True
            self._client.send_on(self._connection, encode_first_byte(self._ticket))

    def finish(self) -> None:
        self._client.send_on(self._connection, encode_finish(self._ticket))


class PickerClient:
    """The router's connection to the picker at `host`:`port`, or wherever `locate` says it is
    (module docstring); give one of the two.

    `start()` begins connecting (on the running loop); `close()` stops. `deadline_s`: the wait
    for an answer. `locate_interval_s`: seconds between two calls of `locate` while connected.
    `clock`: seconds, for the round-trip histogram. `registry`: where the metrics go (None: a
    private one). `host` and `port` are the address connected to last.

    Raises:
        ValueError: both or neither of `host` and `locate` given, or `locate_interval_s` not > 0.
    """

    def __init__(self, host: str = "", port: int = 0, *, locate: Locate | None = None,
                 locate_interval_s: float = DEFAULT_LOCATE_INTERVAL_S, deadline_s: float = DEFAULT_DEADLINE_S,
                 clock: Callable[[], float] = time.perf_counter,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        if bool(host) == (locate is not None):
            raise ValueError("PickerClient: give the picker's host and port, or a locate callable, not both or neither")
        if not locate_interval_s > 0:
            raise ValueError(f"locate_interval_s must be > 0 seconds, not {locate_interval_s:g}")
        self.host = host
        self.port = port
        self._locate = locate
        self.locate_interval_s = locate_interval_s
        self.deadline_s = deadline_s
        self._clock = clock
        r = registry if registry is not None else CollectorRegistry()
        picks = Counter("fleet_router_picker_picks", "Picks the router asked of the endpoint picker, by outcome: "
                        "answered, or timed_out, unreachable or declined (those fell back to the router's own pick).",
                        ["outcome"], registry=r)  # fmt: skip
        self._answered = picks.labels("answered")
        self._timed_out = picks.labels("timed_out")
        self._unreachable = picks.labels("unreachable")
        self._declined = picks.labels("declined")
        self._rtt = Histogram("fleet_router_picker_pick_seconds", "Round trip of the endpoint picker's answered "
                              "picks (seconds).", buckets=PICK_RTT_BUCKETS_S, registry=r)  # fmt: skip
        self._pools: dict[str, bytes] = {}
        self._block_tokens: dict[str, int] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._connection = 0
        self._answers = 0   # answer frames read, all connections
        self._waiting: dict[int, asyncio.Future[AnswerFrame | None]] = {}
        self._next_ticket = 0
        self._task: asyncio.Task[None] | None = None

    @property
    def connected(self) -> bool:
        """Whether the connection to the picker is open now."""
        return self._writer is not None

    def start(self) -> None:
        """Start connecting, and keep connected, on the running loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="picker-client")

    async def close(self) -> None:
        """Stop connecting and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def put_pool(self, model: str, policy: str, sources: dict[str, dict | None]) -> None:
        """`model`'s pool as the picker needs it (sent now if connected, and on every reconnect)."""
        frame = encode_pool(model, policy, sources)
        self._pools[model] = frame
        if self._writer is not None:
            self._writer.write(frame)

    async def pick(self, model: str, candidates: Sequence[str], request: RouteRequest,
                   fallback: Callable[[], int]) -> tuple[int, PickerTicket | None, bool]:  # fmt: skip
        """Ask the picker which of `candidates` (endpoint ids) serves `request`: (the chosen index,
        the ticket to report the request's progress on, whether the picker chose). When the
        picker answers, `request.cached_tokens` is set from its answer. When it is unreachable, or
        does not know the pool, `fallback()` (the router's own pick, an index into `candidates`)
        decides and there is no ticket; when it is late, `fallback()` decides and the picker is
        told where the request went (`PLACED`), so it keeps counting the request's load there."""
        writer = self._writer
        if writer is None:
            self._unreachable.inc()
            return fallback(), None, False
        keys: Sequence[int] = ()
        size = self._block_tokens.get(model, DEFAULT_BLOCK_TOKENS)
        if request.token_ids:
            with contextlib.suppress(TypeError):
                keys = prompt_keys(request.token_ids, size).keys
        self._next_ticket = ticket = (self._next_ticket + 1) & 0xFFFFFFFF
        connection = self._connection
        future: asyncio.Future[AnswerFrame | None] = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = future
        start_s = self._clock()
        writer.write(encode_pick(ticket, model, request.prompt_tokens, request.session_key, candidates,
                                 request.block_hashes, keys, size))  # fmt: skip
        try:
            answer = await asyncio.wait_for(future, self.deadline_s)
        except TimeoutError:
            self._waiting.pop(ticket, None)   # its answer, when it comes, is dropped
            self._timed_out.inc()
            index = fallback()
            self.send_on(connection, encode_placed(ticket, candidates[index]))
            return index, PickerTicket(self, ticket, connection), False
        if answer is None:   # the connection closed meanwhile: the picker released the pick
            self._unreachable.inc()
            return fallback(), None, False
        self._rtt.observe(self._clock() - start_s)
        if answer.block_tokens:
            self._block_tokens[model] = answer.block_tokens
        if answer.chosen < 0:   # the picker does not know the pool (yet)
            self._declined.inc()
            return fallback(), None, False
        self._answered.inc()
        request.cached_tokens = answer.cached_tokens
        return answer.chosen, PickerTicket(self, ticket, connection), True

    def send_on(self, connection: int, frame: bytes) -> None:
        """Write `frame` if the connection it belongs to is still the open one (a ticket of a closed
        connection was released by the picker when it closed)."""
        if connection == self._connection and self._writer is not None:
            self._writer.write(frame)

    async def _address(self) -> Address | None:
        """Where to connect now: the static address, or what `locate` says (its failure: the last one)."""
        if self._locate is None:
            return self.host, self.port
        try:
            found = await self._locate()
        except OSError as err:
            log.warning("endpoint picker: its address is unknown now (%s); keeping %s:%s", err, self.host, self.port)
            return (self.host, self.port) if self.host else None
        if found is not None and found != (self.host, self.port):
            log.info("endpoint picker at %s:%s", *found)
        return found

    async def _follow(self, at: Address, writer: asyncio.StreamWriter) -> None:
        """While connected to `at`: ask `locate` every `locate_interval_s`; close the connection
        when the picker moved (or none is ready), so that the next one goes to where it is now."""
        while True:
            await asyncio.sleep(self.locate_interval_s)
            if await self._address() != at:
                writer.close()
                return

    async def _run(self) -> None:
        backoff_s = RECONNECT_MIN_S
        while True:
            at = await self._address()
            try:
                if at is None:
                    raise OSError("no endpoint picker is ready")
                reader, writer = await asyncio.open_connection(*at)
            except OSError:
                await asyncio.sleep(backoff_s)
                backoff_s = min(RECONNECT_MAX_S, backoff_s * 2)
                continue
            self.host, self.port = at
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connection += 1
            for frame in self._pools.values():
                writer.write(frame)
            self._writer = writer
            answers_before = self._answers
            follower = None
            if self._locate is not None:
                follower = asyncio.get_running_loop().create_task(self._follow(at, writer))
            try:
                await self._read(reader)
            except (OSError, WireError) as err:
                log.warning("endpoint picker connection lost: %s", err)
            finally:
                if follower is not None:
                    follower.cancel()
                self._writer = None
                self._connection += 1   # tickets of the closed connection are the picker's to release
                for future in self._waiting.values():
                    if not future.done():
                        future.set_result(None)
                self._waiting.clear()
                writer.close()
            if self._answers > answers_before:   # it served: the next loss starts the backoff afresh
                backoff_s = RECONNECT_MIN_S
            else:   # accepted and closed without an answer (e.g. a proxy with no picker behind it)
                await asyncio.sleep(backoff_s)
                backoff_s = min(RECONNECT_MAX_S, backoff_s * 2)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        frames = FrameReader()
        waiting = self._waiting
        while data := await reader.read(65536):
            for frame in frames.feed(data):
                if type(frame) is not AnswerFrame:
                    raise WireError(f"the picker sent a frame of kind {type(frame).__name__}")
                self._answers += 1
                future = waiting.pop(frame.ticket, None)
                if future is not None and not future.done():   # else answered after its deadline: placed
                    future.set_result(frame)
