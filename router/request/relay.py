"""Relay an engine's answer to the client: a sized body, an error body, or a stream as it arrives.

Owns `Relay` (one per `router.request.proxy.Proxy`, called by `router.request.attempt.Attempts`
once the engine's response head is in), how one stream is relayed (`StreamPlan`), the cut of a
stream that is silent, too slow or too long (`StreamGuard`, `StreamStalled`; limits from
`router.pools.upstream`), and the end of a stream the engine broke off (`stream_error_tail`, or
`BROKEN` for one the caller continues elsewhere: `router.request.migrate`). Counts the tokens of
what it relays (`router.protocol.tokens`, into
`router.stats.endpoint_metrics.EndpointMetrics.count_tokens`) and the endpoint's failures while it
reads (`EndpointState.record_failure`); the outcome of the attempt (outlier ejection, latency
samples) is the caller's. Sized bodies are read whole only up to `MAX_BUFFERED_BODY_BYTES`, larger
ones relayed as they arrive.

Hot path (docs/benchmarks.md, "The router against `vllm-router`"): a streamed chunk costs two
clock reads, one addition, one `send` (and a list append when the stream may be migrated), no
timer and no allocation beyond what the SSE parser needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.pools.endpoint import EndpointState
from router.pools.upstream import DEFAULT_MAX_RESPONSE_BYTES
from router.protocol.errors import MAX_ERROR_BODY_BYTES, error_body, relayed_error
from router.protocol.sse import SseRelay
from router.protocol.tokens import body_tokens
from router.request.asgi_io import ClientWatch, Send, send_json
from router.request.migrate import Continuation, Tape
from router.stats.endpoint_metrics import EndpointMetrics

log = logging.getLogger(__name__)

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
"""What reading from an endpoint may raise when the endpoint or the network fails."""

Headers = list[tuple[bytes, bytes]]


class StreamStalled(aiohttp.ClientPayloadError):
    """A stream cut by its `StreamGuard` (silent for its idle limit, under its byte-rate floor,
    or past the request's total-time limit), set on the response's content; handled like any
    stream the engine broke off."""


class StreamGuard:
    """Cuts a relayed stream whose engine stays silent for `idle_s`, sends fewer than
    `min_bytes_per_s x window_s` bytes in a window of `window_s` after it began, or runs past
    `end_at` (loop-clock seconds: the request's `max_stream_duration_s`, `router.pools.upstream`).
    One timer per stream, re-armed only when it fires, so a chunk costs two clock reads
    (`last_s = loop.time()` when it arrives and when the client has taken it) and one addition
    (`bytes += len(chunk)`), not a timer. While a chunk is being sent (`sending`) the time is the
    client's, not the engine's: a client slow to read never cuts a stream, nor counts against
    the endpoint (the window restarts when the client has taken the chunk). `reason`: why it
    cut (empty while it has not)."""

    __slots__ = ("last_s", "bytes", "sending", "reason", "_idle_s", "_min_bytes", "_window_s", "_window_start_s",
                 "_end_at", "_content", "_loop", "_handle")  # fmt: skip

    def __init__(self, content: aiohttp.StreamReader, idle_s: float | None, *, min_bytes_per_s: float = 0.0,
                 window_s: float = 1.0, end_at: float | None = None) -> None:  # fmt: skip
        self._loop = asyncio.get_running_loop()
        self._content = content
        self._idle_s = idle_s
        self._min_bytes = min_bytes_per_s * window_s
        self._window_s = window_s
        self._end_at = end_at
        self.sending = False
        self.reason = ""
        self.bytes = 0
        self.last_s = self._window_start_s = self._loop.time()
        self._handle = self._loop.call_at(self._due_s(), self._check)

    @property
    def fired(self) -> bool:
        """Whether the guard cut the stream."""
        return bool(self.reason)

    def _due_s(self) -> float:
        due_s = self._end_at if self._end_at is not None else float("inf")
        if self._idle_s is not None:
            due_s = min(due_s, self.last_s + self._idle_s)
        if self._min_bytes > 0:
            due_s = min(due_s, self._window_start_s + self._window_s)
        return due_s

    def _check(self) -> None:
        now_s = self._loop.time()
        if self._end_at is not None and now_s >= self._end_at:
            self._cut("the request ran past its max_stream_duration_s")
            return
        if self.sending:   # waiting on the client: the engine's clocks start again once it took the chunk
            self.last_s = self._window_start_s = now_s
            self.bytes = 0
        elif self._idle_s is not None and now_s >= self.last_s + self._idle_s:
            self._cut(f"no data for {self._idle_s:.1f} s")
            return
        elif self._min_bytes > 0 and now_s >= self._window_start_s + self._window_s:
            if self.bytes < self._min_bytes:
                self._cut(f"{self.bytes} bytes in {self._window_s:g} s, under min_bytes_per_s "
                          f"{self._min_bytes / self._window_s:g}")  # fmt: skip
                return
            self._window_start_s = now_s
            self.bytes = 0
        due_s = self._due_s()
        if due_s != float("inf"):
            self._handle = self._loop.call_at(due_s, self._check)

    def _cut(self, reason: str) -> None:
        self.reason = reason
        self._content.set_exception(StreamStalled(reason))

    def stop(self) -> None:
        self._handle.cancel()


MAX_BUFFERED_BODY_BYTES = 1024 * 1024
"""Largest sized body read whole before it is relayed (bytes; `Relay.whole`): an OpenAI completion
or chat answer is a few KiB (a long one with `n` choices and logprobs some hundreds of KiB); a
larger body is relayed as it arrives."""


def _json_object(data: bytes) -> bool:
    """Whether `data` is delimited as a JSON object (first and last non-blank bytes `{`, `}`)."""
    return data[:1] == b"{" and data[-1:] == b"}" or data.strip()[:1] == b"{" and data.rstrip()[-1:] == b"}"


def failure(exc: BaseException) -> str:
    """How a stream failed, for its error event and log: the exception's class, and for a cut by
    `StreamGuard` its reason."""
    return f"{type(exc).__name__}: {exc}" if isinstance(exc, StreamStalled) else type(exc).__name__


def stream_error_tail(message: str) -> bytes:
    """The end of an SSE stream that failed: an OpenAI error event, then `data: [DONE]`."""
    error = error_body(message, type_="server_error", code="upstream_interrupted")
    return b"data: " + error + b"\n\ndata: [DONE]\n\n"


BROKEN = "broken"
"""`Relay.stream`'s answer for a stream its engine broke off between two events, with a tape kept:
nothing more was sent, and the caller continues it on another endpoint or ends it."""


class StreamPlan:
    """How one attempt's stream is relayed (`Relay.stream`): its guard's limits (`idle_s`: None,
    no idle cut; `min_bytes_per_s` over `window_s`: 0, no floor; `end_at`: the request's end,
    loop-clock seconds, None: none; `router.pools.upstream.StreamLimits`), the largest sized
    answer (`max_response_bytes`), whether a break is the
    caller's (`migrate`: the pool migrates streams; `Relay.stream` answers `BROKEN`), the `tape`
    its relayed events go to (None: the request is not migrated) and the `continuation` that
    rewrites them (None: a first attempt; `router.request.migrate`)."""

    __slots__ = ("idle_s", "min_bytes_per_s", "window_s", "end_at", "max_response_bytes", "migrate", "tape",
                 "continuation")  # fmt: skip

    def __init__(self, idle_s: float | None = None, min_bytes_per_s: float = 0.0, window_s: float = 1.0,
                 end_at: float | None = None, tape: Tape | None = None,
                 continuation: Continuation | None = None) -> None:  # fmt: skip
        self.idle_s = idle_s
        self.min_bytes_per_s = min_bytes_per_s
        self.window_s = window_s
        self.end_at = end_at
        self.max_response_bytes = DEFAULT_MAX_RESPONSE_BYTES
        self.migrate = continuation is not None
        self.tape = tape
        self.continuation = continuation

    def guard(self, content: aiohttp.StreamReader) -> StreamGuard | None:
        """The guard of a stream read from `content`; None when no limit is set."""
        if self.idle_s is None and self.min_bytes_per_s <= 0 and self.end_at is None:
            return None
        return StreamGuard(content, self.idle_s, min_bytes_per_s=self.min_bytes_per_s, window_s=self.window_s,
                           end_at=self.end_at)  # fmt: skip


class Relay:
    """Sends an engine's answer to the client through ASGI `send`.

    `clock`: the router's clock (seconds; the first body chunk's time). `refused(model, status)`:
    counts an answer the router gives itself (`router.request.refuse.Refusals.count`).
    """

    __slots__ = ("_clock", "_refused")

    def __init__(self, clock: Callable[[], float], refused: Callable[[str, int], None]) -> None:
        self._clock = clock
        self._refused = refused

    async def whole(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse, status: int,
                    headers: Headers, send: Send, watch: ClientWatch, predicted_cached: int,
                    may_retry: bool, max_bytes: int) -> bool | None:  # fmt: skip
        """Relay a sized, non-streamed body: True when relayed, False when the endpoint failed and
        the client got a 502 or a truncated body, None when it failed before any byte went to the
        client and `may_retry` (the caller retries elsewhere). `predicted_cached`: the policy's
        expected prefix-cache hit here, for the token counters.

        A body of at most `MAX_BUFFERED_BODY_BYTES` is read before anything is sent, so an
        engine that cuts it off, or answers a status < 400 with a body that is not a JSON object
        (its first and last non-blank bytes are not `{` and `}`: a check of its delimiters, not a
        parse, which the hot path cannot afford), has failed before the client saw a byte. A
        larger body is relayed chunk by chunk as it arrives (never held whole: the router's
        memory does not grow with the answer); once its head went out, a cut leaves the client a
        truncated body. A body announcing more than `max_bytes` fails before any byte is read
        (`router.pools.upstream`, `max_response_bytes`)."""
        size = resp.content_length or 0
        content = resp.content
        if size > max_bytes:
            return await self._failed_before_client(endpoint, m, send, watch, "body",
                                                    ValueError(f"a body of {size} bytes, over {max_bytes}"), may_retry)
        if size > MAX_BUFFERED_BODY_BYTES:
            return await self._whole_streamed(endpoint, m, resp, status, headers, send, watch, may_retry)
        try:
            data = await content.readexactly(size) if size else b""
        except (*UPSTREAM_ERRORS, asyncio.IncompleteReadError) as exc:
            return await self._failed_before_client(endpoint, m, send, watch, "body", exc, may_retry)
        if status < 400 and not _json_object(data):
            return await self._failed_before_client(endpoint, m, send, watch, "body",
                                                    ValueError("a body that is not a JSON object"), may_retry)
        headers.append((b"content-length", str(len(data)).encode()))
        if status < 400:
            m.count_tokens(body_tokens(data), predicted_cached)   # tokens in and out (router.protocol.tokens)
        watch.finishing = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return True

    async def _whole_streamed(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse,
                              status: int, headers: Headers, send: Send, watch: ClientWatch,
                              may_retry: bool) -> bool | None:  # fmt: skip
        """A sized body past `MAX_BUFFERED_BODY_BYTES`, relayed as it arrives (`whole`); its first
        chunk is checked before the head goes out. Its tokens are not counted (its usage is at
        its end, past what is held)."""
        content = resp.content
        try:
            first = await content.readany()
        except UPSTREAM_ERRORS as exc:
            return await self._failed_before_client(endpoint, m, send, watch, "body", exc, may_retry)
        if status < 400 and not first.lstrip().startswith(b"{"):
            return await self._failed_before_client(endpoint, m, send, watch, "body",
                                                    ValueError("a body that is not a JSON object"), may_retry)
        headers.append((b"content-length", str(resp.content_length).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        try:
            await send({"type": "http.response.body", "body": first, "more_body": True})
            async for chunk in content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UPSTREAM_ERRORS as exc:
            endpoint.record_failure(self._clock())
            m.error("interrupted").inc()
            log.warning("endpoint %s (%s): body cut off after its head was relayed: %r", endpoint.id, endpoint.url, exc)
            return False   # the server closes the connection: the client sees a truncated body
        watch.finishing = True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True

    async def _failed_before_client(self, endpoint: EndpointState, m: EndpointMetrics, send: Send,
                                    watch: ClientWatch, what: str, exc: BaseException,
                                    may_retry: bool) -> bool | None:  # fmt: skip
        """An answer that failed before any byte went to the client: None (retried by the caller)
        while `may_retry`, else the client's 502 (`failed_mid_response`) and False."""
        if may_retry:
            endpoint.record_failure(self._clock())
            m.error("interrupted").inc()
            log.warning("endpoint %s (%s): %s failed before the client got a byte, retried: %r", endpoint.id,
                        endpoint.url, what, exc)  # fmt: skip
            return None
        await self.failed_mid_response(endpoint, m, send, watch, what, exc)
        return False

    async def failed_mid_response(self, endpoint: EndpointState, m: EndpointMetrics, send: Send,
                                  watch: ClientWatch, what: str, exc: BaseException) -> None:  # fmt: skip
        """The endpoint failed while its (non-streamed) ``what`` was read: counted against it,
        and the client gets 502 ``upstream_error`` in OpenAI's format."""
        endpoint.record_failure(self._clock())
        m.error("interrupted").inc()
        log.warning("endpoint %s (%s): %s read failed: %r", endpoint.id, endpoint.url, what, exc)
        watch.finishing = True
        self._refused(m.labels[0], 502)
        await send_json(send, 502, error_body(f"endpoint {endpoint.id} failed mid-response",
                                              type_="server_error", code="upstream_error"))  # fmt: skip

    async def read_error(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse,
                         status: int, headers: Headers, send: Send,
                         watch: ClientWatch) -> tuple[bytes, Headers] | None:  # fmt: skip
        """Read an engine's error answer (status >= 400, not a stream) and rewrite it in OpenAI's
        format (`router.protocol.errors.relayed_error`; at most `MAX_ERROR_BODY_BYTES` of it are read):
        `(body, headers to relay)` for the caller to send with the same status. None if the
        endpoint failed before its body was complete (the client then got a 502)."""
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in resp.content.iter_any():
                chunks.append(chunk)
                size += len(chunk)
                if size >= MAX_ERROR_BODY_BYTES:
                    break
        except UPSTREAM_ERRORS as exc:
            await self.failed_mid_response(endpoint, m, send, watch, "error body", exc)
            return None
        body = relayed_error(status, b"".join(chunks)[:MAX_ERROR_BODY_BYTES], resp.content_type)
        return body, [(k, v) for k, v in headers if k not in (b"content-type", b"content-encoding")]

    async def stream(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse, status: int,
                     headers: Headers, send: Send, watch: ClientWatch, sse: SseRelay | None, first: list[int],
                     first_chunk: bytes | None, first_chunk_s: float,
                     plan: StreamPlan) -> float | str | None:  # fmt: skip
        """Relay the body as it arrives (SSE: whole events, through `sse`); return the clock time
        of the first body chunk (or of the end, for an empty body), None if the endpoint failed
        midway (the client's stream was ended), `BROKEN` if it failed midway on a stream the
        caller may continue elsewhere (`plan.migrate`, and the stream cut between events: nothing
        more was sent; `router.request.migrate`). At the first chunk the prefill charge in
        `first` is released (`first` is emptied). `first_chunk` (read at `first_chunk_s`, within
        the first-token deadline; b"" for an empty body) goes out first, with the response head
        (no head for a `plan.continuation`: the client has it); None: the head goes out at once.
        `plan` sets the stream's guard (`StreamGuard`: silent for `plan.idle_s`, the attempt's
        first-token deadline, since no gap between tokens outlasts a prefill of the whole
        prompt, the most a preempted request recomputes; the byte-rate floor; the request's end)
        and what is done with each relayed piece (`plan.tape`, `plan.continuation`).

        On failure an SSE stream not continued ends with an OpenAI error event and `data: [DONE]`
        (what vLLM sends when generation fails mid-stream; OpenAI clients raise it as an
        `APIError`); another body is left incomplete, so the ASGI server closes the connection
        and the client sees a truncated body, not a clean end.
        """
        if plan.continuation is None:
            await send({"type": "http.response.start", "status": status, "headers": headers})
        first_byte_s: float | None = None
        clock = self._clock
        guard = plan.guard(resp.content)
        loop_time = asyncio.get_running_loop().time
        tape, continuation = plan.tape, plan.continuation
        if continuation is not None:
            continuation.resumed_at = loop_time()
        try:
            if first_chunk:
                first_byte_s = first_chunk_s
                endpoint.first_byte(first.pop())
                chunk = sse.feed(first_chunk, first_chunk_s) if sse is not None else first_chunk
                if continuation is not None and chunk:
                    chunk = continuation.rewrite(chunk)
                if chunk:
                    if tape is not None:
                        tape.add(chunk)
                    if guard is not None:
                        guard.sending = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if guard is not None:
                        guard.last_s = loop_time()
                        guard.sending = False
            async for chunk in resp.content.iter_any():
                if guard is not None:
                    guard.last_s = loop_time()
                    guard.bytes += len(chunk)
                if sse is not None:
                    now_s = clock()
                    if first_byte_s is None:
                        first_byte_s = now_s
                        endpoint.first_byte(first.pop())
                    chunk = sse.feed(chunk, now_s)
                    if not chunk:
                        continue  # a partial event, held back until its end arrives
                    if continuation is not None:
                        chunk = continuation.rewrite(chunk)
                        if not chunk:
                            continue
                    if tape is not None:
                        tape.add(chunk)
                elif first_byte_s is None:
                    first_byte_s = clock()
                    endpoint.first_byte(first.pop())
                if guard is not None:
                    guard.sending = True   # a client slow to read is not a silent engine
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if guard is not None:
                    guard.last_s = loop_time()
                    guard.sending = False
        except UPSTREAM_ERRORS as exc:
            self.count_interrupted(endpoint, m, exc)
            if plan.migrate and sse is not None and sse.aligned:
                return BROKEN   # the caller continues it elsewhere, or ends it (`stream_error_tail`)
            if sse is not None and sse.aligned:
                watch.finishing = True
                message = f"endpoint {endpoint.id} failed mid-stream ({failure(exc)}); the response is incomplete"
                await send({"type": "http.response.body", "more_body": False, "body": stream_error_tail(message)})
            return None
        finally:
            if guard is not None:
                guard.stop()
        if first_byte_s is None:
            first_byte_s = clock()
        watch.finishing = True
        await send({"type": "http.response.body", "body": sse.rest() if sse is not None else b"", "more_body": False})
        return first_byte_s

    def count_interrupted(self, endpoint: EndpointState, m: EndpointMetrics, exc: BaseException) -> None:
        """The engine broke off a stream already begun (or its guard cut it): counted against it
        and logged."""
        endpoint.record_failure(self._clock())
        m.error("interrupted").inc()
        log.warning("endpoint %s (%s): stream interrupted: %r", endpoint.id, endpoint.url, exc)
