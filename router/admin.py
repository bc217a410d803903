"""The router's admin API: a controller declares each model's pool here.

Owns the FastAPI `APIRouter` mounted at `/admin/v1` and its bearer-token check. Built by
`router.app.create_app`; called over HTTP by the control plane (Fleet's controller), which
PUTs the full endpoint list of a pool whenever it changes and polls `GET /admin/v1/pools`
to see when a draining endpoint has no request in flight.

Endpoints (all need `Authorization: Bearer <admin token>`, else 401; `router.app.RouterApp`
checks it before reading the body, and bounds the body; the check here is a second line):
`PUT /admin/v1/pools/{model}` (body: `router.spec.PoolSpec`) creates or replaces a pool;
`DELETE /admin/v1/pools/{model}` removes one (404 if absent);
`GET /admin/v1/pools` lists all pools with live endpoint stats;
`GET /admin/v1/pools/{model}` shows one pool;
`GET /admin/v1/stats?window_s=30` gives each model's windowed statistics (`router.stats`):
arrival rate, rejections, in flight, queued, and queue time / TTFT / end-to-end summaries.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query, Response

from router.pool import PoolTable
from router.spec import PoolSpec
from router.stats import DEFAULT_RATE_RETENTION_S, DEFAULT_WINDOW_S

ADMIN_PREFIX = "/admin/"
"""Paths under this prefix are the admin API's (guarded by `router.app.RouterApp`)."""

MAX_VALIDATION_ERRORS = 5
"""Most field errors a 422 message lists."""


def validation_message(errors: Sequence[Any]) -> str:
    """One line naming each bad field and why, from pydantic/FastAPI validation errors
    (`[{"loc": (...), "msg": str, ...}]`), e.g. `body.endpoints.3.weight: Input should be a
    finite number`. Never includes the rejected input (it may be huge or not JSON-encodable)."""
    parts = []
    for error in list(errors)[:MAX_VALIDATION_ERRORS]:
        loc = ".".join(str(part) for part in error.get("loc", ()))[:200]
        parts.append(f"{loc}: {str(error.get('msg', 'invalid'))[:300]}")
    more = len(errors) - MAX_VALIDATION_ERRORS
    if more > 0:
        parts.append(f"and {more} more error(s)")
    return "invalid request: " + "; ".join(parts)


ModelName = Annotated[str, Path(min_length=1, max_length=256, description="Model name, as clients send it in `model`.")]


def admin_router(pools: PoolTable, admin_token: str) -> APIRouter:
    """The `/admin/v1` router over `pools`, guarded by `admin_token` (compared in constant time)."""
    if not admin_token:
        raise ValueError("admin_token must not be empty")
    expected = admin_token.encode()

    async def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected):
            raise HTTPException(401, "missing or invalid admin bearer token", headers={"WWW-Authenticate": "Bearer"})

    router = APIRouter(prefix="/admin/v1", dependencies=[Depends(require_admin)], tags=["admin"])

    @router.get("/pools")
    async def list_pools() -> dict[str, object]:
        """All pools: `{"pools": {model: {"policy", "endpoints": [...]}}}`."""
        return {"pools": {model: pool.snapshot() for model, pool in sorted(pools.pools().items())}}

    @router.get("/stats")
    async def stats(
        window_s: Annotated[float, Query(gt=0, le=DEFAULT_RATE_RETENTION_S,
                                         description="Window in seconds, ending now.")] = DEFAULT_WINDOW_S,
    ) -> dict[str, object]:
        """Windowed statistics per model: `{"window_s", "models": {model: snapshot}}`, each
        snapshot as `router.stats.ModelStats.snapshot` documents it (seconds, requests/s)."""
        return {"window_s": window_s, "models": pools.stats(window_s)}

    @router.get("/pools/{model:path}")
    async def get_pool(model: ModelName) -> dict[str, object]:
        """One pool with live endpoint stats; 404 if the model has no pool."""
        pool = pools.get(model)
        if pool is None:
            raise HTTPException(404, f"no pool for model {model!r}")
        return {"model": model, **pool.snapshot()}

    @router.put("/pools/{model:path}")
    async def put_pool(model: ModelName, spec: PoolSpec) -> dict[str, object]:
        """Create or replace the pool of `model`; stats of unchanged endpoints are kept."""
        pool = pools.put(model, spec)
        return {"model": model, **pool.snapshot()}

    @router.delete("/pools/{model:path}")
    async def delete_pool(model: ModelName) -> dict[str, object]:
        """Remove the pool of `model`; in-flight requests finish; 404 if absent."""
        if not pools.delete(model):
            raise HTTPException(404, f"no pool for model {model!r}")
        return {"model": model, "deleted": True}

    return router
