"""The router's admin API: a controller declares each model's pool here.

Owns the FastAPI `APIRouter` mounted at `/admin/v1` and its bearer-token check. Built by
`router.http.app.create_app`; called over HTTP by the control plane (Fleet's controller), which
PUTs the full endpoint list of a pool whenever it changes and polls `GET /admin/v1/pools`
to see when a draining endpoint has no request in flight.

Endpoints (all need `Authorization: Bearer <admin token>`, else 401; `router.http.app.RouterApp`
checks it before reading the body, and bounds the body; the check here is a second line):
`PUT /admin/v1/pools/{model}` (body: `router.pools.spec.PoolSpec`) creates or replaces a pool and
answers a summary (400 for a body that is not JSON or nests deeper than `MAX_JSON_DEPTH`, 422
naming the field for a bad document);
`DELETE /admin/v1/pools/{model}` removes one (404 if absent);
`GET /admin/v1/pools` lists all pools with live endpoint stats (and each endpoint's outlier state:
ejected, for how long, why, stalls; `router.pools.outlier.OutlierState.snapshot`);
`GET /admin/v1/pools/{model}` shows one pool;
`GET /admin/v1/stats?window_s=30` gives each model's windowed statistics (`router.stats.windows`):
arrival rate, rejections, in flight, queued, and queue time / TTFT / TPOT / end-to-end summaries, and
per revision (`revisions`: requests, errors, TTFT and TPOT of streamed replies, end-to-end, queue
time; `router.stats.request_log.revision_summaries`);
`GET /admin/v1/revisions/{model}?window_s=60` lists the model's finished requests by revision
and endpoint (TTFT, TPOT, end-to-end, queue time, failed), what canary analysis compares;
`POST /admin/v1/synced` says every pool has been published: the router's `GET /ready` turns 200.
A PUT or DELETE also settles a model the router served before it restarted
(`router.pools.pool.PoolTable.awaiting`) and has the models file rewritten (`router.http.remembered`).

Pools of thousands of endpoints never hold the event loop long: documents are validated and
listed in slices between yields (`YIELD_EVERY`), PUTs and DELETEs apply in arrival order under
one lock, and garbage collection is paused while a pool is swapped (`_gc_paused`); the figures
are in docs/benchmarks.md ("The router under hostile input and large pools").
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import secrets
from collections.abc import Iterator, Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, HTTPException, Path, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_json

from router.pools.endpoint import EndpointState
from router.protocol.jsonlimit import JsonTooDeep, loads_bounded
from router.pools.pool import PoolTable
from router.http.remembered import ModelsFile
from router.pools.spec import MAX_ENDPOINTS_PER_POOL, EndpointSpec, PoolSpec
from router.stats.windows import DEFAULT_RATE_RETENTION_S, DEFAULT_WINDOW_S

ADMIN_PREFIX = "/admin/"
"""Paths under this prefix are the admin API's (guarded by `router.http.app.RouterApp`)."""

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


YIELD_EVERY = 500
"""Endpoints handled between two yields to the event loop while a pool document is validated or
listed, so a pool of 10,000 endpoints never holds the loop (and the requests it relays) for more
than a few milliseconds at a time."""


MAX_JSON_DEPTH = 16
"""Deepest nesting of arrays and objects an admin JSON body may have (400 beyond): a pool
document nests 3 levels (document, endpoint list, endpoint). Checked before parsing
(`router.protocol.jsonlimit`), so a 50,000-deep body costs a few linear passes, not a `RecursionError`."""


class InvalidJson(HTTPException):
    """An admin body that is not JSON, or nested deeper than `MAX_JSON_DEPTH`: 400, code
    `invalid_json`, the message saying which (`router.http.app` renders it in OpenAI's format)."""

    code = "invalid_json"

    def __init__(self, message: str) -> None:
        super().__init__(400, message)


async def _validate_pool(body: bytes) -> PoolSpec:
    """Parse and validate a pool document, `YIELD_EVERY` endpoints at a time.

    Raises `InvalidJson` (400) for a body that is not JSON or nests deeper than `MAX_JSON_DEPTH`,
    `RequestValidationError` (a 422 naming the field) for a bad document."""
    try:
        doc = loads_bounded(body, MAX_JSON_DEPTH)
    except JsonTooDeep as exc:
        raise InvalidJson(f"invalid JSON: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise InvalidJson(f"invalid JSON: {exc}") from None
    try:
        endpoints = doc.get("endpoints") if isinstance(doc, dict) else None
        if isinstance(endpoints, list) and len(endpoints) > YIELD_EVERY:
            validated: list[EndpointSpec] = []
            for start in range(0, min(len(endpoints), MAX_ENDPOINTS_PER_POOL + 1), YIELD_EVERY):
                batch = endpoints[start:start + YIELD_EVERY]
                try:
                    validated.extend(_ENDPOINT_LIST.validate_python(batch))
                except ValidationError as exc:
                    errors = exc.errors()
                    raise RequestValidationError(
                        [{**e, "loc": ("body", "endpoints", e["loc"][0] + start, *e["loc"][1:])} for e in errors]
                    ) from None
                await asyncio.sleep(0)
            doc = {**doc, "endpoints": validated + endpoints[len(validated):]}  # instances are not re-validated
        return PoolSpec.model_validate(doc)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None


async def _pool_json(head: dict[str, object], endpoints: Sequence[EndpointState], now_s: float) -> bytes:
    """`head` plus `"endpoints": [...]` as JSON (each endpoint's outlier state at `now_s`, router-clock
    seconds), encoded `YIELD_EVERY` endpoints at a time (`pydantic_core.to_json`, Rust, for each slice)."""
    parts = []
    for start in range(0, len(endpoints), YIELD_EVERY):
        parts.append(to_json([e.snapshot(now_s) for e in endpoints[start:start + YIELD_EVERY]])[1:-1])
        if len(endpoints) > YIELD_EVERY:
            await asyncio.sleep(0)
    return to_json(head)[:-1] + b',"endpoints":[' + b",".join(parts) + b"]}"


_ENDPOINT_LIST: TypeAdapter[list[EndpointSpec]] = TypeAdapter(list[EndpointSpec])


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No automatic garbage collection inside: replacing a pool of 10,000 endpoints allocates and
    drops tens of thousands of objects, and the collections they trigger took most of the time
    (measured: 60-90 ms with collections, 24 ms without, for one 10,000-endpoint replacement).
    The young objects are collected once afterwards, at the next allocation threshold."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _json_response(body: bytes) -> Response:
    return Response(content=body, media_type="application/json")


ModelName = Annotated[str, Path(min_length=1, max_length=256, description="Model name, as clients send it in `model`.")]


def admin_router(pools: PoolTable, admin_token: str, models_file: ModelsFile | None = None) -> APIRouter:
    """The `/admin/v1` router over `pools`, guarded by `admin_token` (compared in constant time).
    `models_file`: told after each PUT and DELETE (`router.http.remembered`); None: no file."""
    if not admin_token:
        raise ValueError("admin_token must not be empty")
    expected = admin_token.encode()

    async def require_admin(authorization: Annotated[str | None, Header()] = None) -> None:
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), expected):
            raise HTTPException(401, "missing or invalid admin bearer token", headers={"WWW-Authenticate": "Bearer"})

    router = APIRouter(prefix="/admin/v1", dependencies=[Depends(require_admin)], tags=["admin"])

    writing = asyncio.Lock()  # PUTs and DELETEs apply in the order they arrived

    @router.post("/synced")
    async def synced() -> dict[str, object]:
        """The control plane has published every pool it holds: `GET /ready` answers 200 from now on."""
        pools.mark_synced()
        return {"synced": True}

    @router.get("/pools")
    async def list_pools() -> Response:
        """All pools: `{"pools": {model: {"policy", "endpoints": [...]}}}`."""
        now_s = pools.now_s()
        listed = [json.dumps(model).encode() + b":" + await _pool_json(pool.snapshot_head(), pool.endpoints, now_s)
                  for model, pool in sorted(pools.pools().items())]  # fmt: skip
        return _json_response(b'{"pools":{' + b",".join(listed) + b"}}")

    @router.get("/stats")
    async def stats(
        window_s: Annotated[float, Query(gt=0, le=DEFAULT_RATE_RETENTION_S,
                                         description="Window in seconds, ending now.")] = DEFAULT_WINDOW_S,
    ) -> dict[str, object]:
        """Windowed statistics per model: `{"window_s", "models": {model: snapshot}}`, each
        snapshot as `router.stats.windows.ModelStats.snapshot` documents it (seconds, requests/s)."""
        return {"window_s": window_s, "models": pools.stats(window_s)}

    @router.get("/revisions/{model:path}")
    async def revisions(
        model: ModelName,
        window_s: Annotated[float, Query(gt=0, le=3600, description="Window in seconds, ending now.")] = 60.0,
    ) -> dict[str, object]:
        """Finished requests of `model` in the window by revision and endpoint, for canary
        analysis: `{"window_s", "rows": [[version, endpoint, age_s, ttft_s, tpot_s, e2e_s,
        queue_time_s, failed], ...]}` (`router.stats.request_log`); 404 if the model has no pool."""
        out = pools.revision_samples(model, window_s)
        if out is None:
            raise HTTPException(404, f"no pool for model {model!r}")
        return out

    @router.get("/pools/{model:path}")
    async def get_pool(model: ModelName) -> Response:
        """One pool with live endpoint stats; 404 if the model has no pool."""
        pool = pools.get(model)
        if pool is None:
            raise HTTPException(404, f"no pool for model {model!r}")
        return _json_response(await _pool_json({"model": model, **pool.snapshot_head()}, pool.endpoints,
                                                 pools.now_s()))

    @router.put("/pools/{model:path}")
    async def put_pool(model: ModelName, request: Request) -> Response:
        """Create or replace the pool of `model` (body: `router.pools.spec.PoolSpec`; 422 naming the
        field otherwise); stats of unchanged endpoints are kept. Answers the new pool without
        its endpoint list (`GET` lists it): `{"model", "policy", ..., "endpoints_total",
        "endpoints_ready"}`."""
        body = await request.body()  # already in memory: router.http.app read it, bounded
        async with writing:
            spec = await _validate_pool(body)
            with _gc_paused():
                pool = pools.put(model, spec)
            if models_file is not None:
                models_file.changed()
        summary = {"model": model, **pool.snapshot_head(), "endpoints_total": len(pool.endpoints),
                   "endpoints_ready": len(pool.ready)}  # fmt: skip
        return _json_response(to_json(summary))

    @router.delete("/pools/{model:path}")
    async def delete_pool(model: ModelName) -> dict[str, object]:
        """Remove the pool of `model`; in-flight requests finish; 404 if absent."""
        async with writing:
            with _gc_paused():
                deleted = pools.delete(model)
            if models_file is not None:
                models_file.changed()
            if not deleted:
                raise HTTPException(404, f"no pool for model {model!r}")
        return {"model": model, "deleted": True}

    return router
