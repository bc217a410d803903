"""Every router pod gets every pool update: the operator's `fleet.controller.PoolSink` over
the router Deployment's pods.

Owns `RouterFanout`: the admin API of each running router pod (found by label selector through
an informer; ``http://<podIP>:<admin port>``), written to concurrently. A write counts only when
every router took it (else it raises, and the controller publishes again next tick, to all:
pool writes are idempotent). In-flight counts are summed over routers (each holds its own
requests). `new_routers` tells the operator that a router appeared, so every pool is published
again (`Controller.forget_published_pools`). Called by `fleet.k8s.operator`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fleet.router_admin import RouterAdminClient, RouterAdminError
from router.spec import PoolSpec


class RouterFanout:
    """`PoolSink` fanning out to router pods. ``pods``: returns the router pod objects (an
    informer's cache); ``static_urls``: admin URLs always written (tests, a router outside)."""

    def __init__(self, pods: Callable[[], list[dict]], admin_port: int, token: str,
                 static_urls: tuple[str, ...] = (), timeout_s: float = 5.0) -> None:  # fmt: skip
        self.pods = pods
        self.admin_port = admin_port
        self.token = token
        self.static_urls = tuple(u for u in static_urls if u)
        self.timeout_s = timeout_s
        self._clients: dict[str, RouterAdminClient] = {}
        self._known: set[str] = set()

    def urls(self) -> list[str]:
        """Admin URLs of the routers now: running, with an IP, not being deleted."""
        out = list(self.static_urls)
        for pod in self.pods():
            status = pod.get("status") or {}
            if status.get("phase") == "Running" and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                out.append(f"http://{status['podIP']}:{self.admin_port}")
        return sorted(set(out))

    def new_routers(self) -> bool:
        """Whether a router appeared since the last call (its pools must all be published)."""
        now = set(self.urls())
        fresh = bool(now - self._known)
        self._known = now
        return fresh

    def _client(self, url: str) -> RouterAdminClient:
        if url not in self._clients:
            self._clients[url] = RouterAdminClient(url, self.token, timeout_s=self.timeout_s)
        return self._clients[url]

    async def _all(self, call) -> list:
        urls = self.urls()
        if not urls:
            raise RouterAdminError("no router pod is running")
        results = await asyncio.gather(*(call(self._client(u)) for u in urls), return_exceptions=True)
        errors = [f"{u}: {r}" for u, r in zip(urls, results) if isinstance(r, BaseException)]
        if errors:
            raise RouterAdminError("; ".join(errors))
        for url in set(self._clients) - set(urls):   # routers that went
            await self._clients.pop(url).aclose()
        return results

    async def put_pool(self, model: str, pool: PoolSpec) -> None:
        await self._all(lambda c: c.put_pool(model, pool))

    async def delete_pool(self, model: str) -> None:
        await self._all(lambda c: c.delete_pool(model))

    async def in_flight(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for counts in await self._all(lambda c: c.in_flight()):
            for rid, n in counts.items():
                total[rid] = total.get(rid, 0) + n
        return total

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
