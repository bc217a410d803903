"""Client of the router's admin API, used by the controller to publish pools.

Owns `RouterAdminClient` (httpx, bearer token), the real `fleet.controller.pools.PoolSink`, the
autoscaler's source of router statistics (`stats`) and the canary analysis' source of
per-revision samples (`revision_samples`, a `fleet.rollout.revisions.AnalysisSource`). The pool document is `router.pools.spec.PoolSpec`,
defined once and parsed by the router itself. The API itself is served by `router.http.admin`.
"""

from __future__ import annotations

import httpx

from fleet.rollout.revisions import RequestSample
from router.pools.spec import PoolSpec


KEEPALIVE_EXPIRY_S = 4.0
"""Idle connections are dropped after this many seconds: below uvicorn's 5 s keep-alive, so a
poll every 5 s (the autoscaler's) never reuses a connection the router is closing
(`RemoteProtocolError: Server disconnected without sending a response`)."""


class RouterAdminError(Exception):
    """The router's admin API refused or failed a call."""


class RouterAdminClient:
    def __init__(self, base_url: str, token: str, timeout_s: float = 5.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s,
            limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        )

    def set_token(self, token: str) -> None:
        """Use a new admin token from now on (the router was restarted with it)."""
        self._http.headers["Authorization"] = f"Bearer {token}"

    async def aclose(self) -> None:
        await self._http.aclose()

    async def put_pool(self, model: str, pool: PoolSpec) -> None:
        r = await self._request("PUT", f"/admin/v1/pools/{model}", json=pool.model_dump(mode="json"))
        if r.status_code != 200:
            raise RouterAdminError(f"PUT pool {model}: HTTP {r.status_code}: {r.text[:300]}")

    async def delete_pool(self, model: str) -> None:
        r = await self._request("DELETE", f"/admin/v1/pools/{model}")
        if r.status_code not in (200, 404):
            raise RouterAdminError(f"DELETE pool {model}: HTTP {r.status_code}: {r.text[:300]}")

    async def pools(self) -> dict:
        r = await self._request("GET", "/admin/v1/pools")
        if r.status_code != 200:
            raise RouterAdminError(f"GET pools: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()["pools"]

    async def stats(self, window_s: float) -> dict[str, dict]:
        """Windowed statistics per model (`GET /admin/v1/stats`; `router.stats.windows.ModelStats.snapshot`)."""
        r = await self._request("GET", "/admin/v1/stats", params={"window_s": window_s})
        if r.status_code != 200:
            raise RouterAdminError(f"GET stats: HTTP {r.status_code}: {r.text[:300]}")
        return r.json()["models"]

    async def revision_samples(self, model: str, window_s: float) -> list[RequestSample]:
        """Finished requests of ``model`` in the last ``window_s`` seconds by revision and endpoint
        (`GET /admin/v1/revisions/{model}`): the controller's `fleet.rollout.revisions.AnalysisSource`.
        Raises RouterAdminError (the analysis run is then an error, never a failure)."""
        r = await self._request("GET", f"/admin/v1/revisions/{model}", params={"window_s": min(window_s, 3600.0)})
        if r.status_code != 200:
            raise RouterAdminError(f"GET revisions {model}: HTTP {r.status_code}: {r.text[:300]}")
        return [RequestSample.from_row(row) for row in r.json()["rows"]]

    async def mark_synced(self) -> None:
        """`POST /admin/v1/synced`: every pool is published; the router's `/ready` turns 200.
        Raises RouterAdminError."""
        r = await self._request("POST", "/admin/v1/synced")
        if r.status_code != 200:
            raise RouterAdminError(f"POST synced: HTTP {r.status_code}: {r.text[:300]}")

    async def in_flight(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for pool in (await self.pools()).values():
            for ep in pool["endpoints"]:
                out[ep["id"]] = out.get(ep["id"], 0) + int(ep["in_flight"])
        return out

    async def healthy(self) -> bool:
        try:
            r = await self._http.get("/health", timeout=1.0)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    async def _request(self, method: str, path: str, **kw) -> httpx.Response:
        try:
            return await self._http.request(method, path, **kw)
        except httpx.HTTPError as err:
            raise RouterAdminError(f"{method} {path}: {type(err).__name__}: {err}") from err
