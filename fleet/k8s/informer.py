"""A cache of one kind of object kept by list + watch: what the operator reads instead of
asking the API server every tick.

Owns `Informer`: list (the cache and a resourceVersion), then watch from that version with
bookmarks (a bookmark moves the version on without an object), apply each event to the cache,
watch again where the last one ended; list again on 410 Gone, on any error after a backoff, and
every ``resync_s`` (level-triggered resync: whatever a missed event hid is seen again).
``on_change`` is called after each change so the operator can reconcile at once. Used by the
operator (`fleet.k8s.operator`) for InferenceDeployments, pods, nodes and router pods; its
`items` is the backend's object source (`fleet.k8s.backend.ObjectSource`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fleet.k8s.client import ApiError, Gone, Kube, Resource

log = logging.getLogger("fleet.k8s.informer")


class Informer:
    """Objects of ``res`` in ``namespace`` (None: cluster-wide) matching ``label_selector``."""

    def __init__(self, kube: Kube, res: Resource, namespace: str | None, label_selector: str | None = None, *,
                 resync_s: float = 300.0, watch_timeout_s: float = 290.0, error_backoff_s: float = 1.0,
                 on_change: Callable[[str, dict], None] | None = None, name: str | None = None) -> None:  # fmt: skip
        """``name``: what metrics and logs call it (default: the resource's plural)."""
        self.name = name or res.plural
        self.kube = kube
        self.res = res
        self.namespace = namespace
        self.selector = label_selector
        self.resync_s = resync_s
        self.watch_timeout_s = watch_timeout_s
        self.error_backoff_s = error_backoff_s
        self.on_change = on_change or (lambda type_, obj: None)
        self.objects: dict[tuple[str | None, str], dict] = {}
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.events_handled = 0
        self.lists = 0

    async def items(self) -> list[dict]:
        """The cached objects (waits for the first list)."""
        await self.synced.wait()
        return list(self.objects.values())

    def get(self, name: str, namespace: str | None = None) -> dict | None:
        return self.objects.get((namespace if self.res.namespaced else None, name))

    def _key(self, obj: dict) -> tuple[str | None, str]:
        meta = obj["metadata"]
        return (meta.get("namespace") if self.res.namespaced else None, meta["name"])

    async def relist(self) -> None:
        objs, rv = await self.kube.list(self.res, self.namespace, self.selector)
        fresh = {self._key(o): o for o in objs}
        old = self.objects
        self.objects = fresh
        self.resource_version = rv
        self.lists += 1
        self.synced.set()
        for key, obj in fresh.items():
            if old.get(key, {}).get("metadata", {}).get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self.on_change("ADDED" if key not in old else "MODIFIED", obj)
        for key, obj in old.items():
            if key not in fresh:
                self.on_change("DELETED", obj)

    async def run(self, stop: asyncio.Event) -> None:
        """List and watch until ``stop`` is set."""
        loop = asyncio.get_running_loop()
        need_list = True
        while not stop.is_set():
            try:
                if need_list:
                    await self.relist()
                    need_list = False
                    listed_at = loop.time()
                await self._watch_once(stop, listed_at + self.resync_s)
                if loop.time() >= listed_at + self.resync_s:
                    need_list = True
            except Gone:
                need_list = True
            except (ApiError, OSError, Exception) as err:  # noqa: BLE001 - the API server hiccups; list again
                if stop.is_set():
                    return
                log.warning("%s informer: %s; listing again in %.0f s", self.name, err, self.error_backoff_s)
                need_list = True
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.error_backoff_s)
                except asyncio.TimeoutError:
                    pass

    async def _watch_once(self, stop: asyncio.Event, resync_at: float) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = max(1.0, min(self.watch_timeout_s, resync_at - loop.time()))
        stream = self.kube.watch(self.res, self.namespace, self.resource_version, self.selector, timeout_s=timeout_s)
        stopper = loop.create_task(stop.wait())
        try:
            while True:
                nxt = loop.create_task(anext(stream, None))
                done, _ = await asyncio.wait({nxt, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    return
                event = nxt.result()
                if event is None:
                    return
                self.events_handled += 1
                rv = event.object.get("metadata", {}).get("resourceVersion")
                if rv:
                    self.resource_version = rv
                if event.type == "BOOKMARK":
                    continue
                key = self._key(event.object)
                if event.type == "DELETED":
                    self.objects.pop(key, None)
                else:
                    self.objects[key] = event.object
                self.on_change(event.type, event.object)
        finally:
            stopper.cancel()
            await stream.aclose()
