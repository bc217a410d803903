"""In-repo fake of Fleet's cluster wrapper (`fleet.k8s.client.Kube`), over `ObjectStore`
(fleet/testing/k8s/store.py: resourceVersion, 409 on stale writes, label selectors, watch events with
bookmarks, graceful pod deletion, owner-reference cascade). A TEST FAKE, not a cluster.

`FakeKube.calls` counts calls by method (tests assert how chatty the backend is).
`forbid_raw_client` makes the official client's HTTP layer raise, so a test that reaches it
by mistake fails; the unit tier's guards (tests/support/guards.py) do the same for every unit test."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

from fleet.k8s.client import PODS, Resource, WatchEvent
from fleet.testing.k8s.store import ObjectStore


class FakeKube:
    """`fleet.k8s.client.Kube` on an in-memory `ObjectStore`."""

    def __init__(self, store: ObjectStore | None = None) -> None:
        self.store = store or ObjectStore()
        self.calls: Counter[str] = Counter()
        self.fail_next: dict[str, Exception] = {}   # method -> error raised once

    def _enter(self, method: str) -> None:
        self.calls[method] += 1
        err = self.fail_next.pop(method, None)
        if err is not None:
            raise err

    async def list(self, res: Resource, namespace: str | None = None,
                   label_selector: str | None = None) -> tuple[list[dict], str]:  # fmt: skip
        self._enter("list")
        return self.store.list(res, namespace, label_selector)

    async def watch(self, res: Resource, namespace: str | None, resource_version: str,
                    label_selector: str | None = None, timeout_s: float = 300.0) -> AsyncIterator[WatchEvent]:  # fmt: skip
        self._enter("watch")
        w = self.store.subscribe(res, namespace, resource_version, label_selector)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s   # not a wait: the API server's own watch timeout, as it ends a watch
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    yield WatchEvent("BOOKMARK", {"kind": res.kind, "apiVersion": res.api_version,
                                                  "metadata": {"resourceVersion": str(self.store.current_rv)}})
                    return
                try:
                    type_, obj = await asyncio.wait_for(w.queue.get(), timeout=left)
                except asyncio.TimeoutError:
                    continue
                yield WatchEvent(type_, obj)
        finally:
            self.store.unsubscribe(w)

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        self._enter("get")
        return self.store.get(res, namespace, name)

    async def create(self, res: Resource, namespace: str | None, body: dict) -> dict:
        self._enter("create")
        return self.store.create(res, namespace, body)

    async def replace(self, res: Resource, namespace: str | None, name: str, body: dict) -> dict:
        self._enter("replace")
        return self.store.replace(res, namespace, name, body)

    async def patch(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        self._enter("patch")
        return self.store.patch(res, namespace, name, patch)

    async def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        self._enter("patch_status")
        return self.store.patch_status(res, namespace, name, patch)

    async def delete(self, res: Resource, namespace: str | None, name: str,
                     grace_period_s: int | None = None) -> None:  # fmt: skip
        self._enter("delete")
        try:
            self.store.delete(res, namespace, name, grace_period_s)
        except Exception as err:  # noqa: BLE001 - absent is fine, as KubeClient.delete
            if getattr(err, "status", None) != 404:
                raise

    async def read_log(self, namespace: str, pod: str, tail_lines: int = 20) -> str:
        self._enter("read_log")
        self.store.get(PODS, namespace, pod)
        text = self.store.logs.get((namespace, pod), "")
        return "\n".join(text.splitlines()[-tail_lines:])


def forbid_raw_client(monkeypatch) -> None:
    """Make the official client's request layer fail: unit tests must only use the fake."""
    from kubernetes.client import ApiClient

    def refuse(*args, **kwargs):
        raise AssertionError("the raw kubernetes client was called in a unit test; use tests/support/fake_kube.py")

    monkeypatch.setattr(ApiClient, "call_api", refuse)
