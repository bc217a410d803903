"""The endpoint picker process: one TCP server the routers of a pool set connect to.

Owns `PickerService`: it accepts router connections (`router.picker.wire` frames, pipelined),
follows each publishing engine's KV event stream once (`router.signals.kv_streams.KvEventStreams`,
the subscriber the routers run without a picker) and hands every frame to one
`router.picker.state.PickerState` on this one asyncio loop, so every pick of every router is
decided in one place, in arrival order. Run by `python -m router.picker`
(`router/picker/__main__.py`); `fleet up` supervises it (`fleet/local/routerproc.py`).

**HA** (active-passive): `leading` says whether this picker may answer picks (in the chart, while
it holds a coordination.k8s.io/v1 Lease: `fleet endpoint-picker --lease`, `fleet/k8s/picker_pod.py`).
A standby keeps its connections, applies every frame but `PICK` (pools, progress, placements) and
follows the KV streams of the pools it was sent, and answers each pick ``chosen = -1``: the router's
client counts it `declined` and picks alone (`router.picker.client`). Its readiness (`/ready`,
`router.picker.metrics.serve_http`) is false, so the Service sends the routers to the leader only.
Metrics: `router.picker.metrics.PickerMetrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import time
from collections.abc import Callable, Mapping

from router.picker.metrics import PickerMetrics
from router.picker.state import PickerState
from router.picker.wire import FINISH, AnswerFrame, FrameReader, PickFrame, PlacedFrame, PoolFrame, ProgressFrame, \
    WireError, encode_answer
from router.pools.spec import KvEventsSource
from router.signals.kv_streams import KvEventStreams

log = logging.getLogger(__name__)

READ_BYTES = 256 * 1024
"""Bytes read from a router's connection at once: many pipelined picks per read under load."""

DRAIN_INTERVAL_S = 0.05
"""Seconds between two drains of the engines' KV event sockets at the picker (its
`router.signals.drain_ticks.DrainTicks`; a router without a picker drains every
`router.signals.drain_ticks.DRAIN_INTERVAL_S`, 0.02). A tick reads every live stream's sockets
whether they hold a batch or not, so its cost grows with the engines and is paid 1/interval times a
second: with 8 engines each storing a batch of 55 blocks 7 times a second, the ingest costs ~230
us of CPU per batch at 50 ms against ~400 at 20 ms (`python -m loadtests.bench_kv_events
--batches 800 --blocks 55 --rate 7 --streams 8 --drain-interval-ms 50`, docs/routing.md "Where
the picker's CPU goes").
The view lags the engine by at most one interval more than the wire; what a pick sends to an
engine meanwhile is held by its claim (`router.kv.exact_index.ExactIndex.expect_keys`) until
the engine reports it stored."""


class PickerService:
    """The picker's server: `start(host, port)` listens (port 0: a free one, `port` after),
    `close()` stops it and the KV subscribers. `clock` gives seconds (monotonic), the policy's
    `now_s`. `streams`: where the engines' KV events are followed (default: a fresh
    `KvEventStreams` counting into `metrics`). `leading`: whether picks are answered now (default:
    always; HA: while the Lease is held). `metrics`: where it records (default: a fresh
    `PickerMetrics`). `drain_interval_s`: seconds between two drains of the default streams'
    sockets (`DRAIN_INTERVAL_S`; not used with `streams`)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, streams: KvEventStreams | None = None, *,
                 leading: Callable[[], bool] = lambda: True, metrics: PickerMetrics | None = None,
                 drain_interval_s: float = DRAIN_INTERVAL_S) -> None:  # fmt: skip
        self._clock = clock
        self.metrics = metrics if metrics is not None else PickerMetrics()
        self.leading = leading
        if streams is None:
            streams = KvEventStreams(self.metrics, clock=clock,  # type: ignore[arg-type]  # duck-typed: bind_kv
                                     drain_interval_s=drain_interval_s)
        self.streams = streams
        self.state = PickerState(self.streams.index, self._put_sources)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._ids = itertools.count(1)
        self.port = 0
        facts = self.metrics.facts
        facts.routers = lambda: len(self._connections)
        facts.in_flight = self.state.in_flight
        facts.leading = lambda: self.leading()
        facts.kv_rows = streams.kv_rows

    def _put_sources(self, model: str, sources: Mapping[str, dict]) -> None:
        self.streams.put(model, {e: KvEventsSource.model_validate(s) for e, s in sources.items()})

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        """Listen on `host`:`port` and start the KV subscribers. Raises OSError if it cannot bind."""
        await self.streams.start()
        self._server = await asyncio.start_server(self._serve, host, port, limit=READ_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, drop every connection and stop the KV subscribers."""
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
        await self.streams.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One router's connection: frames in, answers out, until it closes."""
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        connection = next(self._ids)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        frames = FrameReader()
        try:
            while data := await reader.read(READ_BYTES):
                out = self._handle(connection, frames.feed(data))
                if out:
                    writer.write(out)
        except (WireError, ConnectionError) as err:
            log.warning("router connection %d dropped: %s", connection, err)
        finally:
            self._connections.discard(task)
            released = self.state.drop_connection(connection)
            if released:
                log.info("router connection %d closed holding %d picks: released", connection, released)
            writer.close()

    def _handle(self, connection: int, frames: list) -> bytes:
        """Apply `frames` in order; the answers to its picks, framed and joined."""
        state = self.state
        answers = []
        now_s = self._clock()
        leading: bool | None = None   # asked once per read, at its first pick
        for frame in frames:
            kind = type(frame)
            if kind is PickFrame:
                if leading is None:
                    leading = self.leading()
                answers.append(self._pick(connection, frame, now_s) if leading else self._decline(frame))
            elif kind is ProgressFrame:
                state.progress(connection, frame.ticket, finished=frame.kind == FINISH)
            elif kind is PlacedFrame:
                state.placed(connection, frame.ticket, frame.endpoint_id, now_s)
            elif kind is PoolFrame:
                try:
                    state.pool(frame.model, frame.policy, frame.sources)
                except (KeyError, ValueError) as err:
                    log.warning("pool %r from router connection %d refused: %s", frame.model, connection, err)
            elif kind is AnswerFrame:
                raise WireError("a router sent an answer frame")
        return b"".join(answers)

    def _pick(self, connection: int, frame: PickFrame, now_s: float) -> bytes:
        """Decide `frame` (timed and counted); its answer, framed."""
        metrics = self.metrics
        start_s = time.perf_counter()
        chosen, cached, block_tokens = self.state.pick(connection, frame, now_s)
        metrics.decision.observe(time.perf_counter() - start_s)
        (metrics.answered if chosen >= 0 else metrics.declined).inc()
        return encode_answer(frame.ticket, chosen, cached, block_tokens)

    def _decline(self, frame: PickFrame) -> bytes:
        """A standby's answer to `frame`: none chosen, so the router picks alone."""
        self.metrics.standby.inc()
        return encode_answer(frame.ticket, -1, 0, 0)
