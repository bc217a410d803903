"""Attempt step of the request path: one try of a request on one endpoint.

Owns `Attempts` (one per `router.request.proxy.Proxy`, with the aiohttp client session it posts
with) and `Retry` (an attempt that sent nothing to the client and may go to another endpoint).
Called by `Proxy` once per attempt, retries included. An attempt: charges the request to the
endpoint (`EndpointState.start` ... `finish`), posts the original body with the first-token
deadline (`router.request.deadline`), maps what goes wrong to an outcome (a connection failure
before any response byte, a stall past the deadline, a 5xx, a broken response: `Retry`, or the
client's 502/504), hands the answer to `router.request.relay.Relay`, and records the outcome:
outlier ejection (`router.pools.pool.Pool.record_outcome`), the endpoint's and the model's
latency samples (`router.pools.pool.PoolShared.completed`, `finished`) and the endpoint's series.

Hot path (docs/benchmarks.md, "The router against `vllm-router`"): a successful attempt costs one
post, pre-bound metric children and no logging.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.kv.prompt_blocks import RouteRequest
from router.pools.endpoint import EndpointState
from router.pools.outlier import Outcome
from router.pools.pool import Pool
from router.protocol.errors import error_body
from router.protocol.sse import SseRelay
from router.protocol.tokens import stream_tokens
from router.request.asgi_io import ClientWatch, Send, send_json
from router.request.parse import ParsedRequest
from router.request.refuse import Refusals
from router.request.relay import BROKEN, UPSTREAM_ERRORS, Relay, StreamPlan, StreamStalled
from router.stats.endpoint_metrics import EndpointMetrics

log = logging.getLogger(__name__)

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

CONNECT = "connect"
"""`Retry.kind` of a connection that failed before any response byte (its own attempt budget)."""


Opened = tuple[aiohttp.ClientResponse, bytes | None, float]
"""An attempt's response whose head (and, streamed, first body chunk) came within the deadline:
(response, first body chunk or None, the chunk's clock time)."""


MIGRATE = "migrate"
"""`Retry.kind` of a stream its engine broke off after the client got part of it: the client's
stream is open, waiting for a continuation (`router.request.migrate`) or its error ending."""


class Retry:
    """An attempt whose client is still waiting: `kind` (`CONNECT`, the `router.pools.outlier.Outcome`
    of a stall, a 5xx or a broken answer while nothing was sent, or `MIGRATE`) and, for a 5xx,
    `answer`: (status, OpenAI-shaped body, headers) to relay if the request is not retried. For
    `MIGRATE`: `reason` (`router.request.migrate.MIGRATION_REASONS`) and `tokens` (the tokens this
    attempt streamed)."""

    __slots__ = ("kind", "answer", "reason", "tokens")

    def __init__(self, kind: Outcome | str, answer: tuple[int, bytes, list[tuple[bytes, bytes]]] | None = None,
                 reason: str = "", tokens: int = 0) -> None:  # fmt: skip
        self.kind = kind
        self.answer = answer
        self.reason = reason
        self.tokens = tokens


def outcome_of(status: int) -> Outcome:
    """A 5xx status as outlier detection counts it: 502/503/504 are gateway failures (Envoy)."""
    return Outcome.GATEWAY_FAILURE if status in (502, 503, 504) else Outcome.SERVER_ERROR


class Attempts:
    """Runs attempts (`run`) over one shared aiohttp `ClientSession` (`start`, `close`).

    `clock`: the router's clock (seconds), timing every measurement. `refusals`: where the
    router's own answers are counted (`router.request.refuse.Refusals`). `timeout`: the session's
    connect and read timeouts; `keepalive_timeout_s`: how long an idle upstream connection is kept;
    `failure_cooldown_s`: how long an endpoint whose connection failed is skipped
    (`router.pools.endpoint.DEFAULT_FAILURE_COOLDOWN_S`).
    """

    __slots__ = ("_clock", "_refusals", "_timeout", "_keepalive_timeout_s", "_failure_cooldown_s", "relay",
                 "session")  # fmt: skip

    def __init__(self, clock: Callable[[], float], refusals: Refusals, timeout: aiohttp.ClientTimeout,
                 keepalive_timeout_s: float, failure_cooldown_s: float) -> None:  # fmt: skip
        self._clock = clock
        self._refusals = refusals
        self._timeout = timeout
        self._keepalive_timeout_s = keepalive_timeout_s
        self._failure_cooldown_s = failure_cooldown_s
        self.relay = Relay(clock, refusals.count)
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the upstream client session (no connection limit, keep-alive)."""
        if self.session is None or self.session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=self._keepalive_timeout_s)
            self.session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                cookie_jar=aiohttp.DummyCookieJar(),  # a proxy must not carry cookies across clients
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
            )

    async def close(self) -> None:
        """Close the client session and its connections."""
        if self.session is not None:
            await self.session.close()
            self.session = None

    async def run(self, endpoint: EndpointState, request: RouteRequest, parsed: ParsedRequest, send: Send,
                  watch: ClientWatch, arrival_s: float, pool: Pool, timeout_s: float | None,
                  may_retry: bool, plan: StreamPlan) -> Retry | None:  # fmt: skip
        """Send the request to `{endpoint.url}{parsed.target}` and relay the answer; a `Retry`
        means nothing has been sent to the client and another endpoint may take it.

        Returns a `Retry` when the connection failed before any response byte arrived, when no
        first token (streamed) or response head (not streamed) came within `timeout_s`
        (`router.request.deadline`; None: no deadline), or, with `may_retry`, when the endpoint answered
        a 5xx (the `Retry` then holds the answer, to relay if no retry happens). In every other
        case the client got a response (relayed, 502/504, or a stream ended by an error event)
        or is gone. Each attempt's outcome is counted for outlier ejection (`Pool.record_outcome`):
        an error event inside a 200 stream, a sized body cut off or not a JSON object fail it.

        `plan` (`router.request.relay.StreamPlan`) sets the stream's guard and the request's end
        (`end_at`: past it, a 504 `upstream_timeout` before a head, an error event after), and
        for a continuation of a migrated stream (`plan.continuation`) the body posted instead of
        the client's; a continuation's client has its response head, so anything but an SSE
        stream < 400 fails the attempt. A `Retry` of kind `MIGRATE`: the stream broke between
        two events after the client got part of it (`plan.tape` kept), and is the caller's to
        continue elsewhere or end (`router.request.relay.stream_error_tail`).

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
        m = endpoint.metrics
        assert m is not None  # endpoints of a PoolTable always have their metrics
        if not m.bound:
            m.bind()  # series appear at an endpoint's first request (cheap pool updates)
        endpoint.start(prefill_tokens)
        first = [prefill_tokens]   # emptied when the first byte releases the prefill charge
        start_s = self._clock()
        try:
            opened = await self._open(endpoint, m, parsed, send, watch, pool, arrival_s, start_s, timeout_s, plan,
                                      may_retry)  # fmt: skip
            if type(opened) is not tuple:
                return opened   # a Retry, or None: the client was answered
            return await self._answer(endpoint, m, opened, first, request, send, watch, pool,
                                      arrival_s, start_s, timeout_s, may_retry, plan)  # fmt: skip
        finally:
            endpoint.finish(prefill_tokens, not first)
            queue = pool.shared.queue
            if queue.has_waiters() and not endpoint.draining:
                queue.wake(1)

    async def _open(self, endpoint: EndpointState, m: EndpointMetrics, parsed: ParsedRequest, send: Send,
                    watch: ClientWatch, pool: Pool, arrival_s: float, start_s: float,
                    timeout_s: float | None, plan: StreamPlan, may_retry: bool) -> Opened | Retry | None:  # fmt: skip
        """Post the request and wait, within the first-token deadline, for the response head and,
        for a stream, its first body chunk: `(response, first chunk or None, its clock time)`; a
        `Retry` (connection failed before any response byte, the deadline passed, or, with
        `may_retry`, the engine failed after its head and before its first chunk: the client got
        nothing), or None when the client was answered (a broken response: 502, an aiohttp
        timeout: 504)."""
        assert self.session is not None
        clock = self._clock
        resp: aiohttp.ClientResponse | None = None
        first_chunk: bytes | None = None   # a streamed body's first chunk, read within the deadline
        first_chunk_s = 0.0
        deadline = None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s
        end_at = plan.end_at
        if end_at is not None and (deadline is None or end_at < deadline):
            deadline = end_at   # the request's total-time limit comes first (router.pools.upstream)
        within = asyncio.timeout_at(deadline)   # the first-token deadline (router.request.deadline)
        body = parsed.body if plan.continuation is None else plan.continuation.body
        try:
            async with within:
                resp = await self.session.post(endpoint.url + parsed.target, data=body, headers=parsed.headers)
                if resp.status < 400 and (resp.content_type == "text/event-stream" or resp.content_length is None):
                    first_chunk = await resp.content.readany()
                    first_chunk_s = clock()
        except _RETRYABLE as exc:
            if resp is not None and plan.continuation is not None:
                return self._handed_back(endpoint, m, resp, pool, arrival_s, start_s, exc,
                                         Retry(MIGRATE, reason="interrupted"))  # fmt: skip
            if resp is not None and may_retry:
                return self._handed_back(endpoint, m, resp, pool, arrival_s, start_s, exc,
                                         Retry(Outcome.GATEWAY_FAILURE))  # fmt: skip
            if resp is not None:  # the head came, the body's first read failed: not a connect failure
                return await self._upstream_failed(endpoint, m, resp, send, watch, pool, arrival_s, start_s, exc)
            now_s = clock()
            endpoint.record_failure(now_s, self._failure_cooldown_s)
            m.error("connect").inc()
            self._count_outcome(pool, endpoint, m, Outcome.GATEWAY_FAILURE, now_s)
            log.debug("endpoint %s (%s): connection failed before response: %r", endpoint.id, endpoint.url, exc)
            return Retry(CONNECT)
        except UPSTREAM_ERRORS as exc:
            if isinstance(exc, TimeoutError) and within.expired() and deadline != end_at:
                return self._stalled(endpoint, m, resp, pool, arrival_s, start_s, timeout_s)
            if plan.continuation is not None:   # the client has its head: no 502/504 can follow
                return self._handed_back(endpoint, m, resp, pool, arrival_s, start_s, exc,
                                         Retry(MIGRATE, reason="interrupted"))  # fmt: skip
            if resp is not None and may_retry and not isinstance(exc, TimeoutError):
                return self._handed_back(endpoint, m, resp, pool, arrival_s, start_s, exc,
                                         Retry(Outcome.GATEWAY_FAILURE))  # fmt: skip
            return await self._upstream_failed(endpoint, m, resp, send, watch, pool, arrival_s, start_s, exc)
        except BaseException:   # cancelled (the client left) after the head, before the first chunk:
            if resp is not None:   # nothing else would close it, and the engine would go on generating
                resp.close()
            raise
        return resp, first_chunk, first_chunk_s

    async def _answer(self, endpoint: EndpointState, m: EndpointMetrics,
                      opened: Opened, first: list[int],
                      request: RouteRequest, send: Send, watch: ClientWatch, pool: Pool, arrival_s: float,
                      start_s: float, timeout_s: float | None, may_retry: bool,
                      plan: StreamPlan) -> Retry | None:  # fmt: skip
        """Relay the opened response by its kind (an error body, an SSE stream, a sized body,
        another stream; `router.request.relay.Relay`) and record the attempt (`_record`); a
        `Retry` for a 5xx kept back or a sized body broken before the client got a byte while
        `may_retry`, and for a stream to continue elsewhere (`MIGRATE`)."""
        resp, first_chunk, first_chunk_s = opened
        if plan.continuation is not None and (resp.status >= 400 or resp.content_type != "text/event-stream"):
            return self._handed_back(endpoint, m, resp, pool, arrival_s, start_s,
                                     ValueError(f"a continuation answered {resp.status} {resp.content_type}"),
                                     Retry(MIGRATE, reason="interrupted"))  # fmt: skip
        headers_s = self._clock()
        relay = self.relay
        completed = False
        retry: Retry | None = None
        try:
            status = resp.status
            m.requests(status).inc()
            if status >= 500:
                endpoint.record_failure(headers_s)
                m.error("http_5xx").inc()
            headers = [(k.lower(), v) for k, v in resp.raw_headers if k.lower() in _RELAY_RESPONSE_HEADERS]
            content_type = resp.content_type
            first_byte_s: float | None = headers_s
            sse: SseRelay | None = None
            if status >= 400 and content_type != "text/event-stream":
                answer = await relay.read_error(endpoint, m, resp, status, headers, send, watch)
                completed = answer is not None
                if answer is not None and status >= 500 and may_retry:
                    retry = Retry(outcome_of(status), (status, *answer))
                elif answer is not None:
                    watch.finishing = True
                    await send_json(send, status, *answer)
            elif content_type == "text/event-stream" or resp.content_length is None:
                sse = SseRelay() if content_type == "text/event-stream" else None
                plan.idle_s = timeout_s
                relayed = await relay.stream(endpoint, m, resp, status, headers, send, watch, sse, first,
                                             first_chunk, first_chunk_s, plan)  # fmt: skip
                if relayed == BROKEN:
                    assert sse is not None
                    retry = Retry(MIGRATE, reason="stalled" if isinstance(resp.content.exception(), StreamStalled)
                                  else "interrupted", tokens=sse.output_tokens())  # fmt: skip
                    relayed = None
                first_byte_s = relayed  # type: ignore[assignment]
                completed = first_byte_s is not None
            else:
                whole = await relay.whole(endpoint, m, resp, status, headers, send, watch, request.cached_tokens,
                                          may_retry, plan.max_response_bytes)  # fmt: skip
                completed = bool(whole)
                if whole is None:
                    retry = Retry(Outcome.GATEWAY_FAILURE)
            self._record(endpoint, m, pool, request, status, completed, retry, sse, arrival_s, start_s, first_byte_s)
        finally:
            if completed:
                resp.release()
            else:
                resp.close()
        return retry

    def _record(self, endpoint: EndpointState, m: EndpointMetrics, pool: Pool, request: RouteRequest, status: int,
                completed: bool, retry: Retry | None, sse: SseRelay | None, arrival_s: float, start_s: float,
                first_byte_s: float | None) -> None:  # fmt: skip
        """Record an attempt that got a response head: tokens (streamed), the outcome for outlier
        ejection, the latency samples of a complete answer, the per-revision row."""
        end_s = self._clock()
        if sse is not None and status < 400:
            m.count_tokens(stream_tokens(sse), request.cached_tokens)   # tokens in and out (router.protocol.tokens)
        errored = sse is not None and sse.error_events > 0   # a 200 stream that reported a failure inside
        if errored:
            endpoint.record_failure(end_s)
            m.error("interrupted").inc()
        ok = completed and status < 500 and not errored
        self._count_outcome(pool, endpoint, m, Outcome.SUCCESS if ok else
                            outcome_of(status) if status >= 500 else Outcome.GATEWAY_FAILURE, end_s)  # fmt: skip
        # TTFT (first token, as the client sees it) and TPOT: streamed replies only.
        first_token_s = sse.first_token_s if ok and sse is not None else None
        tpot = sse.time_per_output_token_s() if first_token_s is not None else None
        shared = pool.shared
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
                             end_s=end_s, succeeded=status < 400 and not errored, tpot_s=tpot)  # fmt: skip
        # Per revision, for canary analysis (router.stats.request_log).
        shared.finished(endpoint, arrival_s=arrival_s, dispatch_s=start_s, end_s=end_s,
                        first_token_s=first_token_s, tpot_s=tpot,
                        e2e_s=end_s - arrival_s if completed and retry is None else None,
                        failed=not ok)  # fmt: skip

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
                 arrival_s: float, start_s: float, timeout_s: float | None) -> Retry:  # fmt: skip
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
        return Retry(Outcome.STALL)

    def _handed_back(self, endpoint: EndpointState, m: EndpointMetrics, resp: aiohttp.ClientResponse | None,
                     pool: Pool, arrival_s: float, start_s: float, exc: BaseException,
                     retry: Retry) -> Retry:  # fmt: skip
        """An attempt that failed after the engine's head and before anything of it went to the
        client (a first attempt or a continuation of a migrated stream): counted against the
        endpoint, and the request handed back as `retry` (to retry, or to migrate again or end)."""
        if resp is not None:
            resp.close()
        now_s = self._clock()
        endpoint.record_failure(now_s)
        m.error("interrupted").inc()
        self._count_outcome(pool, endpoint, m, Outcome.GATEWAY_FAILURE, now_s)
        pool.shared.finished(endpoint, arrival_s=arrival_s, dispatch_s=start_s, end_s=now_s, first_token_s=None,
                             tpot_s=None, e2e_s=None, failed=True)  # fmt: skip
        log.warning("endpoint %s (%s): failed before the client got a byte, handed back: %r", endpoint.id,
                    endpoint.url, exc)  # fmt: skip
        return retry

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
        self._refusals.count(m.labels[0], status)
        await send_json(send, status, error_body(
            f"endpoint {endpoint.id} failed: {type(exc).__name__}", type_="server_error",
            code="upstream_timeout" if timed_out else "upstream_error"))  # fmt: skip
        return None
