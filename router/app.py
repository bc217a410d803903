"""The router's ASGI application: a raw dispatcher in front of a FastAPI app.

Owns `create_app` and `RouterApp`. `RouterApp` sends `POST /v1/completions` and
`POST /v1/chat/completions` straight to `router.proxy.Proxy` (the hot path: no framework
routing, validation or middleware) and everything else to a FastAPI app: `GET /v1/models`,
`GET /health`, `GET /metrics` and the admin API (`router.admin`). It handles the ASGI
lifespan itself, opening and closing the proxy's client session.
Called by `router.server.serve` (uvicorn) and by tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry

from router.admin import admin_router
from router.metrics import RouterMetrics
from router.pool import DEFAULT_FAILURE_COOLDOWN_S, PoolTable
from router.proxy import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETRY_AFTER_S,
    PROXIED_PATHS,
    Proxy,
    Receive,
    Scope,
    Send,
    error_body,
    send_json,
)

log = logging.getLogger(__name__)


class RouterApp:
    """ASGI app of the router. Attributes: `pools` (`PoolTable`), `metrics`
    (`RouterMetrics`), `proxy` (`Proxy`), `api` (the FastAPI sub-app)."""

    def __init__(self, pools: PoolTable, metrics: RouterMetrics, proxy: Proxy, api: FastAPI) -> None:
        self.pools = pools
        self.metrics = metrics
        self.proxy = proxy
        self.api = api

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            if scope["path"] in PROXIED_PATHS:
                if scope["method"] == "POST":
                    await self.proxy(scope, receive, send)
                else:
                    body = error_body(f"method {scope['method']} is not allowed; use POST", code="method_not_allowed")
                    await send_json(send, 405, body, [(b"allow", b"POST")])
            else:
                await self.api(scope, receive, send)
        elif kind == "lifespan":
            await self._lifespan(receive, send)
        else:
            await self.api(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.proxy.start()
                except Exception as exc:  # report to the server instead of crashing the lifespan task
                    log.exception("router startup failed")
                    await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.proxy.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _build_api(pools: PoolTable, metrics: RouterMetrics, admin_token: str) -> FastAPI:
    api = FastAPI(title="Fleet router", docs_url=None, redoc_url=None, openapi_url=None)

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

    @api.get("/metrics")
    async def prometheus_metrics(request: Request) -> Response:
        """Prometheus exposition of the router's registry (format negotiated from Accept)."""
        body, content_type = metrics.render(request.headers.get("accept", ""))
        return Response(content=body, headers={"content-type": content_type})

    api.include_router(admin_router(pools, admin_token))
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
    """
    if not admin_token:
        raise ValueError("admin_token must not be empty")
    metrics = RouterMetrics(registry)
    pools = PoolTable(metrics, wall_clock, clock)
    proxy = Proxy(
        pools,
        metrics,
        clock,
        max_attempts=max_attempts,
        retry_after_s=retry_after_s,
        connect_timeout_s=connect_timeout_s,
        read_timeout_s=read_timeout_s,
        failure_cooldown_s=failure_cooldown_s,
    )
    return RouterApp(pools, metrics, proxy, _build_api(pools, metrics, admin_token))
