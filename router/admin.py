"""The router's admin API: a controller declares each model's pool here.

Owns the FastAPI `APIRouter` mounted at `/admin/v1` and its bearer-token check. Built by
`router.app.create_app`; called over HTTP by the control plane (Fleet's controller), which
PUTs the full endpoint list of a pool whenever it changes and polls `GET /admin/v1/pools`
to see when a draining endpoint has no request in flight.

Endpoints (all need `Authorization: Bearer <admin token>`, else 401):
`PUT /admin/v1/pools/{model}` (body: `router.spec.PoolSpec`) creates or replaces a pool;
`DELETE /admin/v1/pools/{model}` removes one (404 if absent);
`GET /admin/v1/pools` lists all pools with live endpoint stats;
`GET /admin/v1/pools/{model}` shows one pool;
`GET /admin/v1/stats?window_s=30` gives each model's windowed statistics (`router.stats`):
arrival rate, rejections, in flight, queued, and queue time / TTFT / end-to-end summaries, and
per revision (`revisions`: requests, errors, TTFT and TPOT of streamed replies, end-to-end, queue
time; `router.revision_stats.revision_summaries`);
`GET /admin/v1/revisions/{model}?window_s=60` lists the model's finished requests by revision
and endpoint (TTFT, TPOT, end-to-end, queue time, failed), what canary analysis compares.
"""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query

from router.pool import PoolTable
from router.spec import PoolSpec
from router.stats import DEFAULT_RATE_RETENTION_S, DEFAULT_WINDOW_S

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

    @router.get("/revisions/{model:path}")
    async def revisions(
        model: ModelName,
        window_s: Annotated[float, Query(gt=0, le=3600, description="Window in seconds, ending now.")] = 60.0,
    ) -> dict[str, object]:
        """Finished requests of `model` in the window by revision and endpoint, for canary
        analysis: `{"window_s", "rows": [[version, endpoint, age_s, ttft_s, tpot_s, e2e_s,
        queue_time_s, failed], ...]}` (`router.revision_stats`); 404 if the model has no pool."""
        out = pools.revision_samples(model, window_s)
        if out is None:
            raise HTTPException(404, f"no pool for model {model!r}")
        return out

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
