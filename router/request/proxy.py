"""The request path: proxy OpenAI completion requests to a pool's endpoints.

Owns `Proxy`, a raw ASGI handler for `POST /v1/completions` and
`POST /v1/chat/completions`, and the aiohttp client session it forwards with. Called by
`router.http.app.RouterApp` for those two paths only; everything else goes to the FastAPI app. The
client side of the connection (reading and checking the body, answering, noticing a client
that left) is `router.request.asgi_io`.

Per request: read the body (at most `max_body_bytes`, else 413; the server bounds the time,
`router.http.server.RequestGuardProtocol`) and check the JSON (400), find the model's pool (404;
503 + Retry-After for a model served before a restart and not yet published again,
`router.pools.pool.PoolTable.awaiting`), let the pool's policy pick a ready endpoint (503 +
Retry-After if none), forward the original body bytes to `{endpoint.url}{path}` with only the
allow-listed client headers (`FORWARDED_REQUEST_HEADERS`), and relay status, content type and
body. A pool with a
per-endpoint concurrency limit holds a request that finds every ready endpoint full in its
admission queue (`router.pools.admission`; 503 when the queue is full or the wait times out). Each
request is recorded in its model's windowed stats (`router.stats.windows`): arrival, queue time
(arrival until dispatch), client-side TTFT, TPOT (streamed) and end-to-end latency. Streamed
bodies are relayed as they arrive: SSE event by event through `router.protocol.sse.SseRelay`, which
also times the token events (`fleet_router_time_to_first_token_seconds`,
`fleet_router_time_per_output_token_seconds`); an SSE stream the engine cuts off ends with an
OpenAI error event and `data: [DONE]`, not a truncated body. A connection failure before
any response byte arrived is retried on an endpoint not yet tried (at most
`min(max_attempts, ready endpoints)` attempts, then 502). Each attempt has a first-token
deadline (`router.request.deadline`: the pool's `first_token_timeout_s`, else from the prompt's expected
prefill): a streamed answer's head is held back until its first body chunk, and an attempt with
no first chunk (streamed) or head (not streamed) by then is closed and, like a 5xx answer, sent
to another endpoint while the pool's `max_retries` allow (then 504 `first_token_timeout`, or the
5xx); once bytes went to the client nothing is retried. Every attempt's outcome feeds outlier
ejection (`router.pools.outlier`, through `Pool.record_outcome`). Upstream 4xx and 5xx are relayed
with their status, in OpenAI's error format (`router.protocol.errors.relayed_error`; error events inside
a stream too). Every error the router
answers itself is in OpenAI's format and counted in `fleet_router_rejected_requests_total`
(`RouterMetrics.reject`); what it reflects of the request (the model name) is truncated.

This is the hot path (figures: docs/benchmarks.md, "The router against `vllm-router`"): raw ASGI, aiohttp
client, pre-bound metric children, no per-request logging. Keep it that way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.request.asgi_io import (
    CLOSE,
    DISCONNECT_WATCH_DELAY_S,
    BodyTooLarge,
    Receive,
    Scope,
    Send,
    ClientWatch,
    parse_request,
    read_body,
    reflect,
    send_json,
)
from router.request.deadline import FirstTokenBudget, first_token_timeout_s
from router.stats.metrics import EndpointMetrics, RouterMetrics
from router.pools.endpoint import DEFAULT_FAILURE_COOLDOWN_S, EndpointState
from router.kv.exact_index import Claim
from router.pools.outlier import Outcome
from router.pools.pool import Pool, PoolShared, PoolTable
from router.kv.prompt_blocks import SESSION_HEADER, RouteRequest, route_request
from router.pools.split import sticky_key
from router.kv.tokenize import PoolTokenizers
from router.protocol.errors import MAX_ERROR_BODY_BYTES, error_body, relayed_error
from router.protocol.sse import SseRelay
from router.protocol.tokens import body_tokens, stream_tokens

log = logging.getLogger(__name__)


DEFAULT_MAX_ATTEMPTS = 3
"""Endpoints tried per request when connections fail before any response byte (capped by
the pool's ready endpoints)."""
DEFAULT_RETRY_AFTER_S = 2
"""Retry-After (seconds) of a 503 for a pool with no ready endpoint: long enough not to spin,
short enough to catch an endpoint that a controller is just adding."""
DEFAULT_CONNECT_TIMEOUT_S = 5.0
"""Seconds to open a TCP connection to an endpoint before trying another."""
DEFAULT_KEEPALIVE_TIMEOUT_S = 4.0
"""Idle upstream connections are closed after this many seconds: below the 5 s keep-alive of
uvicorn and vLLM (`VLLM_HTTP_TIMEOUT_KEEP_ALIVE`), so the router never reuses a connection
the engine is closing (which would fail the request before any byte and cost a retry)."""
DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body accepted (bytes; 413 above): room for long prompts and inline images."""
MAX_LISTED_MODELS = 20
"""Most model names a 404 lists."""

FORWARDED_REQUEST_HEADERS = frozenset({b"authorization", b"x-request-id", b"traceparent", b"tracestate"})
"""The client's request headers forwarded to the engine; every other one stays at the router.
What vLLM's OpenAI server reads from a request: `authorization` (its `--api-key` check),
`x-request-id` (its request id, `--enable-request-id-headers`), `traceparent` and `tracestate`
(W3C trace context, vLLM's `TRACE_HEADERS` for OpenTelemetry). An allow-list, not a block-list:
hop-by-hop headers (RFC 9110 section 7.6.1: `Connection` and the headers it names, `Keep-Alive`,
`Proxy-*`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`) describe the client's connection to
the router, not the router's to the engine; headers the router acts on itself (`x-session-id`,
`accept-encoding`: bodies are relayed unencoded) or that the client library adds (`user-agent`,
`x-stainless-*`, cookies) mean nothing to an engine; and a client's headers must never be able to
steer it (say, a forged `host` or `content-length`). A header that `Connection` names is dropped
even if listed here. The router sets `content-type: application/json` itself (it has parsed the
body as JSON; aiohttp would otherwise send `application/octet-stream` for a client that sent
none, which vLLM's FastAPI refuses)."""

HOP_BY_HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
                                b"proxy-authorization", b"te", b"trailer", b"transfer-encoding", b"upgrade"})  # fmt: skip
"""RFC 9110 section 7.6.1's hop-by-hop headers (and the obsolete `Proxy-Connection`): never
forwarded, whatever `forward_headers` says."""

_SESSION_HEADER = SESSION_HEADER.encode()
# Response headers relayed to the client besides the status line.
_RELAY_RESPONSE_HEADERS = frozenset({b"content-type", b"content-encoding", b"retry-after", b"x-request-id"})

# Failures that happen before the endpoint sent a single response byte, so the request can
# go to another endpoint: connect refused / reset / timed out, or the connection closed
# before the status line arrived.
_RETRYABLE = (
    aiohttp.ClientOSError,  # includes ClientConnectorError (refused, unreachable, reset)
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientConnectionResetError,
    aiohttp.ConnectionTimeoutError,
)
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)

_CONNECT = "connect"
"""`_Retry.kind` of a connection that failed before any response byte (its own attempt budget)."""


class StreamStalled(aiohttp.ClientPayloadError):
    """A stream that sent nothing for its idle limit after it began (set on the response's content
    by `_StreamIdle`); handled like any stream the engine broke off."""


class _StreamIdle:
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


class _Retry:
    """An attempt that sent nothing to the client: `kind` (`_CONNECT`, or the `router.pools.outlier.Outcome`
    of a stall or a 5xx) and, for a 5xx, `answer`: (status, OpenAI-shaped body, headers) to relay if
    the request is not retried."""

    __slots__ = ("kind", "answer")

    def __init__(self, kind: Outcome | str,
                 answer: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None) -> None:  # fmt: skip
        self.kind = kind
        self.answer = answer


def _outcome_of(status: int) -> Outcome:
    """A 5xx status as outlier detection counts it: 502/503/504 are gateway failures (Envoy)."""
    return Outcome.GATEWAY_FAILURE if status in (502, 503, 504) else Outcome.SERVER_ERROR


def _count(value: object) -> int:
    """A positive int field of the request body, else 0."""
    return value if type(value) is int and value > 0 else 0

def _nothing() -> None:
    """The default load-change hook: nobody listens."""


class Proxy:
    """Raw ASGI handler of the proxied paths, with one shared aiohttp `ClientSession`.

    `clock` returns seconds (monotonic; default `time.perf_counter` via `create_app`) and
    times every measurement. `start()` opens the session (at lifespan startup; called
    lazily otherwise) and `close()` closes it. Timeouts: `connect_timeout_s` to open an
    upstream connection; `read_timeout_s` (None: unlimited, as generations can take
    minutes) between two reads from the endpoint. `failure_cooldown_s`: how long an
    endpoint whose connection failed is skipped (see `router.pools.endpoint.DEFAULT_FAILURE_COOLDOWN_S`).
    `max_body_bytes`: the largest request body (413 beyond it). `forward_headers`: the client
    headers forwarded to the engine (lower-case names; `FORWARDED_REQUEST_HEADERS`; ValueError
    for a hop-by-hop one). `tokenizers`: the pools' tokenizers (`router.kv.tokenize.PoolTokenizers`;
    a pool naming a tokenizer directory gets `RouteRequest.token_ids` for text and chat prompts
    while its policy `wants_token_ids`; the pool's first request starts the load).
    `first_token_budget`: the default first-token deadline's parameters for
    pools that set no `first_token_timeout_s` (`router.request.deadline`).
    """

    def __init__(
        self,
        pools: PoolTable,
        metrics: RouterMetrics,
        clock: Callable[[], float],
        *,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_after_s: int = DEFAULT_RETRY_AFTER_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        read_timeout_s: float | None = None,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        failure_cooldown_s: float = DEFAULT_FAILURE_COOLDOWN_S,
        forward_headers: frozenset[bytes] = FORWARDED_REQUEST_HEADERS,
        tokenizers: PoolTokenizers | None = None,
        first_token_budget: FirstTokenBudget = FirstTokenBudget(),
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {max_attempts}")
        hop_by_hop = sorted(h.decode() for h in forward_headers & HOP_BY_HOP_HEADERS)
        if hop_by_hop or any(h != h.lower() for h in forward_headers):
            raise ValueError(f"forward_headers must be lower-case end-to-end headers; hop-by-hop: {hop_by_hop}")
        self._forward_headers = forward_headers
        self._pools = pools
        self._metrics = metrics
        self._clock = clock
        self._max_attempts = max_attempts
        self._retry_after = [(b"retry-after", str(int(retry_after_s)).encode())]
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._keepalive_timeout_s = keepalive_timeout_s
        self._max_body_bytes = max_body_bytes
        self._failure_cooldown_s = failure_cooldown_s
        self._budget = first_token_budget
        self._session: aiohttp.ClientSession | None = None
        self.tokenizers = tokenizers if tokenizers is not None else PoolTokenizers()
        self._load_changed: Callable[[], None] = _nothing
        self._claimed: Callable[[str, Claim], None] | None = None

    def on_load_change(self, notify: Callable[[], None]) -> None:
        """Call `notify()` whenever an endpoint's load as this router sent it changes (dispatch,
        first byte, finish): the peer channel's sender (`router.signals.peer_channel.PeerSender.notify`)."""
        self._load_changed = notify

    def on_claim(self, claimed: Callable[[str, Claim], None]) -> None:
        """Call `claimed(model, claim)` at each dispatch whose policy claimed the prompt's blocks
        at the endpoint (`RouteRequest.claim`): the peer channel's sender
        (`router.signals.peer_channel.PeerSender.send_claim`)."""
        self._claimed = claimed

    async def start(self) -> None:
        """Open the upstream client session (no connection limit, keep-alive)."""
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_timeout_s)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),  # a proxy must not carry cookies across clients
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
            )

    async def close(self) -> None:
        """Close the client session and its connections."""
        if self._session is not None:
            await self._session.close()
            self._session = None
        self.tokenizers.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        query: bytes = scope.get("query_string", b"")
        try:  # the server answers 408 to a body that does not arrive in time: we see a disconnect
            body = await read_body(receive, self._max_body_bytes)
        except BodyTooLarge:
            await self._reject(send, 413, "", error_body(
                f"request body exceeds {self._max_body_bytes} bytes", code="request_too_large"), CLOSE)  # fmt: skip
            return
        if body is None:
            return  # the client is gone

        model, doc, problem = parse_request(body, path)
        if model is None or doc is None:
            await self._reject(send, 400, "", problem or b"")
            return
        pool = self._pools.get(model)
        if pool is None:
            if self._pools.awaiting(model):
                self._metrics.reject(model, 503, True)   # a model of the models file: a bounded label
                await send_json(send, 503, error_body(
                    f"model {reflect(model)} is not available yet: the router restarted and its pools are being "
                    "published again; retry later", type_="server_error", code="model_not_published"),
                    self._retry_after)  # fmt: skip
                return
            models = self._pools.models()
            known = ", ".join(reflect(m) for m in models[:MAX_LISTED_MODELS]) or "(none)"
            if len(models) > MAX_LISTED_MODELS:
                known += f" and {len(models) - MAX_LISTED_MODELS} more (GET /v1/models)"
            await self._reject(send, 404, model, error_body(
                f"model {reflect(model)} is not served here; known models: {known}", param="model",
                code="model_not_found"))  # fmt: skip
            return
        arrival_s = self._clock()
        session = None
        forward = self._forward_headers
        forwarded: list[tuple[bytes, bytes]] = []
        connection = b""
        for k, v in scope["headers"]:
            if k in forward:
                forwarded.append((k, v))
            elif k == _SESSION_HEADER:
                session = v.decode("latin-1")
            elif k == b"connection":
                connection += b"," + v
        request = route_request(doc, session, hash_blocks=pool.policy.uses_prompt_blocks)
        if pool.tokenizer is not None and request.token_ids is None:
            if pool.policy.wants_token_ids():
                # Text or chat: the pool's own tokenizer gives the ids the engines' KV events name
                # (router.kv.tokenize; a long prompt in a worker thread; None: the approximate view).
                ids = await self.tokenizers.token_ids(pool.tokenizer, doc)
                if ids is not None:
                    request.token_ids = ids
                    if not isinstance(doc.get("prompt"), list):   # a batch counts all its prompts
                        request.prompt_tokens = len(ids)
                pool = self._pools.get(model) or pool   # replaced while tokenizing: route on the new one
            else:
                self.tokenizers.want(pool.tokenizer)   # loaded before the policy needs it
        shared = pool.shared
        shared.arrived(arrival_s)
        limited = pool.limit is not None
        # With an admission limit, first come first served: nobody overtakes a waiting request.
        key = sticky_key(pool.sticky_key, scope["headers"], doc)   # keeps a user on one revision (router.pools.split)
        endpoint = None if limited and shared.queue.has_waiters() else pool.pick(request, arrival_s, key=key)
        if endpoint is None and (not limited or not pool.ready):
            await self._reject(send, 503, model, error_body(
                f"model {model!r} has no ready endpoint; retry later", type_="server_error",
                code="no_ready_endpoint"), self._retry_after, shared)  # fmt: skip
            return
        if endpoint is not None:
            shared.dispatched(arrival_s, arrival_s)

        if connection and forwarded:  # the headers Connection names are hop-by-hop too
            named = {token.strip().lower() for token in connection.split(b",")}
            forwarded = [(k, v) for k, v in forwarded if k not in named]
        headers = [("content-type", "application/json")]
        headers += [(k.decode("latin-1"), v.decode("latin-1")) for k, v in forwarded]
        target = f"{path}?{query.decode('latin-1')}" if query else path
        if self._session is None:
            await self.start()
        watch = ClientWatch(receive, DISCONNECT_WATCH_DELAY_S)
        try:
            if endpoint is None:
                admitted = await self._wait_for_slot(model, pool, request, arrival_s, send, watch, key)
                if admitted is None:
                    return  # answered 503
                pool, endpoint = admitted
            attempts = min(self._max_attempts, len(pool.ready))
            retries_left = pool.max_retries
            stream = doc.get("stream") is True
            max_tokens = _count(doc.get("max_completion_tokens")) or _count(doc.get("max_tokens")) or None
            tried = [endpoint]
            while True:
                timeout_s = first_token_timeout_s(pool.first_token_timeout_s, request.prompt_tokens,
                                                  endpoint.prefill_tokens, stream=stream, max_tokens=max_tokens,
                                                  budget=self._budget)  # fmt: skip
                may_retry = retries_left > 0 and len(tried) < len(pool.ready)
                retry = await self._attempt(endpoint, request, target, body, headers, send, watch,
                                            arrival_s, pool, timeout_s, may_retry)  # fmt: skip
                if retry is None:
                    return  # the client got its response (or is gone)
                if retry.kind is _CONNECT:
                    if len(tried) >= attempts:
                        break
                elif not may_retry:
                    break
                else:
                    retries_left -= 1
                # Retry on the pool as it is now: the controller may have drained or removed
                # endpoints since the request came in (endpoints that stay are the same objects).
                current = self._pools.get(model)
                if current is None:
                    break   # deleted meanwhile: nothing to retry on
                pool = current
                # A retry has waited its turn already: it may exceed the admission limit.
                next_endpoint = pool.pick(request, self._clock(), tried, within_limit=False, key=key)
                if next_endpoint is None:
                    break
                endpoint = next_endpoint
                tried.append(endpoint)
                self._metrics.retries.labels(model).inc()
            watch.finishing = True
            if retry.kind is Outcome.STALL:
                await self._reject(send, 504, model, error_body(
                    f"model {model!r}: no first token within the deadline from {len(tried)} endpoint(s) "
                    f"({', '.join(e.id for e in tried)}); retry later", type_="server_error",
                    code="first_token_timeout"), shared=shared)  # fmt: skip
                return
            if retry.answer is not None:  # a 5xx kept for a retry that did not happen: relayed now
                status, answer, kept = retry.answer
                await send_json(send, status, answer, kept)
                return
            log.warning("model %s: no endpoint answered after %d attempt(s): %s", model, len(tried),
                        ", ".join(e.id for e in tried))  # fmt: skip
            await self._reject(send, 502, model, error_body(
                f"no endpoint of model {model!r} could be reached ({len(tried)} attempt(s))",
                type_="server_error", code="upstream_unavailable"), shared=shared)  # fmt: skip
        except asyncio.CancelledError:
            if watch.gone:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # we cancelled ourselves
                return
            raise
        finally:
            watch.stop()

    async def _wait_for_slot(self, model: str, pool: Pool, request: RouteRequest, arrival_s: float, send: Send,
                             watch: ClientWatch, key: str | None = None) -> tuple[Pool, EndpointState] | None:  # fmt: skip
        """Wait in the model's admission queue until an endpoint of the model's current pool
        has a free slot; return that pool and endpoint, or answer 503 (queue full, timed out,
        pool gone) and return None. Records the queue time at dispatch."""
        shared = pool.shared
        queue = shared.queue
        if len(queue) >= pool.max_queue_length:
            watch.finishing = True
            await self._reject(send, 503, model, error_body(
                f"model {model!r}: all endpoints are busy and {len(queue)} requests are queued; retry later",
                type_="server_error", code="queue_full"), self._retry_after, shared)  # fmt: skip
            return None
        deadline_s = arrival_s + pool.queue_timeout_s
        front = False
        while await queue.wait(deadline_s - self._clock(), front=front):
            current = self._pools.get(model)
            if current is None:
                break
            now_s = self._clock()
            endpoint = current.pick(request, now_s, key=key)
            if endpoint is not None:
                shared.dispatched(arrival_s, now_s)
                return current, endpoint
            front = True  # the slot went to a retry: wait again, first in line
        shared.gave_up(arrival_s, self._clock())   # the wait so far is a queue-time sample
        watch.finishing = True
        if self._pools.get(model) is None:   # deleted while the request waited
            message, code = f"model {model!r} was removed while the request waited; retry later", "no_ready_endpoint"
        else:
            message, code = f"model {model!r}: no endpoint slot freed within {pool.queue_timeout_s:g} s; retry later", \
                "queue_timeout"  # fmt: skip
        await self._reject(send, 503, model, error_body(message, type_="server_error", code=code),
                           self._retry_after, shared)  # fmt: skip
        return None

    def _count_rejection(self, model: str, status: int) -> None:
        self._metrics.reject(model, status, self._pools.get(model) is not None)

    async def _reject(self, send: Send, status: int, model: str, body: bytes,
                      extra_headers: list[tuple[bytes, bytes]] | None = None,
                      shared: PoolShared | None = None) -> None:  # fmt: skip
        self._count_rejection(model, status)
        if shared is not None:
            shared.rejected(self._clock())
        await send_json(send, status, body, extra_headers)

    async def _attempt(self, endpoint: EndpointState, request: RouteRequest, target: str, body: bytes,
                       headers: list[tuple[str, str]], send: Send, watch: ClientWatch, arrival_s: float,
                       pool: Pool, timeout_s: float | None, may_retry: bool) -> _Retry | None:  # fmt: skip
        """Send the request to `{endpoint.url}{target}` (path and query) and relay the answer;
        a `_Retry` means nothing has been sent to the client and another endpoint may take it.

        Returns a `_Retry` when the connection failed before any response byte arrived, when no
        first token (streamed) or response head (not streamed) came within `timeout_s`
        (`router.request.deadline`; None: no deadline), or, with `may_retry`, when the endpoint answered
        a 5xx (the `_Retry` then holds the answer, to relay if no retry happens). In every other
        case the client got a response (relayed, 502/504, or a stream ended by an error event)
        or is gone. Each attempt's outcome is counted for outlier ejection (`Pool.record_outcome`).

        A streamed reply's response head is held back until its first body chunk, so a stall
        before the first token leaves the client untouched. Time to first byte is measured to the
        first body chunk of a streamed response and to the response head of a sized one (an
        engine sends a non-streamed head with its body, when generation is done). It feeds the
        first-byte EWMA and histogram for < 400 only; a streamed (SSE) < 400 reply also gives its
        time to first token and time per output token (`router.protocol.sse`). The model's windowed stats
        get the client-side latencies, from ``arrival_s``: TTFT (first byte; < 400 only), TPOT and
        end-to-end, stamped at completion. A finished request frees its slot: the next request
        waiting in the admission queue is woken. The request's `prefill_tokens` (the prompt tokens
        the policy expects the endpoint to compute) count as its queued prefill work until the
        first byte (`EndpointState.start` / `first_byte` / `finish`); its `cached_tokens` (what the
        policy expects the endpoint to hold) are counted beside the engine's own figure when the
        usage gives one (`EndpointMetrics.count_tokens`).
        """
        prefill_tokens = request.prefill_tokens
        predicted_cached = request.cached_tokens
        m = endpoint.metrics
        assert m is not None  # endpoints of a PoolTable always have their metrics
        if not m.bound:
            m.bind()  # series appear at an endpoint's first request (cheap pool updates)
        assert self._session is not None
        shared = pool.shared
        endpoint.start(prefill_tokens)
        self._load_changed()
        if request.claim is not None and self._claimed is not None:
            self._claimed(pool.model, request.claim)
        first = [prefill_tokens]   # emptied when the first byte releases the prefill charge
        clock = self._clock
        start_s = clock()
        resp: aiohttp.ClientResponse | None = None
        first_chunk: bytes | None = None   # a streamed body's first chunk, read within the deadline
        first_chunk_s = 0.0
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        within = asyncio.timeout_at(deadline)   # the first-token deadline (router.request.deadline)
        try:
            try:
                async with within:
                    resp = await self._session.post(endpoint.url + target, data=body, headers=headers)
                    if resp.status < 400 and (resp.content_type == "text/event-stream" or resp.content_length is None):
                        first_chunk = await resp.content.readany()
                        first_chunk_s = clock()
            except _RETRYABLE as exc:
                if resp is not None:  # the head came, the body's first read failed: not a connect failure
                    return await self._upstream_failed(endpoint, m, resp, send, watch, pool, arrival_s, start_s, exc)
                now_s = clock()
                endpoint.record_failure(now_s, self._failure_cooldown_s)
                m.error("connect").inc()
                self._count_outcome(pool, endpoint, m, Outcome.GATEWAY_FAILURE, now_s)
                log.debug("endpoint %s (%s): connection failed before response: %r", endpoint.id, endpoint.url, exc)
                return _Retry(_CONNECT)
            except _UPSTREAM_ERRORS as exc:
                if isinstance(exc, TimeoutError) and within.expired():
                    return self._stalled(endpoint, m, resp, pool, arrival_s, start_s, timeout_s)
                return await self._upstream_failed(endpoint, m, resp, send, watch, pool, arrival_s, start_s, exc)
            except BaseException:   # cancelled (the client left) after the head, before the first chunk:
                if resp is not None:   # nothing else would close it, and the engine would go on generating
                    resp.close()
                raise
            headers_s = clock()
            completed = False
            retry: _Retry | None = None
            try:
                status = resp.status
                m.requests(status).inc()
                if status >= 500:
                    endpoint.record_failure(headers_s)
                    m.error("http_5xx").inc()
                relay = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() in _RELAY_RESPONSE_HEADERS]
                content_type = resp.content_type
                length = resp.content_length
                first_byte_s: float | None
                sse: SseRelay | None = None
                if status >= 400 and content_type != "text/event-stream":
                    answer = await self._read_error(endpoint, m, resp, status, relay, send, watch)
                    completed = answer is not None
                    if answer is not None and status >= 500 and may_retry:
                        retry = _Retry(_outcome_of(status), (status, *answer))
                    elif answer is not None:
                        watch.finishing = True
                        await send_json(send, status, *answer)
                    first_byte_s = headers_s
                elif content_type == "text/event-stream":
                    sse = SseRelay()
                    first_byte_s = await self._relay_stream(endpoint, m, resp, status, relay, send, watch, sse, first,
                                                            first_chunk, first_chunk_s, timeout_s)  # fmt: skip
                    completed = first_byte_s is not None
                elif length is not None:
                    completed = await self._relay_whole(endpoint, m, resp, status, relay, send, watch,
                                                        predicted_cached)  # fmt: skip
                    first_byte_s = headers_s
                else:
                    first_byte_s = await self._relay_stream(endpoint, m, resp, status, relay, send, watch, None, first,
                                                            first_chunk, first_chunk_s, timeout_s)  # fmt: skip
                    completed = first_byte_s is not None
                end_s = clock()
                if sse is not None and status < 400:
                    m.count_tokens(stream_tokens(sse), predicted_cached)   # tokens in and out (router.protocol.tokens)
                ok = completed and status < 500
                self._count_outcome(pool, endpoint, m, Outcome.SUCCESS if ok else
                                    _outcome_of(status) if status >= 500 else Outcome.GATEWAY_FAILURE, end_s)
                # TTFT (first token, as the client sees it) and TPOT: streamed replies only.
                first_token_s = sse.first_token_s if ok and sse is not None else None
                tpot = sse.time_per_output_token_s() if first_token_s is not None else None
                if completed and retry is None:
                    assert first_byte_s is not None
                    m.e2e.observe(end_s - start_s)
                    if status < 400:  # errors are not latency samples (5xx got a penalty above)
                        m.first_byte.observe(first_byte_s - start_s)
                        if first_token_s is not None:
                            m.ttft.observe(first_token_s - start_s)
                            if tpot is not None:
                                m.tpot.observe(tpot)
                    shared.completed(endpoint, arrival_s=arrival_s, dispatch_s=start_s, first_byte_s=first_byte_s,
                                     end_s=end_s, succeeded=status < 400, tpot_s=tpot)  # fmt: skip
                # Per revision, for canary analysis (router.stats.request_log).
                shared.finished(endpoint, arrival_s=arrival_s, dispatch_s=start_s, end_s=end_s,
                                first_token_s=first_token_s, tpot_s=tpot,
                                e2e_s=end_s - arrival_s if completed and retry is None else None,
                                failed=not ok)  # fmt: skip
            finally:
                if completed:
                    resp.release()
                else:
                    resp.close()
            return retry
        finally:
            endpoint.finish(prefill_tokens, not first)
            self._load_changed()
            if shared.queue.has_waiters() and not endpoint.draining:
                shared.queue.wake(1)

    def _count_outcome(self, pool: Pool, endpoint: EndpointState, m: EndpointMetrics, outcome: Outcome,
                       now_s: float) -> None:  # fmt: skip
        """Report an attempt's outcome for outlier ejection; count and log an ejection it causes.
        A success after successes costs one attribute read (the hot path)."""
        if outcome is Outcome.SUCCESS and not endpoint.outlier.consecutive_5xx:
            return
        if pool.record_outcome(endpoint, outcome, now_s):
            state = endpoint.outlier
            m.ejected(state.reason)
            log.warning("endpoint %s (%s) of model %s ejected for %.0f s (%s; ejection %d)", endpoint.id,
                        endpoint.url, pool.model, state.ejected_until_s - now_s, state.reason,
                        state.ejections_total)  # fmt: skip

    def _stalled(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse | None, pool: Pool,
                 arrival_s: float, start_s: float, timeout_s: float | None) -> _Retry:  # fmt: skip
        """The attempt got no first token within `timeout_s`: the connection is closed (vLLM aborts
        the request when its client goes), the stall counted against the endpoint, and the request
        handed back for a retry (nothing was sent to the client)."""
        if resp is not None:
            resp.close()
        now_s = self._clock()
        endpoint.record_failure(now_s)
        m.first_token_timeouts.inc()
        self._count_outcome(pool, endpoint, m, Outcome.STALL, now_s)
        pool.shared.finished(endpoint, arrival_s=arrival_s, dispatch_s=start_s, end_s=now_s, first_token_s=None,
                             tpot_s=None, e2e_s=None, failed=True)  # fmt: skip
        log.warning("endpoint %s (%s): no first token within %.1f s (stalls in a row: %d)", endpoint.id,
                    endpoint.url, timeout_s or 0.0, endpoint.outlier.consecutive_stalls)  # fmt: skip
        return _Retry(Outcome.STALL)

    async def _upstream_failed(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse | None,
                               send: Send, watch: ClientWatch, pool: Pool, arrival_s: float, start_s: float,
                               exc: BaseException) -> None:  # fmt: skip
        """The endpoint failed before anything was sent to the client, in a way not retried (an
        aiohttp read timeout, a broken response): 504 or 502 in OpenAI's format."""
        if resp is not None:
            resp.close()
        timed_out = isinstance(exc, asyncio.TimeoutError)
        now_s = self._clock()
        endpoint.record_failure(now_s)
        m.error("timeout" if timed_out else "interrupted").inc()
        self._count_outcome(pool, endpoint, m, Outcome.GATEWAY_FAILURE, now_s)
        pool.shared.finished(endpoint, arrival_s=arrival_s, dispatch_s=start_s, end_s=now_s, first_token_s=None,
                             tpot_s=None, e2e_s=None, failed=True)  # fmt: skip
        log.warning("endpoint %s (%s): request failed: %r", endpoint.id, endpoint.url, exc)
        watch.finishing = True
        status = 504 if timed_out else 502
        self._count_rejection(m.labels[0], status)
        await send_json(send, status, error_body(
            f"endpoint {endpoint.id} failed: {type(exc).__name__}", type_="server_error",
            code="upstream_timeout" if timed_out else "upstream_error"))  # fmt: skip
        return None

    async def _relay_whole(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse,
                           status: int, headers: list[tuple[bytes, bytes]], send: Send,
                           watch: ClientWatch, predicted_cached: int) -> bool:  # fmt: skip
        """Relay a sized, non-streamed body in one piece; False if the endpoint failed.
        `predicted_cached`: the policy's expected prefix-cache hit here, for the token counters."""
        try:
            data = await resp.read()
        except _UPSTREAM_ERRORS as exc:
            await self._failed_mid_response(endpoint, m, send, watch, "body", exc)
            return False
        headers.append((b"content-length", str(len(data)).encode()))
        if status < 400:
            m.count_tokens(body_tokens(data), predicted_cached)   # tokens in and out (router.protocol.tokens)
        watch.finishing = True
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})
        return True

    async def _failed_mid_response(self, endpoint: EndpointState, m: EndpointMetrics, send: Send,
                                   watch: ClientWatch, what: str, exc: BaseException) -> None:
        """The endpoint failed while its (non-streamed) ``what`` was read: counted against it,
        and the client gets 502 ``upstream_error`` in OpenAI's format."""
        endpoint.record_failure(self._clock())
        m.error("interrupted").inc()
        log.warning("endpoint %s (%s): %s read failed: %r", endpoint.id, endpoint.url, what, exc)
        watch.finishing = True
        self._count_rejection(m.labels[0], 502)
        await send_json(send, 502, error_body(f"endpoint {endpoint.id} failed mid-response",
                                              type_="server_error", code="upstream_error"))  # fmt: skip

    async def _read_error(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse,
                          status: int, headers: list[tuple[bytes, bytes]], send: Send,
                          watch: ClientWatch) -> tuple[bytes, list[tuple[bytes, bytes]]] | None:  # fmt: skip
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
        except _UPSTREAM_ERRORS as exc:
            await self._failed_mid_response(endpoint, m, send, watch, "error body", exc)
            return None
        body = relayed_error(status, b"".join(chunks)[:MAX_ERROR_BODY_BYTES], resp.content_type)
        return body, [(k, v) for k, v in headers if k not in (b"content-type", b"content-encoding")]

    async def _relay_stream(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse,
                            status: int, headers: list[tuple[bytes, bytes]], send: Send, watch: ClientWatch,
                            sse: SseRelay | None, first: list[int], first_chunk: bytes | None,
                            first_chunk_s: float, idle_s: float | None = None) -> float | None:  # fmt: skip
        """Relay the body as it arrives (SSE: whole events, through `sse`); return the clock time
        of the first body chunk (or of the end, for an empty body), None if the endpoint failed
        midway. At the first chunk the prefill charge in `first` is released (`first` is emptied).
        `first_chunk` (read at `first_chunk_s`, within the first-token deadline; b"" for an empty
        body) goes out first, with the response head; None: the head goes out at once. A stream
        silent for `idle_s` seconds after it began (the attempt's first-token deadline: no gap
        between tokens outlasts a prefill of the whole prompt, the most a preempted request
        recomputes; None: no limit) is cut as below (`_StreamIdle`; a gateway failure for outlier
        detection).

        On failure an SSE stream ends with an OpenAI error event and `data: [DONE]` (what vLLM
        sends when generation fails mid-stream; OpenAI clients raise it as an `APIError`);
        another body is left incomplete, so the ASGI server closes the connection and the
        client sees a truncated body, not a clean end.
        """
        await send({"type": "http.response.start", "status": status, "headers": headers})
        first_byte_s: float | None = None
        clock = self._clock
        idle = _StreamIdle(resp.content, idle_s) if idle_s is not None else None
        loop_time = asyncio.get_running_loop().time
        try:
            if first_chunk:
                first_byte_s = first_chunk_s
                endpoint.first_byte(first.pop())
                self._load_changed()
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
                        self._load_changed()
                    chunk = sse.feed(chunk, now_s)
                    if not chunk:
                        continue  # a partial event, held back until its end arrives
                elif first_byte_s is None:
                    first_byte_s = clock()
                    endpoint.first_byte(first.pop())
                    self._load_changed()
                if idle is not None:
                    idle.sending = True   # a client slow to read is not a silent engine
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                if idle is not None:
                    idle.last_s = loop_time()
                    idle.sending = False
        except _UPSTREAM_ERRORS as exc:
            endpoint.record_failure(clock())
            m.error("interrupted").inc()
            log.warning("endpoint %s (%s): stream interrupted: %r", endpoint.id, endpoint.url, exc)
            if sse is not None and sse.aligned:
                watch.finishing = True
                await send({"type": "http.response.body", "more_body": False, "body": stream_error_tail(
                    f"endpoint {endpoint.id} failed mid-stream ({type(exc).__name__}); the response is incomplete")})
            return None
        finally:
            if idle is not None:
                idle.stop()
        if first_byte_s is None:
            first_byte_s = clock()
        watch.finishing = True
        await send({"type": "http.response.body", "body": sse.rest() if sse is not None else b"", "more_body": False})
        return first_byte_s


def stream_error_tail(message: str) -> bytes:
    """The end of an SSE stream that failed: an OpenAI error event, then `data: [DONE]`."""
    error = error_body(message, type_="server_error", code="upstream_interrupted")
    return b"data: " + error + b"\n\ndata: [DONE]\n\n"
