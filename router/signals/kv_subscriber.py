"""One endpoint's KV cache event stream, followed by the router.

Owns `KvEventSubscriber` (a ZMQ SUB socket, replay requests on a DEALER, the sequence
bookkeeping), which applies one endpoint's stream to its model's `router.kv.exact_index.ExactIndex`.
Made, started and stopped by `router.signals.kv_streams.KvEventStreams`; runs on the router's event
loop. A subscriber does not wake per message: it drains its socket on the tick all of a router's
subscribers share (`router.signals.drain_ticks.DrainTicks`), reading every queued message with
non-blocking reads and applying it in order; batches that arrive in order are applied in the
tick's own timer callback, and the subscriber's task wakes only for the rest (a gap, a connection
event, more than `BURST` batches at once, between which it yields to the loop). A subscriber whose
socket stayed empty for `QUIET_TICKS` ticks stops ticking and waits on its socket's file
descriptor instead (an idle router does not wake), then drains at the next tick. The view thus
lags the engine by at most one tick beyond the wire.

**Sequence protocol** (vllm/distributed/kv_events.py, `ZmqEventPublisher`; `router.kv.events`):
every batch carries the publisher's sequence number (0, 1, ... from its start). A subscriber
applies batch ``last + 1`` and, on anything else, asks the replay socket:

* at every (re)connection, and when a seq is skipped: replay from ``last``. If the publisher
  still buffers ``last`` with the very bytes applied (a CRC-32 is kept of recent batches), the
  missed batches are applied and the view stays exact ("gap served by replay");
* otherwise (seq went back, the replayed batch differs: the publisher restarted; or ``last``
  left its buffer): replay from 0. A buffer that starts at seq 0 (or is empty: nothing was
  ever published) holds the engine's whole history since its cache was empty: the view is
  rebuilt from it and is exact at once (`ExactIndex.reset(known_empty=True)`);
* else the view is dropped and rebuilt from what is left of the buffer and the stream, and the
  endpoint is REBUILDING for at least `rebuild_s`: blocks the engine stored before are invisible
  until it evicts and stores them again, and so is every block it stores below them (a
  `BlockStored` whose parent the view lacks). `kv-aware` meanwhile takes the larger of the
  partial view and its approximate index. The view is trusted again (LIVE) at the first check,
  `rebuild_s` after the resync and every `REBUILD_RECHECK_S` after that, at which the blocks
  stored since the previous check were at most `REBUILD_ORPHAN_SHARE` such orphans: while the
  engine keeps serving a prefix it cached before the break (a system prompt, a long
  conversation) the view stays partial, however long that lasts. Without a replay address only
  a publisher's seq 0 gives an exact view.

A stream that disconnects (the publisher's process is gone or stopped: ZMTP heartbeats,
`HEARTBEAT_TIMEOUT_MS`) is DOWN until it reconnects; libzmq reconnects with exponential
backoff (`RECONNECT_IVL_MS` to `RECONNECT_IVL_MAX_MS`). A payload that does not decode is
counted and makes the view REBUILDING (so does one that decodes but cannot be applied); nothing a
publisher sends stops the subscriber, and an unexpected error restarts it after a backoff. A
reconnected stream is LIVE again only once the replay has caught it up. After an empty replay
buffer the view expects seq 0 next: a later seq means seq 0 was published before the
subscription took (ZMQ's slow joiner), and is replayed.

**Limits.** One publisher per endpoint (a data-parallel engine publishes one stream per DP
rank on consecutive ports; give each rank its own endpoint). A publisher that restarted and
published more batches than the router had seen, all while the router was disconnected, is told
apart from a gap only by the CRC of the last batch applied: a restarted engine that republished
byte-identical batches at the same seq would go unnoticed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from router.kv.events import END_SEQ, SEQ_BYTES, KvEventDecodeError, decode_batch, parse_seq, seq_frame
from router.kv.exact_index import ExactIndex
from router.pools.spec import KvEventsSource
from router.signals.background import wake
from router.signals.drain_ticks import DrainTicks
from router.stats.endpoint_metrics import KvEndpointMetrics

log = logging.getLogger(__name__)

DEFAULT_REBUILD_S = 120.0
"""Seconds an endpoint stays REBUILDING at least after a resync that could not recover its history
(then as long as `REBUILD_ORPHAN_SHARE` says; module docstring): about
three turnovers of an H100's KV cache for an 8B model at 80% load (432k tokens of cache,
fleet/enginesim/profiles.py, against ~10k prefill tokens/s), after which the blocks stored
before the break and not yet seen are mostly evicted."""

REBUILD_RECHECK_S = 30.0
"""Seconds between two checks of a REBUILDING view after the first (`rebuild_s` after the resync)."""

REBUILD_ORPHAN_SHARE = 0.05
"""Most orphans (blocks stored below a prefix the view lacks) among the blocks stored since the last
check for a REBUILDING view to be trusted again. A complete view sees none: vLLM stores a block
only while its parent is cached (the request holds it), and the parent's `BlockStored` came first."""

DEFAULT_REPLAY_TIMEOUT_S = 2.0
"""Longest wait (seconds) for the next frame of a replay answer; then the replay counts as failed."""

RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 5_000
"""libzmq's reconnect backoff (ZMQ_RECONNECT_IVL, doubled up to ZMQ_RECONNECT_IVL_MAX)."""

HEARTBEAT_IVL_MS = 1_000
HEARTBEAT_TIMEOUT_MS = 3_000
"""ZMTP heartbeats (ZMQ_HEARTBEAT_IVL / ZMQ_HEARTBEAT_TIMEOUT): a publisher that does not answer a
PING for 3 s (process stopped or gone, network cut) is disconnected: its stream is DOWN."""

RCVHWM = 100_000
"""Messages the SUB socket queues while the subscriber is busy (a replay): vLLM's PUB HWM."""

BURST = 64
"""Messages handled back to back before the subscriber yields to the event loop."""

QUIET_TICKS = 5
"""Ticks a subscriber's socket may stay empty before it waits on the socket instead of ticking."""

_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
"""As plain ints: pyzmq's constants are enums, and ``events & zmq.POLLIN`` builds an enum member
on every call (a tenth of a busy subscriber's time on the loop, profiled with py-spy)."""

RECENT_BATCHES = 1_024
"""Batches whose CRC-32 is kept, to tell a duplicate (seen live and replayed) from a restart."""

RESTART_BACKOFF_S = (0.5, 30.0)
"""First and longest pause (seconds) before a subscriber that failed unexpectedly starts again."""


class KvEventSubscriber:
    """The KV event stream of one endpoint, applied to `index` under `endpoint_id`.

    Args:
        model, endpoint_id: whose stream (metric labels and the index's endpoint id).
        source: the publisher's addresses (`router.pools.spec.KvEventsSource`).
        index: the model's exact index.
        context: the `zmq.asyncio.Context` to make sockets in.
        metrics: the stream's counters (None: none).
        clock: monotonic seconds (the rebuild deadline).
        rebuild_s, replay_timeout_s: see `DEFAULT_REBUILD_S`, `DEFAULT_REPLAY_TIMEOUT_S`.
        ticks: when to drain the socket (`DrainTicks`, shared by a router's subscribers; None:
            a tick of its own every `router.signals.drain_ticks.DRAIN_INTERVAL_S`).
    """

    def __init__(self, model: str, endpoint_id: str, source: KvEventsSource, index: ExactIndex,
                 context: zmq.asyncio.Context, metrics: KvEndpointMetrics | None = None, *,
                 clock: Callable[[], float] = time.monotonic, rebuild_s: float = DEFAULT_REBUILD_S,
                 replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S, ticks: DrainTicks | None = None) -> None:  # fmt: skip
        self.model = model
        self.endpoint_id = endpoint_id
        self.source = source
        self._index = index
        self._ctx = context
        self._metrics = metrics
        self._clock = clock
        self._rebuild_s = rebuild_s
        self._replay_timeout_s = replay_timeout_s
        self._ticks = ticks if ticks is not None else DrainTicks()
        self._last_seq: int | None = None      # seq of the last batch applied; None: take the next as base
        self._from_zero = False   # the buffer was empty: the next batch must be seq 0 (else one was missed)
        self._recent: OrderedDict[int, int] = OrderedDict()   # seq -> CRC-32 of its payload
        self._rebuild_at: float | None = None
        self._rebuild_mark = (0, 0)   # the index's store counts at the last rebuild check (`_check_rebuilt`)
        self.resyncs = 0
        self.replays = 0
        self.bad_payloads = 0
        self._applied = 0   # events applied and not yet counted in the metrics (`_count_applied`)
        self._held: list[bytes] | None = None   # frames `_poll` read but could not place (`_on_gap` next)
        self._quiet = 0     # ticks in a row that found the socket empty

    # ----- running --------------------------------------------------------------------------------

    async def run(self) -> None:
        """Follow the stream until cancelled; an unexpected error restarts it after a backoff."""
        pause_s, longest_s = RESTART_BACKOFF_S
        while True:
            try:
                await self._follow()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV event subscriber of %s/%s failed; restarting in %.1f s", self.model,
                              self.endpoint_id, pause_s)  # fmt: skip
            self._index.stream_down(self.endpoint_id)
            await asyncio.sleep(pause_s)
            pause_s = min(longest_s, pause_s * 2)

    async def _follow(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        monitor = None
        try:
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.RCVHWM, RCVHWM)
            sub.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
            sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
            sub.connect(self.source.publisher)
            # Plain (blocking-API) views of the same sockets: read with NOBLOCK until empty, no future per message.
            raw_sub = zmq.Socket.shadow(sub.underlying)
            raw_monitor = zmq.Socket.shadow(monitor.underlying)
            self._quiet = 0
            while True:
                await self._drain_monitor(raw_monitor)
                self._quiet = 0 if await self._drain(raw_sub) else self._quiet + 1
                if self._rebuild_at is not None and self._clock() >= self._rebuild_at:
                    self._check_rebuilt()
                if self._quiet > QUIET_TICKS:   # nothing lately: sleep until a socket has something, then drain
                    await self._readable(raw_sub, raw_monitor)
                    self._quiet = 0
                await self._ticks.wait(functools.partial(self._poll, raw_sub, raw_monitor))
        finally:
            if monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)

    def _poll(self, sub: zmq.Socket, monitor: zmq.Socket) -> bool:
        """A tick's drain, run in `DrainTicks`' timer callback: apply the batches queued in order
        and keep waiting (True), or hand over to the task (False) when there is more to do than
        plain batches: a monitor event (connection up or down), a batch out of order (kept in
        `_held` for `_on_gap`), `BURST` batches or more (the task yields between bursts), the
        rebuild deadline, or a socket quiet for `QUIET_TICKS` ticks."""
        if monitor.getsockopt(_EVENTS) & _POLLIN:
            return False
        if self._rebuild_at is not None and self._clock() >= self._rebuild_at:
            return False
        n = self._read_in_order(sub)
        if self._held is not None or n >= BURST:
            return False
        if n:
            self._quiet = 0
            return True
        self._quiet += 1
        return self._quiet <= QUIET_TICKS

    def _read_in_order(self, sock: zmq.Socket) -> int:
        """Read and handle up to `BURST` queued messages, stopping at one that does not continue
        the stream (kept in `_held`); returns how many were read. Asks the socket whether a
        message is queued (``ZMQ_EVENTS``) rather than reading until `zmq.Again`: an empty socket
        costs a flag read, not an exception, on every tick."""
        n = 0
        try:
            while n < BURST and sock.getsockopt(_EVENTS) & _POLLIN:
                frames = sock.recv_multipart(zmq.NOBLOCK)
                n += 1
                if not self._take(frames):
                    self._held = frames
                    break
        finally:
            self._count_applied()
        return n

    async def _drain(self, sock: zmq.Socket) -> int:
        """Handle every message queued on the SUB socket, and one `_poll` held, yielding between
        bursts of `BURST`; returns how many."""
        total = 0
        while True:
            if self._held is not None:
                frames, self._held = self._held, None
                total += 1
                await self._on_gap(frames)
            n = self._read_in_order(sock)
            total += n
            if self._held is None and n < BURST:
                return total
            await asyncio.sleep(0)

    async def _drain_monitor(self, sock: zmq.Socket) -> None:
        while sock.getsockopt(_EVENTS) & _POLLIN:
            await self._on_monitor(sock.recv_multipart(zmq.NOBLOCK))

    def _count_applied(self) -> None:
        """Add the events applied since the last call to ``fleet_router_kv_events_total`` (once per
        drain, not once per batch)."""
        if self._applied:
            if self._metrics is not None:
                self._metrics.events.inc(self._applied)
            self._applied = 0

    async def _readable(self, *socks: zmq.Socket) -> None:
        """Return when one of `socks` has a message queued, or at the rebuild deadline."""
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()
        fds = [sock.FD for sock in socks]
        for fd in fds:
            loop.add_reader(fd, wake, woken)
        timer = None
        try:
            # The FD signals only state changes from here on: what arrived before is seen in EVENTS.
            if any(sock.getsockopt(zmq.EVENTS) & zmq.POLLIN for sock in socks):
                return
            if self._rebuild_at is not None:
                timer = loop.call_later(max(0.0, self._rebuild_at - self._clock()) + 0.001, wake, woken)
            await woken
        finally:
            for fd in fds:
                loop.remove_reader(fd)
            if timer is not None:
                timer.cancel()

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            # Up once caught up: while the replay runs the view lacks what was missed (or, if the
            # engine restarted, still holds what its cache lost), so the approximate index routes.
            await self._sync(reconnect=True)
            self._index.stream_up(self.endpoint_id)
        elif event == zmq.EVENT_DISCONNECTED:
            self._index.stream_down(self.endpoint_id)

    # ----- the sequence protocol ----------------------------------------------------------------------

    def _take(self, frames: list[bytes]) -> bool:
        """One PUB message ``(topic, seq, payload)``: applied, dropped as a duplicate or counted as
        malformed (True), or False when it does not continue the stream (`_on_gap` then)."""
        if len(frames) != 3:
            self._count_error("frames")
            return True
        seq_bytes = frames[1]
        if len(seq_bytes) != SEQ_BYTES:
            self._count_error("frames")
            return True
        return self._offer(int.from_bytes(seq_bytes, "big"), frames[2])

    async def _on_gap(self, frames: list[bytes]) -> None:
        """A message `_take` could not place: catch up by replay, or resync."""
        seq = parse_seq(frames[1])
        payload = frames[2]
        if self._metrics is not None:
            self._metrics.gaps.inc()
        await self._sync(reconnect=False)
        if self._offer(seq, payload):
            return
        last = self._last_seq
        if last is not None and seq <= last:
            return   # covered by the replay (were it a restarted publisher's, its next batches tell)
        # Replay did not reach this batch (it arrived after the replay answer was made): start over here.
        self._resync("replay_gone")
        self._apply(seq, payload)

    def _offer(self, seq: int, payload: bytes) -> bool:
        """Apply (or drop as a duplicate) a batch that continues the stream; False if it does not."""
        last = self._last_seq
        if last is None:
            if seq == 0:   # the publisher's first batch: its engine's cache was empty before it
                self._index.reset(self.endpoint_id, known_empty=True)
                self._rebuild_at = None
            elif self._from_zero:
                return False   # seq 0 was published before this subscription took: replay it
            elif not self._index.state(self.endpoint_id).exact() and self._rebuild_at is None:
                self._rebuild_from_now()   # a partial view: checked after rebuild_s
            self._apply(seq, payload)
            return True
        if seq == last + 1:
            self._apply(seq, payload)
            return True
        return seq <= last and self._recent.get(seq) == zlib.crc32(payload)

    async def _sync(self, *, reconnect: bool) -> None:
        """Catch up with the publisher's replay buffer (see the module docstring). Replayed batches
        are applied as they arrive, never all held at once (a busy engine's buffer is 10,000
        batches of up to tens of KB)."""
        try:
            await self._sync_from(self._last_seq, reconnect=reconnect)
        finally:
            self._count_applied()

    async def _sync_from(self, last: int | None, *, reconnect: bool) -> None:
        if self.source.replay is None:
            if not reconnect:
                self._resync("no_replay")
            elif last is None:
                self._partial()   # history unknown: only a publisher's seq 0 makes the view exact
            return
        outcome = "gone"
        if last is not None:
            try:
                outcome = await self._continue_from(last, reconnect)
            except _ReplayFailed:
                outcome = "gone"
            if outcome == "ok":
                return
        await self._restart_from_0(had_view=last is not None, restarted=outcome == "restart")

    async def _continue_from(self, last: int, reconnect: bool) -> str:
        """Replay from `last`: "ok" (it is still buffered as applied: the batches after it were
        applied), "restart" (buffered with other bytes), "gone" (not buffered). Raises
        `_ReplayFailed`."""
        verified = False   # the buffer's first batch is `last`, byte for byte
        applied = 0
        async with contextlib.aclosing(self._replay(last)) as batches:
            async for seq, payload in batches:
                if not verified:
                    if seq != last:
                        return "gone"
                    if self._recent.get(last) != zlib.crc32(payload):
                        return "restart"
                    verified = True
                    continue
                if seq != self._last_seq + 1:  # type: ignore[operator]
                    break   # a hole in the buffer: the next live message resyncs
                self._apply(seq, payload)
                applied += 1
        if not verified:
            return "gone"   # an empty buffer
        if applied and reconnect and self._metrics is not None:
            self._metrics.gaps.inc()
        return "ok"

    async def _restart_from_0(self, *, had_view: bool, restarted: bool) -> None:
        """Rebuild the view from the publisher's buffer from seq 0: exact if the buffer begins
        there (or is empty: nothing was ever published), partial (REBUILDING) otherwise."""
        first: int | None = None
        try:
            async with contextlib.aclosing(self._replay(0)) as batches:
                async for seq, payload in batches:
                    if first is None:
                        first = seq
                        exact = seq == 0
                        if had_view:
                            self._count_resync("restart" if exact or restarted else "replay_gone")
                        if exact:
                            self._index.reset(self.endpoint_id, known_empty=True)
                            self._last_seq = None
                            self._recent.clear()
                            self._rebuild_at = None
                        else:
                            self._partial()
                    elif seq != self._last_seq + 1:  # type: ignore[operator]
                        break   # a hole in the buffer: the next live message resyncs
                    self._apply(seq, payload)
        except _ReplayFailed:
            if first is None:
                if had_view:
                    self._count_resync("replay_gone")
                self._partial()
            return   # else: a prefix of the history was applied; the next live message finds the rest
        if first is None:   # an empty buffer: the publisher never published, its engine's cache is empty
            if had_view:
                self._count_resync("restart")
            self._index.reset(self.endpoint_id, known_empty=True)
            self._last_seq = None
            self._recent.clear()
            self._rebuild_at = None
            self._from_zero = True

    def _resync(self, reason: str) -> None:
        self._count_resync(reason)
        self._partial()

    def _count_resync(self, reason: str) -> None:
        self.resyncs += 1
        log.info("KV events of %s/%s: view resynced (%s)", self.model, self.endpoint_id, reason)
        if self._metrics is not None:
            self._metrics.resync(reason)

    def _count_error(self, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.error(reason)

    def _partial(self) -> None:
        """Drop the view; it rebuilds from the stream and is checked for trust after `rebuild_s`."""
        self._index.reset(self.endpoint_id, known_empty=False)
        self._last_seq = None
        self._from_zero = False   # a partial view takes any batch as its start
        self._recent.clear()
        self._rebuild_from_now()

    def _rebuild_from_now(self) -> None:
        self._rebuild_at = self._clock() + self._rebuild_s
        self._rebuild_mark = self._index.store_counts(self.endpoint_id)

    def _check_rebuilt(self) -> None:
        """At a rebuild check: trust the view again if the engine stored blocks since the last
        check and at most `REBUILD_ORPHAN_SHARE` of them were orphans; else check again in
        `REBUILD_RECHECK_S` (module docstring)."""
        stored, orphans = self._index.store_counts(self.endpoint_id)
        new, lost = stored - self._rebuild_mark[0], orphans - self._rebuild_mark[1]
        if new and lost <= REBUILD_ORPHAN_SHARE * (new + lost):
            self._rebuild_at = None
            self._index.rebuilt(self.endpoint_id)
            log.info("KV events of %s/%s: view trusted again (%d of %d blocks stored since the last check "
                     "continued prefixes it lacks)", self.model, self.endpoint_id, lost, new + lost)  # fmt: skip
            return
        self._rebuild_mark = (stored, orphans)
        self._rebuild_at = self._clock() + min(self._rebuild_s, REBUILD_RECHECK_S)
        log.info("KV events of %s/%s: view still partial (%d of %d blocks stored since the last check continued "
                 "prefixes it lacks); checked again in %.0f s", self.model, self.endpoint_id, lost, new + lost,
                 min(self._rebuild_s, REBUILD_RECHECK_S))  # fmt: skip

    def _apply(self, seq: int, payload: bytes) -> None:
        self._from_zero = False
        try:
            batch = decode_batch(payload)
            applied = self._index.apply(self.endpoint_id, batch, seq)
        except Exception as exc:  # KvEventDecodeError, or what a batch that decoded still breaks in apply
            self._count_error("decode")
            self.bad_payloads += 1
            if self.bad_payloads & (self.bad_payloads - 1) == 0:   # the 1st, 2nd, 4th, 8th...: no log flood
                log.warning("KV events of %s/%s: batch %d unreadable (%d so far): %s", self.model, self.endpoint_id,
                            seq, self.bad_payloads, exc)  # fmt: skip
            self._resync("bad_payload")
            applied = 0
        self._applied += applied
        self._last_seq = seq
        recent = self._recent
        recent[seq] = zlib.crc32(payload)
        if len(recent) > RECENT_BATCHES:
            recent.popitem(last=False)

    async def _replay(self, start: int) -> AsyncIterator[tuple[int, bytes]]:
        """The publisher's buffered batches with seq >= `start`, in order, as they arrive (vLLM
        `_service_replay`). Raises `_ReplayFailed` when the replay socket does not answer within
        `replay_timeout_s` (per frame) or answers something else."""
        assert self.source.replay is not None
        self.replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.source.replay)
            await sock.send_multipart([b"", seq_frame(start)])
            n = 0
            while True:
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), self._replay_timeout_s)
                    if len(frames) != 4 or frames[0] != b"":
                        raise KvEventDecodeError(f"replay answer of {len(frames)} frames")
                    if frames[2] == END_SEQ:
                        return
                    seq = parse_seq(frames[2])
                except (TimeoutError, zmq.ZMQError, KvEventDecodeError) as exc:
                    if not isinstance(exc, TimeoutError):
                        self._count_error("replay")
                    log.info("KV events of %s/%s: replay from %d failed: %r", self.model, self.endpoint_id, start, exc)
                    raise _ReplayFailed from exc
                yield seq, frames[3]
                n += 1
                if n % BURST == 0:
                    await asyncio.sleep(0)
        finally:
            sock.close(linger=0)


class _ReplayFailed(Exception):
    """The replay socket did not answer in time, or answered something else."""
