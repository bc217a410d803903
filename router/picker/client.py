"""A router's connection to the endpoint picker: ask per request, fall back when it does not answer.

Owns `PickerClient` and `PickerTicket`. `router.http.app.create_app` makes one when the router is
started with `--picker HOST:PORT`; `router.pools.pool.PoolTable` tells it every pool
(`put_pool`), and `router.request.proxy` asks it for the first pick of each request (`pick`) and
reports the request's first byte and end (`PickerTicket.first_byte`, `finish`). One TCP connection,
pipelined (`router.picker.wire`); reconnected with backoff (`RECONNECT_MIN_S` doubling to
`RECONNECT_MAX_S`, reset only by a connection that brought an answer, so a proxy that accepts and
closes with no picker behind it is not spun against); every pool is sent again on each connection. A pick not answered within
`DEFAULT_DEADLINE_S`, or asked while the connection is down, is the router's own (its policy on
its own approximate index and load); a late one is reported to the picker (`PLACED`), so the
picker counts the request's load and claim where it went.

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
from collections.abc import Callable, Sequence

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
PICK_RTT_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01)


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
    """The router's connection to the picker at `host`:`port` (module docstring).

    `start()` begins connecting (on the running loop); `close()` stops. `deadline_s`: the wait
    for an answer. `clock`: seconds, for the round-trip histogram. `registry`: where the metrics
    go (None: a private one)."""

    def __init__(self, host: str, port: int, *, deadline_s: float = DEFAULT_DEADLINE_S,
                 clock: Callable[[], float] = time.perf_counter,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        self.host = host
        self.port = port
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

    async def _run(self) -> None:
        backoff_s = RECONNECT_MIN_S
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port)
            except OSError:
                await asyncio.sleep(backoff_s)
                backoff_s = min(RECONNECT_MAX_S, backoff_s * 2)
                continue
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connection += 1
            for frame in self._pools.values():
                writer.write(frame)
            self._writer = writer
            answers_before = self._answers
            try:
                await self._read(reader)
            except (OSError, WireError) as err:
                log.warning("endpoint picker connection lost: %s", err)
            finally:
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
