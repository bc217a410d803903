"""Every router pod gets every pool update: the operator's `fleet.controller.pools.PoolSink` over
the router Deployment's pods.

Owns `RouterFanout`: the admin API of each running router pod (found by label selector through
an informer; ``http://<podIP>:<admin port>``), written to concurrently. A write counts only when
every router took it (else it raises, and the controller publishes again next tick, to all:
pool writes are idempotent). In-flight counts are summed over routers (each holds its own
requests), and windowed statistics merged for the autoscaler (`merge_router_stats`). `new_routers` tells the operator that a router appeared or its process restarted, so every pool
is published again (`Controller.forget_published_pools`) and then the router is told so
(`mark_synced`: its ``/ready``, the pod's readiness probe, turns 200). Called by `fleet.k8s.operator`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleet.controller.router_admin import RouterAdminClient, RouterAdminError
from router.pools.spec import PoolSpec

log = logging.getLogger("fleet.k8s.routers")


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
        self._known: dict[str, str] = {}   # admin URL -> instance key (`_instances`)

    def _instances(self) -> dict[str, str]:
        """Admin URL -> instance key of each router now (running, with an IP, not being deleted).
        The key changes when the pod's router container restarts (its restartCount), since a
        restarted router process knows no pool."""
        out = {u: u for u in self.static_urls}
        for pod in self.pods():
            status = pod.get("status") or {}
            if status.get("phase") == "Running" and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                url = f"http://{status['podIP']}:{self.admin_port}"
                restarts = sum(int(c.get("restartCount") or 0) for c in status.get("containerStatuses") or [])
                out[url] = f"{pod['metadata'].get('uid', url)}/{restarts}"
        return out

    def urls(self) -> list[str]:
        """Admin URLs of the routers now: running, with an IP, not being deleted."""
        return sorted(self._instances())

    def new_routers(self) -> list[str]:
        """Admin URLs of routers that appeared or restarted since the last call: every pool must
        be published to them, then `mark_synced`."""
        now = self._instances()
        fresh = sorted(u for u, key in now.items() if self._known.get(u) != key)
        self._known = now
        return fresh

    def routers_changed(self) -> bool:
        """Whether `new_routers` would name a router now (without consuming it)."""
        return any(self._known.get(u) != key for u, key in self._instances().items())

    def forget(self, urls: list[str]) -> None:
        """Name these routers again at the next `new_routers` (their pools were not all written)."""
        for url in urls:
            self._known.pop(url, None)

    async def mark_synced(self, urls: list[str]) -> None:
        """Tell these routers every pool is published (their `/ready` turns 200). One that does
        not answer is forgotten, so `new_routers` names it again at the next tick."""
        for url in urls:
            try:
                await self._client(url).mark_synced()
            except Exception as err:  # noqa: BLE001 - retried at the next tick
                log.warning("router %s: cannot mark it synced: %s", url, err)
                self._known.pop(url, None)

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

    async def stats(self, window_s: float) -> dict[str, dict]:
        """Windowed statistics per model over every router (`merge_router_stats`): the
        autoscaler's router signals (`fleet.controller.autoscaling.RouterStatsSource`)."""
        return merge_router_stats(await self._all(lambda c: c.stats(window_s)))

    async def revision_samples(self, model: str, window_s: float) -> list:
        """Finished requests of ``model`` by revision over every router pod (each pod records the
        requests it proxied): the controller's `fleet.rollout.revisions.AnalysisSource`, so a
        canary is judged on all of its traffic. Raises RouterAdminError when a pod does not
        answer (the analysis run is then an error, never a failure)."""
        return [s for samples in await self._all(lambda c: c.revision_samples(model, window_s)) for s in samples]

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


_SUMS = ("arrivals", "arrival_rate_per_s", "rejected", "rejected_rate_per_s", "in_flight", "queued")
_LATENCIES = ("queue_time_s", "ttft_s", "e2e_s")


def merge_router_stats(per_router: list[dict[str, dict]]) -> dict[str, dict]:
    """Per-model statistics of several routers (`router.stats.windows.ModelStats.snapshot` each) as one.

    Counts and rates add up; a latency's ``samples`` add up and its ``mean`` is the
    sample-weighted mean (both exact); ``p50``/``p90``/``p99``/``max`` are the largest of the
    routers' (an upper bound: exact with one router, and never below the true value, so the
    autoscaler errs toward more replicas); ``covered_s`` is the smallest. Pure."""
    out: dict[str, dict] = {}
    for stats in per_router:
        for model, s in stats.items():
            m = out.get(model)
            if m is None:
                out[model] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in s.items()}
                continue
            for key in _SUMS:
                m[key] = (m.get(key) or 0) + (s.get(key) or 0)
            m["covered_s"] = min(m.get("covered_s") or 0.0, s.get("covered_s") or 0.0)
            for key in _LATENCIES:
                a, b = m.get(key) or {}, s.get(key) or {}
                na, nb = a.get("samples") or 0, b.get("samples") or 0
                merged = {"samples": na + nb}
                merged["mean"] = ((a["mean"] * na if na else 0.0) + (b["mean"] * nb if nb else 0.0)) / (na + nb) \
                    if na + nb else None  # fmt: skip
                for q in ("p50", "p90", "p99", "max"):
                    values = [x[q] for x, n in ((a, na), (b, nb)) if n and x.get(q) is not None]
                    merged[q] = max(values) if values else None
                m[key] = merged
    return out
