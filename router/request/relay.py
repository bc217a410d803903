"""Relay an engine's answer to the client: a sized body, an error body, or a stream as it arrives.

Owns `Relay` (one per `router.request.proxy.Proxy`, called by `router.request.attempt.Attempts`
once the engine's response head is in), the idle cut of a stream (`StreamIdle`, `StreamStalled`)
and the end of a stream the engine broke off (`stream_error_tail`). Counts the tokens of what it
relays (`router.protocol.tokens`, into `router.stats.endpoint_metrics.EndpointMetrics.count_tokens`) and
the endpoint's failures while it reads (`EndpointState.record_failure`); the outcome of the
attempt (outlier ejection, latency samples) is the caller's.

Hot path (docs/benchmarks.md, "The router against `vllm-router`"): a streamed chunk costs two
clock reads and one `send`, no timer and no allocation beyond what the SSE parser needs.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.pools.endpoint import EndpointState
from router.protocol.errors import MAX_ERROR_BODY_BYTES, error_body, relayed_error
from router.protocol.sse import SseRelay
from router.protocol.tokens import body_tokens
from router.request.asgi_io import ClientWatch, Send, send_json
from router.stats.endpoint_metrics import EndpointMetrics

log = logging.getLogger(__name__)

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
"""What reading from an endpoint may raise when the endpoint or the network fails."""

Headers = list[tuple[bytes, bytes]]


class StreamStalled(aiohttp.ClientPayloadError):
    """A stream that sent nothing for its idle limit after it began (set on the response's content
    by `StreamIdle`); handled like any stream the engine broke off."""


class StreamIdle:
    """Cuts a relayed stream whose engine stays silent for `idle_s` (loop-clock seconds) after it
    began: one timer per stream, re-armed only when it fires early, so a chunk costs two clock
    reads (`last_s = loop.time()` when it arrives and when the client has taken it), not a timer.
    While a chunk is being sent (`sending`) the time is the client's, not the engine's: a client
    slow to read never cuts a stream, nor counts against the endpoint."""

    __slots__ = ("last_s", "idle_s", "fired", "sending", "_content", "_loop", "_handle")

    def __init__(self, content: aiohttp.StreamReader, idle_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._content = content
        self.idle_s = idle_s
        self.fired = False
        self.sending = False
        self.last_s = self._loop.time()
        self._handle = self._loop.call_at(self.last_s + idle_s, self._check)

    def _check(self) -> None:
        if self.sending:   # waiting on the client: look again a whole idle period after it took the chunk
            self._handle = self._loop.call_at(self._loop.time() + self.idle_s, self._check)
            return
        due_s = self.last_s + self.idle_s
        if self._loop.time() >= due_s:
            self.fired = True
            self._content.set_exception(StreamStalled(f"no data for {self.idle_s:.1f} s"))
        else:
            self._handle = self._loop.call_at(due_s, self._check)

    def stop(self) -> None:
        self._handle.cancel()


def stream_error_tail(message: str) -> bytes:
    """The end of an SSE stream that failed: an OpenAI error event, then `data: [DONE]`."""
    error = error_body(message, type_="server_error", code="upstream_interrupted")
    return b"data: " + error + b"\n\ndata: [DONE]\n\n"


def _nothing() -> None:
    """The default load-change hook: nobody listens."""


class Relay:
    """Sends an engine's answer to the client through ASGI `send`.

    `clock`: the router's clock (seconds; the first body chunk's time). `refused(model, status)`:
    counts an answer the router gives itself (`router.request.refuse.Refusals.count`).
    `load_changed`: called when a request's prefill charge is released at its first body chunk
    (the peer channel's `notify`, set through `router.request.proxy.Proxy.on_load_change`).
    """

    __slots__ = ("_clock", "_refused", "load_changed")

    def __init__(self, clock: Callable[[], float], refused: Callable[[str, int], None]) -> None:
        self._clock = clock
        self._refused = refused
        self.load_changed: Callable[[], None] = _nothing

    async def whole(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse, status: int,
                    headers: Headers, send: Send, watch: ClientWatch, predicted_cached: int) -> bool:  # fmt: skip
        """Relay a sized, non-streamed body in one piece; False if the endpoint failed.
        `predicted_cached`: the policy's expected prefix-cache hit here, for the token counters."""
        try:
            data = await resp.read()
        except UPSTREAM_ERRORS as exc:
            await self.failed_mid_response(endpoint, m, send, watch, "body", exc)
            return False
        headers.append((b"content-length", str(len(data)).encode()))
        if status < 400:
            m.count_tokens(body_tokens(data), predicted_cached)   # tokens in and out (router.protocol.tokens)
        watch.finishing = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return True

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
                     idle_s: float | None = None) -> float | None:  # fmt: skip
        """Relay the body as it arrives (SSE: whole events, through `sse`); return the clock time
        of the first body chunk (or of the end, for an empty body), None if the endpoint failed
        midway. At the first chunk the prefill charge in `first` is released (`first` is emptied).
        `first_chunk` (read at `first_chunk_s`, within the first-token deadline; b"" for an empty
        body) goes out first, with the response head; None: the head goes out at once. A stream
        silent for `idle_s` seconds after it began (the attempt's first-token deadline: no gap
        between tokens outlasts a prefill of the whole prompt, the most a preempted request
        recomputes; None: no limit) is cut as below (`StreamIdle`; a gateway failure for outlier
        detection).

        On failure an SSE stream ends with an OpenAI error event and `data: [DONE]` (what vLLM
        sends when generation fails mid-stream; OpenAI clients raise it as an `APIError`);
        another body is left incomplete, so the ASGI server closes the connection and the
        client sees a truncated body, not a clean end.
        """
        await send({"type": "http.response.start", "status": status, "headers": headers})
        first_byte_s: float | None = None
        clock = self._clock
        idle = StreamIdle(resp.content, idle_s) if idle_s is not None else None
        loop_time = asyncio.get_running_loop().time
        try:
            if first_chunk:
                first_byte_s = first_chunk_s
                endpoint.first_byte(first.pop())
                self.load_changed()
                chunk = sse.feed(first_chunk, first_chunk_s) if sse is not None else first_chunk
                if chunk:
                    if idle is not None:
                        idle.sending = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    if idle is not None:
                        idle.last_s = loop_time()
                        idle.sending = False
            async for chunk in resp.content.iter_any():
                if idle is not None:
                    idle.last_s = loop_time()
                if sse is not None:
                    now_s = clock()
                    if first_byte_s is None:
                        first_byte_s = now_s
                        endpoint.first_byte(first.pop())
                        self.load_changed()
                    chunk = sse.feed(chunk, now_s)
                    if not chunk:
                        continue  # a partial event, held back until its end arrives
                elif first_byte_s is None:
                    first_byte_s = clock()
                    endpoint.first_byte(first.pop())
                    self.load_changed()
                if idle is not None:
                    idle.sending = True   # a client slow to read is not a silent engine
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if idle is not None:
                    idle.last_s = loop_time()
                    idle.sending = False
        except UPSTREAM_ERRORS as exc:
            await self._interrupted(endpoint, m, send, watch, sse, exc)
            return None
        finally:
            if idle is not None:
                idle.stop()
        if first_byte_s is None:
            first_byte_s = clock()
        watch.finishing = True
        await send({"type": "http.response.body", "body": sse.rest() if sse is not None else b"", "more_body": False})
        return first_byte_s

    async def _interrupted(self, endpoint: EndpointState, m: EndpointMetrics, send: Send, watch: ClientWatch,
                           sse: SseRelay | None, exc: BaseException) -> None:  # fmt: skip
        """The engine broke off a stream already begun: counted against it, and an SSE stream cut
        between events ends with `stream_error_tail` (`stream`'s docstring)."""
        endpoint.record_failure(self._clock())
        m.error("interrupted").inc()
        log.warning("endpoint %s (%s): stream interrupted: %r", endpoint.id, endpoint.url, exc)
        if sse is not None and sse.aligned:
            watch.finishing = True
            await send({"type": "http.response.body", "more_body": False, "body": stream_error_tail(
                f"endpoint {endpoint.id} failed mid-stream ({type(exc).__name__}); the response is incomplete")})
