"""The request path: proxy OpenAI completion requests to a pool's endpoints.

Owns `Proxy`, a raw ASGI handler for `POST /v1/completions` and `POST /v1/chat/completions`.
Called by `router.http.app.RouterApp` for those two paths only; everything else goes to the
FastAPI app. `Proxy.__call__` runs the steps of a request in order, each owned by one module of
`router.request`:

1. **read** the body (`asgi_io.read_body`: at most `max_body_bytes`, else 413; the server bounds
   the time, `router.http.server.RequestGuardProtocol`);
2. **parse** it (`parse`: the JSON checks, 400; the headers forwarded, `FORWARDED_REQUEST_HEADERS`);
3. **resolve** the model's pool, once (404; 503 + Retry-After for a model served before a restart
   and not yet published again, `router.pools.pool.PoolTable.awaiting`: `refuse`);
4. **prepare** the routing request (`prepare`: block hashes and token ids, as the pool says its
   policy needs);
5. **admit and pick** (here): the pool's policy picks a ready endpoint (503 + Retry-After if
   none), or the endpoint picker does for a pool that has one (`Pool.picker`, `router.picker.client`;
   the pool's own policy when it does not answer in time); a pool with a per-endpoint concurrency
   limit holds a request that finds every ready
   endpoint full in its admission queue (`router.pools.admission`; 503 when the queue is full or
   the wait times out);
6. **attempt** it (`attempt`: the first-token deadline, `deadline`; error mapping; outlier
   ejection through `Pool.record_outcome`; an error event inside a 200 stream, a sized body cut
   off or not a JSON object fail it) and **relay** the answer (`relay`: status, content type and
   body, a sized body over 1 MiB as it arrives; SSE event by event through
   `router.protocol.sse.SseRelay`, which times the token events; a stream guarded against
   silence, a byte rate under the pool's floor and the request's total-time limit,
   `router.pools.upstream`);
7. **retry or migrate** (here): a connection failure before any response byte goes to an
   endpoint not yet tried (at most `min(max_attempts, ready endpoints)` attempts, then 502); a
   stall past the first-token deadline, a 5xx, or an answer broken before anything reached the
   client goes to another endpoint while the pool's `max_retries` allow (then 504
   `first_token_timeout`, the 5xx, or 502). Once bytes went to the client a stream its engine
   breaks off moves on to another ready endpoint of the same revision, with the prompt and the
   text streamed so far, up to the pool's `migration_limit` times (`migrate`); one that cannot
   move ends with an OpenAI error event and `data: [DONE]`, saying why. A retry or migration
   picks from the pool as it is then (the controller may have changed it).

Each request is recorded in its model's windowed stats (`router.stats.windows`, through
`router.pools.pool.PoolShared`): arrival, queue time (arrival until dispatch), client-side TTFT,
TPOT (streamed) and end-to-end latency. Upstream 4xx and 5xx are relayed with their status, in
OpenAI's format (`router.protocol.errors.relayed_error`). Every error the router answers itself
is in OpenAI's format and counted (`refuse.Refusals`); what it reflects of the request (the model
name) is truncated.

This is the hot path (figures: docs/benchmarks.md, "The router against `vllm-router`"): raw ASGI,
aiohttp client, pre-bound metric children, no per-request logging. Keep it that way.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import aiohttp

from router.kv.prompt_blocks import RouteRequest
from router.kv.tokenize import PoolTokenizers
from router.pools.endpoint import DEFAULT_FAILURE_COOLDOWN_S, EndpointState
from router.pools.outlier import Outcome
from router.pools.pool import PickerTicket, Pool, PoolTable
from router.pools.split import sticky_key
from router.protocol.errors import error_body
from router.request.asgi_io import CLOSE, DISCONNECT_WATCH_DELAY_S, BodyTooLarge, ClientWatch, Receive, Scope, \
    Send, read_body, send_json
from router.request.attempt import CONNECT, MIGRATE, Attempts, Retry
from router.request.deadline import FirstTokenBudget, first_token_timeout_s
from router.request.parse import FORWARDED_REQUEST_HEADERS, ParsedRequest, check_forward_headers, parse
from router.request.migrate import Continuation, Tape, blocker
from router.request.prepare import add_token_ids, routing_request
from router.request.relay import StreamPlan, stream_error_tail
from router.request.refuse import Refusals
from router.stats.metrics import RouterMetrics

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


class Proxy:
    """Raw ASGI handler of the proxied paths (module docstring: the steps of a request).

    `clock` returns seconds (monotonic; default `time.perf_counter` via `create_app`) and
    times every measurement. `start()` opens the upstream session (at lifespan startup; called
    lazily otherwise) and `close()` closes it. Timeouts: `connect_timeout_s` to open an
    upstream connection; `read_timeout_s` (None: unlimited, as generations can take
    minutes) between two reads from the endpoint. `failure_cooldown_s`: how long an
    endpoint whose connection failed is skipped (see `router.pools.endpoint.DEFAULT_FAILURE_COOLDOWN_S`).
    `max_body_bytes`: the largest request body (413 beyond it). `forward_headers`: the client
    headers forwarded to the engine (lower-case names; `FORWARDED_REQUEST_HEADERS`; ValueError
    for a hop-by-hop one). `tokenizers`: the pools' tokenizers (`router.kv.tokenize.PoolTokenizers`;
    a pool naming a tokenizer directory gets `RouteRequest.token_ids` for text and chat prompts
    while it `wants_token_ids`; the pool's first request starts the load).
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
        check_forward_headers(forward_headers)
        self._forward_headers = forward_headers
        self._pools = pools
        self._metrics = metrics
        self._clock = clock
        self._max_attempts = max_attempts
        self._max_body_bytes = max_body_bytes
        self._budget = first_token_budget
        self._refusals = Refusals(pools, metrics, clock, retry_after_s)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s)
        self._attempts = Attempts(clock, self._refusals, timeout, keepalive_timeout_s, failure_cooldown_s)
        self.tokenizers = tokenizers if tokenizers is not None else PoolTokenizers()

    async def start(self) -> None:
        """Open the upstream client session (no connection limit, keep-alive)."""
        await self._attempts.start()

    async def close(self) -> None:
        """Close the client session and its connections, and the tokenizers' workers."""
        await self._attempts.close()
        self.tokenizers.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one proxied request, step by step (module docstring)."""
        refusals = self._refusals
        try:  # the server answers 408 to a body that does not arrive in time: we see a disconnect
            body = await read_body(receive, self._max_body_bytes)
        except BodyTooLarge:
            await refusals.reject(send, 413, "", error_body(
                f"request body exceeds {self._max_body_bytes} bytes", code="request_too_large"), CLOSE)  # fmt: skip
            return
        if body is None:
            return  # the client is gone
        parsed = parse(scope, body, self._forward_headers)
        if isinstance(parsed, bytes):
            await refusals.reject(send, 400, "", parsed)
            return
        pool = self._pools.get(parsed.model)
        if pool is None:
            await refusals.unknown_model(send, parsed.model)
            return
        arrival_s = self._clock()
        request = routing_request(pool, parsed)
        if pool.tokenizer is not None:
            await add_token_ids(self.tokenizers, pool, parsed.doc, request)
        pool.shared.arrived(arrival_s)
        key = sticky_key(pool.sticky_key, scope["headers"], parsed.doc)   # one user, one revision (router.pools.split)
        ticket = None
        if pool.picker is not None and (pool.limit is None or not pool.shared.queue.has_waiters()):
            endpoint, ticket = await self._ask_picker(pool, request, arrival_s, key)
            if ticket is not None:
                send = _ReportFirstByte(send, ticket)
        else:
            endpoint = self._first_pick(pool, request, arrival_s, key)
        if endpoint is None and (pool.limit is None or not pool.ready):
            await refusals.reject(send, 503, parsed.model, error_body(
                f"model {parsed.model!r} has no ready endpoint; retry later", type_="server_error",
                code="no_ready_endpoint"), refusals.retry_after, pool.shared)  # fmt: skip
            return
        if self._attempts.session is None:
            await self.start()
        limit_s = pool.stream_limits.max_stream_duration_s
        end_at = None if limit_s is None else asyncio.get_running_loop().time() + limit_s
        watch = ClientWatch(receive, DISCONNECT_WATCH_DELAY_S)
        try:
            if endpoint is None:
                admitted = await self._wait_for_slot(parsed.model, pool, request, arrival_s, send, watch, key)
                if admitted is None:
                    return  # answered 503
                pool, endpoint = admitted
            await self._serve(pool, endpoint, request, parsed, key, send, watch, arrival_s, end_at)
        except asyncio.CancelledError:
            if watch.gone:
                asyncio.current_task().uncancel()  # type: ignore[union-attr]  # we cancelled ourselves
                return
            raise
        finally:
            watch.stop()
            if ticket is not None:
                ticket.finish()

    async def _ask_picker(self, pool: Pool, request: RouteRequest, arrival_s: float,
                          key: str | None) -> tuple[EndpointState | None, PickerTicket | None]:  # fmt: skip
        """Step 5 with an endpoint picker (`Pool.picker`): the endpoint it chooses among the pool's
        candidates, and its ticket (the picker holds the request's load until `finish`; None when
        the picker was unreachable); when it does not answer in time, the pool's own policy picks
        (its approximate view and this router's load). The prompt's blocks the picker placed are
        recorded as held there in the local policy too, so a fall-back pick finds the prefixes."""
        candidates = pool.candidates(arrival_s, key=key)
        if candidates is None:
            return None, None

        def own_pick() -> int:
            return candidates.index(pool.policy.choose(candidates, request, arrival_s, pool.kv_view))

        index, ticket, answered = await pool.picker.pick(pool.model, [e.id for e in candidates], request,
                                                         own_pick)  # type: ignore[union-attr]
        endpoint = candidates[index]
        if answered:
            pool.policy.learn(endpoint.id, request.block_hashes)
        pool.shared.dispatched(arrival_s, self._clock())
        return endpoint, ticket

    @staticmethod
    def _first_pick(pool: Pool, request: RouteRequest, arrival_s: float, key: str | None) -> EndpointState | None:
        """The endpoint a request takes on arrival, dispatched now; None: none is free (or, with an
        admission limit, others wait already: first come first served, nobody overtakes them)."""
        if pool.limit is not None and pool.shared.queue.has_waiters():
            return None
        endpoint = pool.pick(request, arrival_s, key=key)
        if endpoint is not None:
            pool.shared.dispatched(arrival_s, arrival_s)
        return endpoint

    async def _serve(self, pool: Pool, endpoint: EndpointState, request: RouteRequest, parsed: ParsedRequest,
                     key: str | None, send: Send, watch: ClientWatch, arrival_s: float,
                     end_at: float | None) -> None:  # fmt: skip
        """Attempt the request on `endpoint` and, while the attempts allow, on others of the pool
        as it is at each retry (module docstring, step 7); answer the client if none succeeds.
        `end_at`: the request's end (loop-clock seconds, `router.pools.upstream`; None: none)."""
        attempts = min(self._max_attempts, len(pool.ready))
        retries_left = pool.max_retries
        tried = [endpoint]
        plan = _first_plan(pool, parsed, end_at)
        while True:
            timeout_s = first_token_timeout_s(pool.first_token_timeout_s, request.prompt_tokens,
                                              endpoint.prefill_tokens, stream=parsed.stream,
                                              max_tokens=parsed.max_tokens, budget=self._budget)  # fmt: skip
            may_retry = retries_left > 0 and len(tried) < len(pool.ready)
            retry = await self._attempts.run(endpoint, request, parsed, send, watch, arrival_s, pool, timeout_s,
                                             may_retry, plan)  # fmt: skip
            if retry is None:
                return  # the client got its response (or is gone)
            if retry.kind == MIGRATE:
                await self._migrate(pool, endpoint, request, parsed, key, send, watch, arrival_s, plan, retry, tried)
                return
            if retry.kind is CONNECT:
                if len(tried) >= attempts:
                    break
            elif not may_retry:
                break
            else:
                retries_left -= 1
            # Retry on the pool as it is now: the controller may have drained or removed
            # endpoints since the request came in (endpoints that stay are the same objects).
            current = self._pools.get(parsed.model)
            if current is None:
                break   # deleted meanwhile: nothing to retry on
            pool = current
            # A retry has waited its turn already: it may exceed the admission limit.
            next_endpoint = pool.pick(request, self._clock(), tried, within_limit=False, key=key)
            if next_endpoint is None:
                break
            endpoint = next_endpoint
            tried.append(endpoint)
            self._metrics.retries.labels(parsed.model).inc()
        watch.finishing = True
        await self._give_up(send, parsed.model, pool, retry, tried)

    async def _migrate(self, pool: Pool, endpoint: EndpointState, request: RouteRequest, parsed: ParsedRequest,
                       key: str | None, send: Send, watch: ClientWatch, arrival_s: float, plan: StreamPlan,
                       retry: Retry, tried: list[EndpointState]) -> None:  # fmt: skip
        """Continue a stream its engine broke off on another ready endpoint of the same revision,
        up to the pool's `migration_limit` times (`router.request.migrate`), or end it with an
        OpenAI error event saying why it was not (logged and counted). Each continuation starts
        from every token streamed so far."""
        model, chat = parsed.model, parsed.target.startswith(CHAT_PATH)
        metrics = self._metrics
        loop_time = asyncio.get_running_loop().time
        version = endpoint.version
        generated = retry.tokens
        migrations = 0
        while True:
            broke_at = loop_time()
            why = blocker(parsed.doc, chat) if plan.tape is None else None
            if why is None and migrations >= pool.migration_limit:
                why = "limit"
            if why is None and plan.end_at is not None and broke_at >= plan.end_at:
                why = "duration"
            continuation = None
            if why is None:
                tape = plan.tape
                assert tape is not None   # no blocker: the first plan has a tape
                made = Continuation.of(parsed.doc, chat, tape, generated, parsed.max_tokens)
                if isinstance(made, str):
                    why = made
                else:
                    continuation = made
            picked = self._same_revision(model, version, request, tried, key) if continuation is not None else None
            if continuation is None or picked is None:
                await self._end_broken(send, watch, model, why or "no_endpoint", retry, migrations)
                return
            pool, next_endpoint = picked
            migrations += 1
            metrics.migrations.labels(model, retry.reason).inc()
            tried.append(next_endpoint)
            timeout_s = first_token_timeout_s(pool.first_token_timeout_s, request.prompt_tokens + generated,
                                              next_endpoint.prefill_tokens, budget=self._budget)  # fmt: skip
            limits = pool.stream_limits
            step = StreamPlan(None, limits.min_bytes_per_s, limits.rate_window_s, plan.end_at, plan.tape, continuation)
            again = await self._attempts.run(next_endpoint, request, parsed, send, watch, arrival_s, pool, timeout_s,
                                             False, step)  # fmt: skip
            if continuation.resumed_at is not None:
                metrics.migration_time.labels(model).observe(continuation.resumed_at - broke_at)
            if again is None:
                return   # the stream went on to its end (or the client left)
            # A continuation that got no first event leaves the break as it was.
            retry = again if again.kind == MIGRATE else Retry(MIGRATE, reason="interrupted")
            generated += retry.tokens

    def _same_revision(self, model: str, version: str, request: RouteRequest, tried: list[EndpointState],
                       key: str | None) -> tuple[Pool, EndpointState] | None:  # fmt: skip
        """The model's pool as it is now and the endpoint its policy picks among the ready ones of
        revision `version` not in `tried`; None when there is none (or no pool)."""
        pool = self._pools.get(model)
        if pool is None:
            return None
        others = [e for e in pool.ready if e.version != version]
        endpoint = pool.pick(request, self._clock(), [*tried, *others], within_limit=False, key=key)
        return None if endpoint is None else (pool, endpoint)

    async def _end_broken(self, send: Send, watch: ClientWatch, model: str, why: str, retry: Retry,
                          migrations: int) -> None:  # fmt: skip
        """End a broken stream that is not migrated (again): counted by `why`
        (`router.request.migrate.UNMIGRATED_REASONS`), logged, and an OpenAI error event saying it."""
        self._metrics.unmigrated_streams.labels(model, why).inc()
        log.warning("model %s: a stream broken off (%s) after %d migration(s) is not migrated: %s", model,
                    retry.reason, migrations, why)  # fmt: skip
        watch.finishing = True
        await send({"type": "http.response.body", "more_body": False, "body": stream_error_tail(
            f"the engine failed mid-stream ({retry.reason}) and the stream was not migrated ({why}); "
            "the response is incomplete")})  # fmt: skip

    async def _give_up(self, send: Send, model: str, pool: Pool, retry: Retry, tried: list[EndpointState]) -> None:
        """No attempt answered and none is left: 504 after a stall, the kept 5xx after one, else
        502 (every connection failed)."""
        if retry.kind is Outcome.STALL:
            await self._refusals.reject(send, 504, model, error_body(
                f"model {model!r}: no first token within the deadline from {len(tried)} endpoint(s) "
                f"({', '.join(e.id for e in tried)}); retry later", type_="server_error",
                code="first_token_timeout"), shared=pool.shared)  # fmt: skip
            return
        if retry.answer is not None:  # a 5xx kept for a retry that did not happen: relayed now
            status, answer, kept = retry.answer
            await send_json(send, status, answer, kept)
            return
        log.warning("model %s: no endpoint answered after %d attempt(s): %s", model, len(tried),
                    ", ".join(e.id for e in tried))  # fmt: skip
        await self._refusals.reject(send, 502, model, error_body(
            f"no endpoint of model {model!r} could be reached ({len(tried)} attempt(s))",
            type_="server_error", code="upstream_unavailable"), shared=pool.shared)  # fmt: skip

    async def _wait_for_slot(self, model: str, pool: Pool, request: RouteRequest, arrival_s: float, send: Send,
                             watch: ClientWatch, key: str | None) -> tuple[Pool, EndpointState] | None:  # fmt: skip
        """Wait in the model's admission queue until an endpoint of the model's current pool
        has a free slot; return that pool and endpoint, or answer 503 (queue full, timed out,
        pool gone) and return None. Records the queue time at dispatch."""
        shared = pool.shared
        queue = shared.queue
        refusals = self._refusals
        if len(queue) >= pool.max_queue_length:
            watch.finishing = True
            await refusals.reject(send, 503, model, error_body(
                f"model {model!r}: all endpoints are busy and {len(queue)} requests are queued; retry later",
                type_="server_error", code="queue_full"), refusals.retry_after, shared)  # fmt: skip
            return None
        deadline_s = arrival_s + pool.queue_timeout_s
        front = False
        while await queue.wait(deadline_s - self._clock(), front=front):
            current = self._pools.get(model)   # the pool as it is now: it may have changed while we waited
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
        await refusals.reject(send, 503, model, error_body(message, type_="server_error", code=code),
                              refusals.retry_after, shared)  # fmt: skip
        return None


CHAT_PATH = "/v1/chat/completions"
"""The chat completions path (its continuations differ: `router.request.migrate`)."""


def _first_plan(pool: Pool, parsed: ParsedRequest, end_at: float | None) -> StreamPlan:
    """The `StreamPlan` of a request's first attempt (and its retries while nothing reached the
    client): the pool's stream limits, and a `Tape` when its stream may be migrated (a streamed
    request of a pool with a `migration_limit`, with nothing that rules it out:
    `router.request.migrate.blocker`)."""
    limits = pool.stream_limits
    plan = StreamPlan(None, limits.min_bytes_per_s, limits.rate_window_s, end_at)
    plan.max_response_bytes = limits.max_response_bytes
    if parsed.stream and pool.migration_limit > 0:
        plan.migrate = True
        if blocker(parsed.doc, parsed.target.startswith(CHAT_PATH)) is None:
            plan.tape = Tape()
    return plan

class _ReportFirstByte:
    """The client's `send`, telling the endpoint picker's ticket when the first body byte goes out
    (for a stream, its first event; for a sized reply, the whole body)."""

    __slots__ = ("_send", "_ticket")

    def __init__(self, send: Send, ticket: PickerTicket) -> None:
        self._send = send
        self._ticket = ticket

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            self._ticket.first_byte()
        await self._send(message)
