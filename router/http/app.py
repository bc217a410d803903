"""The router's ASGI application: a raw dispatcher in front of a FastAPI app.

Owns `create_app` and `RouterApp`. `RouterApp` sends `POST /v1/completions` and
`POST /v1/chat/completions` straight to `router.request.proxy.Proxy` (the hot path: no framework
routing, validation or middleware) and everything else to a FastAPI app: `GET /v1/models`,
`GET /health`, `GET /metrics` and the admin API (`router.http.admin`). It handles the ASGI
lifespan itself, opening and closing the proxy's client session.

Admin requests are guarded here, before FastAPI sees them: the bearer token is checked from the
request head (401 without reading a byte of the body), then the body is read, at most
`MAX_ADMIN_BODY_BYTES` (413 otherwise, the connection closed; the server bounds the time it may
take, `router.http.server.RequestGuardProtocol`), and handed to FastAPI from memory. Every error
answer, FastAPI's included (unknown path 404, 405, 422, an unexpected 500 on any path), is in
OpenAI's error format and counted in `fleet_router_rejected_requests_total`. With a models file
(`create_app(models_path=...)`, `router.http.remembered`) the models it lists start as awaited: 503,
not 404, until the control plane speaks for them.
Called by `router.http.server.serve` (uvicorn) and by tests.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from prometheus_client import CollectorRegistry
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.http.admin import ADMIN_PREFIX, admin_router, validation_message
from router.protocol.errors import error_body, error_type
from router.picker.client import DEFAULT_DEADLINE_S, Locate, PickerClient
from router.signals.kv_streams import KvEventStreams
from router.stats.metrics import RouterMetrics
from router.pools.endpoint import DEFAULT_FAILURE_COOLDOWN_S
from router.signals.engine_poll import EnginePoller
from router.pools.pool import PoolTable
from router.http.remembered import ModelsFile
from router.kv.tokenize import PoolTokenizers
from router.request.asgi_io import CLOSE, PROXIED_PATHS, BodyTooLarge, Message, Receive, Scope, Send, read_body, reflect, send_json
from router.request.proxy import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MAX_ATTEMPTS, DEFAULT_RETRY_AFTER_S, Proxy

log = logging.getLogger(__name__)

MAX_ADMIN_BODY_BYTES = 16 * 1024 * 1024
"""Largest admin request body (bytes; 413 above). A pool document of 10,000 endpoints is about
0.8 MB, so this leaves room for the largest pool `router.pools.spec` accepts at typical id and URL
lengths while keeping what an admin request can make the router hold small."""

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                408: "timeout_error", 413: "invalid_request_error", 422: "invalid_request_error"}  # fmt: skip
_ERROR_CODES = {400: "bad_request", 401: "invalid_admin_token", 404: "not_found", 405: "method_not_allowed",
                408: "request_timeout", 413: "request_too_large", 422: "invalid_document"}  # fmt: skip


def _declared_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The request's Content-Length (None without one, e.g. a chunked body; -1 if malformed)."""
    for name, value in headers:
        if name == b"content-length":
            return int(value) if value.strip().isdigit() else -1
    return None


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    length = _declared_length(headers)
    return (length is not None and length != 0) or any(name == b"transfer-encoding" for name, _ in headers)


class RouterApp:
    """ASGI app of the router. Attributes: `pools` (`PoolTable`), `metrics`
    (`RouterMetrics`), `proxy` (`Proxy`), `api` (the FastAPI sub-app), `models_file`
    (`router.http.remembered.ModelsFile`, or None)."""

    models_file: ModelsFile | None = None
    poller: EnginePoller | None = None
    """Polls the engines' load for `kv-aware` pools (`router.signals.engine_poll`); None: off."""
    picker: PickerClient | None = None
    """The connection to the endpoint picker (`router.picker.client`); None: the router picks alone."""

    def __init__(self, pools: PoolTable, metrics: RouterMetrics, proxy: Proxy, api: FastAPI,
                 admin_token: str) -> None:  # fmt: skip
        if not admin_token:
            raise ValueError("admin_token must not be empty")
        self.pools = pools
        self.metrics = metrics
        self.proxy = proxy
        self.api = api
        self._expected_auth = b"bearer " + admin_token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path = scope["path"]
            if path in PROXIED_PATHS:
                if scope["method"] == "POST":
                    await self._guarded(self.proxy, scope, receive, send)
                else:
                    self.metrics.reject("", 405, False)
                    body = error_body(f"method {scope['method']} is not allowed; use POST", code="method_not_allowed")
                    await send_json(send, 405, body, [(b"allow", b"POST")])
            elif path.startswith(ADMIN_PREFIX):
                await self._guarded(self._admin, scope, receive, send)
            else:
                await self.api(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.api(scope, receive, send)

    async def _guarded(self, handler: Callable[[Scope, Receive, Send], Awaitable[None]], scope: Scope,
                       receive: Receive, send: Send) -> None:  # fmt: skip
        """Run `handler`; an exception escaping it is a bug, not a client error: 500 in OpenAI's
        format if the response has not begun (uvicorn's own 500 is plain text)."""
        try:
            await handler(scope, receive, send)
        except Exception:
            log.exception("router error on %s", scope["path"])
            self.metrics.reject("", 500, False)
            with contextlib.suppress(Exception):  # the response had begun: the server closes it
                await send_json(send, 500, error_body("internal router error", type_="server_error",
                                                      code="internal_error"))  # fmt: skip

    def on_server_reject(self, status: int) -> None:
        """Count an error the HTTP server answered before the app saw the request (a request head
        too slow or too large: `router.http.server.RequestGuardProtocol`)."""
        self.metrics.reject("", status, False)

    async def _admin(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Check the token from the head, read the body within bounds, then hand over to FastAPI."""
        headers = scope["headers"]
        authorization = b""
        for name, value in headers:
            if name == b"authorization":
                authorization = value
                break
        scheme, _, token = authorization.partition(b" ")
        if not secrets.compare_digest(scheme.lower() + b" " + token.strip(), self._expected_auth):
            await self._refuse(send, 401, "missing or invalid admin bearer token",
                               [(b"www-authenticate", b"Bearer"), *(CLOSE if _has_body(headers) else [])])
            return
        if (_declared_length(headers) or 0) > MAX_ADMIN_BODY_BYTES:
            await self._refuse(send, 413, f"admin request body exceeds {MAX_ADMIN_BODY_BYTES} bytes", CLOSE)
            return
        try:
            body = await read_body(receive, MAX_ADMIN_BODY_BYTES)
        except BodyTooLarge:
            await self._refuse(send, 413, f"admin request body exceeds {MAX_ADMIN_BODY_BYTES} bytes", CLOSE)
            return
        if body is None:
            return  # the client is gone
        replayed = False

        async def receive_read_body() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.api(scope, receive_read_body, send)

    async def _refuse(self, send: Send, status: int, message: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.metrics.reject("", status, False)
        await send_json(send, status, error_body(message, type_=_ERROR_TYPES[status], code=_ERROR_CODES[status]),
                        headers)  # fmt: skip

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.proxy.start()
                    if self.poller is not None:
                        await self.poller.start()
                    if self.kv_streams is not None:
                        await self.kv_streams.start()
                    if self.picker is not None:
                        self.picker.start()
                except Exception as exc:  # report to the server instead of crashing the lifespan task
                    log.exception("router startup failed")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.poller is not None:
                    await self.poller.close()
                if self.kv_streams is not None:
                    await self.kv_streams.close()
                if self.picker is not None:
                    await self.picker.close()
                await self.proxy.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _build_api(pools: PoolTable, metrics: RouterMetrics, admin_token: str,
               models_file: ModelsFile | None = None) -> FastAPI:  # fmt: skip
    api = FastAPI(title="Fleet router", docs_url=None, redoc_url=None, openapi_url=None)

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        """FastAPI's own errors (unknown path, method, the admin API's 404) in OpenAI's format."""
        status = exc.status_code
        metrics.reject("", status, False)
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if status == 404 and message == "Not Found":
            message = f"no such path: {request.method} {reflect(request.url.path)}"
        body = error_body(message, type_=_ERROR_TYPES.get(status, error_type(status)),
                          code=getattr(exc, "code", None) or _ERROR_CODES.get(status))  # fmt: skip
        headers = dict(exc.headers or {})
        headers["content-type"] = "application/json"
        return Response(content=body, status_code=status, headers=headers)

    @api.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        """An unexpected error (a bug): 500 in OpenAI's format; the server logs the traceback."""
        metrics.reject("", 500, False)
        body = error_body("internal router error", type_="server_error", code="internal_error")
        return Response(content=body, status_code=500, media_type="application/json")

    @api.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        """422 naming each bad field and why, without echoing the (possibly huge or non-finite) input."""
        metrics.reject("", 422, False)
        body = error_body(validation_message(exc.errors()), code="invalid_document")
        return Response(content=body, status_code=422, media_type="application/json")

    @api.get("/v1/models")
    async def list_models() -> dict[str, object]:
        """OpenAI model list: every model that has a pool (draining or empty ones too)."""
        data = [
            {"id": model, "object": "model", "created": int(pool.created_s), "owned_by": "fleet"}
            for model, pool in sorted(pools.pools().items())
        ]
        return {"object": "list", "data": data}

    @api.get("/health")
    async def health() -> dict[str, str]:
        """Liveness of the router process itself (not of any engine)."""
        return {"status": "ok"}

    @api.get("/ready")
    async def ready() -> Response:
        """Readiness for traffic: 200 once the control plane has published every pool to this
        router (`POST /admin/v1/synced`), 503 before. A restarted router pod knows no pool; as
        Ready it would answer 404 for every model (the chart's readiness probe reads this)."""
        if pools.synced:
            return Response(content=b'{"status":"ready"}', media_type="application/json")
        body = error_body("not ready: waiting for the control plane to publish the pools", type_="server_error",
                          code="not_synced")  # fmt: skip
        return Response(content=body, status_code=503, media_type="application/json", headers={"retry-after": "2"})

    @api.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus exposition of the router's registry (format negotiated from Accept)."""
        body, content_type = await metrics.render_off_loop(request.headers.get("accept", ""))
        return Response(content=body, headers={"content-type": content_type})

    api.include_router(admin_router(pools, admin_token, models_file))
    return api


def create_app(
    admin_token: str,
    *,
    clock: Callable[[], float] = time.perf_counter,
    wall_clock: Callable[[], float] = time.time,
    registry: CollectorRegistry | None = None,
    max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    retry_after_s: int = DEFAULT_RETRY_AFTER_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    read_timeout_s: float | None = None,
    failure_cooldown_s: float = DEFAULT_FAILURE_COOLDOWN_S,
    models_path: Path | None = None,
    engine_load_interval_s: float | None = None,
    picker: tuple[str, int] | tuple[str, int, float] | None = None,
    picker_locate: Locate | None = None,
) -> RouterApp:
    """Build the router's ASGI app with no pools (a controller PUTs them).

    `admin_token`: bearer token of the admin API (non-empty, else ValueError).
    `clock`: monotonic seconds for every latency measurement, the windowed stats and the
    policies' `now_s`.
    `wall_clock`: epoch seconds, only for `created` in `GET /v1/models`.
    `registry`: Prometheus registry to register on (default: a fresh one, never the global).
    `max_attempts`: endpoints tried per request on connection failures (capped by the
    pool's ready endpoints). `retry_after_s`: the Retry-After of a 503 (seconds).
    `connect_timeout_s` / `read_timeout_s`: upstream timeouts (None: unlimited).
    `failure_cooldown_s`: how long an endpoint is skipped after a connection failure.
    `models_path`: the router's models file (`router.http.remembered`): the models it lists answer
    503 + Retry-After, not 404, until the control plane publishes or deletes their pools, and
    the file is kept up to date; None: no file.
    `engine_load_interval_s`: seconds between polls of each `kv-aware` endpoint's `/metrics` for
    its load (`router.signals.engine_poll`; `router.signals.engine_load.DEFAULT_POLL_INTERVAL_S` measured best);
    None: no polling (the router counts only its own load).
    `picker`: (host, port[, deadline in seconds]) of the endpoint picker (`router.picker`): every
    pool asks it for its picks, falling back to its own when it does not answer within the
    deadline (default `router.picker.client.DEFAULT_DEADLINE_S`), and follows no KV event stream
    itself; None: none. `picker_locate`: where the picker is, asked again and again
    (`router.picker.client.Locate`; a router pod passes `fleet.k8s.service_endpoints.ServiceLocator`,
    the picker Service's ready address) instead of a static `picker`; give at most one of the two
    (ValueError otherwise).
    The time a request's head and body may take to arrive is bounded by the server
    (`router.http.server.uvicorn_config`).
    """
    if not admin_token:
        raise ValueError("admin_token must not be empty")
    metrics = RouterMetrics(registry)
    models_file = None
    remembered: list[str] = []
    if models_path is not None:
        def listed() -> list[str]:
            return pools.models() + pools.awaited()   # an awaited model stays listed until settled

        models_file = ModelsFile(models_path, listed, on_write_error=metrics.state_write_errors.inc)
        remembered = models_file.read()
        if remembered:
            log.info("models served before the restart (503 until published again): %s", ", ".join(remembered))
    kv_streams = KvEventStreams(metrics)
    picker_client = None
    if picker is not None and picker_locate is not None:
        raise ValueError("give the picker's address or a way to locate it, not both")
    if picker is not None:
        deadline_s = picker[2] if len(picker) > 2 else DEFAULT_DEADLINE_S  # type: ignore[misc]
        picker_client = PickerClient(picker[0], picker[1], deadline_s=deadline_s, clock=clock,
                                     registry=metrics.registry)  # fmt: skip
    elif picker_locate is not None:
        picker_client = PickerClient(locate=picker_locate, clock=clock, registry=metrics.registry)
    pools = PoolTable(metrics, wall_clock, clock, remembered, kv_streams, picker_client)
    proxy = Proxy(
        pools,
        metrics,
        clock,
        max_attempts=max_attempts,
        retry_after_s=retry_after_s,
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
        failure_cooldown_s=failure_cooldown_s,
        tokenizers=PoolTokenizers(metrics.registry),
    )
    api = _build_api(pools, metrics, admin_token, models_file)
    app = RouterApp(pools, metrics, proxy, api, admin_token)
    app.models_file = models_file
    if engine_load_interval_s is not None:
        app.poller = EnginePoller(pools.load_endpoints, clock, metrics.registry, interval_s=engine_load_interval_s)
    app.kv_streams = kv_streams
    app.picker = picker_client
    return app
