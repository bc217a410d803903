"""What the process kubelet (fleet/testing/k8s/podrunner.py) asks of an API server, answered two
ways: by the cluster in a box's in-process object store, and by a REAL API server over HTTPS as
each node's own identity. A TEST STAND-IN's seam (the kubelet is Fleet's; the API server behind
`ServerKubeletApi` is Kubernetes' own: fleet/testing/k8s/kube.py).

Owns `KubeletApi` (the protocol: one node's calls), `StoreKubeletApi` (the box:
fleet/testing/k8s/store.py `ObjectStore`, every node the same view) and `ServerKubeletApi` (a real
API server: one client per node with the node's token ``system:node:NAME``, so Node authorization
and the NodeRestriction admission plugin decide what each node may read and write, as they do for
a real kubelet; pods watched per node with the field selector ``spec.nodeName=NAME``, as
pkg/kubelet/config/apiserver.go does).

Calls are blocking (the box answers in memory; the real server is on loopback, a few ms): the
kubelet's status updates are small and rare next to what its pods do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

from fleet.k8s.client import PODS, Gone, KubeClient, NotFound, Resource
from fleet.testing.k8s.store import ObjectStore

log = logging.getLogger("fleet.testing.kubelet")


class KubeletApi(Protocol):
    """One node's view of the API server, as a kubelet uses it. Raises `ApiError` on refusal."""

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        """An object (the pod, its Secrets, ConfigMaps, ServiceAccount, the node). NotFound
        when absent; 403 when the node may not read it."""
        ...

    def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        """A JSON merge patch of the status subresource (the pod's, the node's own)."""
        ...

    def finish_delete(self, res: Resource, namespace: str | None, name: str) -> None:
        """The kubelet's last word on a pod whose containers are gone: the object is removed
        (absent is fine)."""
        ...

    def save_logs(self, namespace: str, name: str, text: str) -> None:
        """Keep a deleted pod's container logs where ``kubectl logs`` would find them."""
        ...


class StoreKubeletApi:
    """`KubeletApi` on the box's `ObjectStore` (the same for every node: the box's API server
    stand-in enforces authorization on HTTP requests, not in-process ones)."""

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    def for_node(self, node: str) -> StoreKubeletApi:
        return self

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        return self.store.get(res, namespace, name)

    def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        return self.store.patch_status(res, namespace, name, patch)

    def finish_delete(self, res: Resource, namespace: str | None, name: str) -> None:
        self.store.finish_delete(res, namespace, name)

    def save_logs(self, namespace: str, name: str, text: str) -> None:
        self.store.logs[(namespace, name)] = text

    async def pod_events(self, nodes: Iterable[str]) -> AsyncIterator[tuple[str, dict]]:
        """Every pod event (ADDED, MODIFIED, DELETED) from the start; the kubelet keeps those of
        its ``nodes``."""
        w = self.store.subscribe(PODS, None, "0", None)
        try:
            while True:
                yield await w.queue.get()
        finally:
            self.store.unsubscribe(w)


class ServerKubeletApi:
    """`KubeletApi` on a real API server: ``clients`` maps each node name to a `KubeClient` with
    that node's token. `for_node` gives one node's view; `pod_events` merges each node's pod watch
    (list, then watch from the list's resourceVersion; a 410 Gone or an ended watch lists again,
    as a reflector does). Deleted pods' logs are kept here (``logs``): a hollow node serves no
    kubelet API for the API server to proxy ``pods/log`` to."""

    def __init__(self, clients: dict[str, KubeClient], node: str | None = None,
                 logs: dict[tuple[str, str], str] | None = None) -> None:  # fmt: skip
        self.clients = clients
        self.node = node
        self.logs = {} if logs is None else logs

    def for_node(self, node: str) -> ServerKubeletApi:
        return ServerKubeletApi(self.clients, node, self.logs)

    def _client(self) -> KubeClient:
        if self.node is None:
            raise RuntimeError("ServerKubeletApi: call for_node(NAME) first: every call is one node's")
        return self.clients[self.node]

    def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        return self._client().request("GET", res.path(namespace, name))

    def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        return self._client().request("PATCH", res.path(namespace, name, "status"), body=patch,
                                      content_type="application/merge-patch+json")  # fmt: skip

    def finish_delete(self, res: Resource, namespace: str | None, name: str) -> None:
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0}
        with contextlib.suppress(NotFound):
            self._client().request("DELETE", res.path(namespace, name), body=body)

    def save_logs(self, namespace: str, name: str, text: str) -> None:
        self.logs[(namespace, name)] = text

    async def pod_events(self, nodes: Iterable[str]) -> AsyncIterator[tuple[str, dict]]:
        queue: asyncio.Queue[tuple[str, dict]] = asyncio.Queue()
        tasks = [asyncio.create_task(self._watch_node(n, queue)) for n in nodes if n in self.clients]
        try:
            while True:
                yield await queue.get()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch_node(self, node: str, queue: asyncio.Queue) -> None:
        client, selector = self.clients[node], f"spec.nodeName={node}"
        known: dict[str, dict] = {}   # uid -> the pod as last seen
        while True:
            try:
                pods, version = await client.list(PODS, None, field_selector=selector)
                listed = {p["metadata"]["uid"]: p for p in pods}
                for uid in set(known) - set(listed):   # deleted while no watch ran
                    queue.put_nowait(("DELETED", known.pop(uid)))
                for uid, pod in listed.items():
                    queue.put_nowait(("MODIFIED" if uid in known else "ADDED", pod))
                known.update(listed)
                while True:
                    async for event in client.watch(PODS, None, version, field_selector=selector, timeout_s=60):
                        version = event.object.get("metadata", {}).get("resourceVersion", version)
                        if event.type == "BOOKMARK":
                            continue
                        uid = event.object["metadata"]["uid"]
                        if event.type == "DELETED":
                            known.pop(uid, None)
                        else:
                            known[uid] = event.object
                        queue.put_nowait((event.type, event.object))
            except Gone:
                continue
            except asyncio.CancelledError:
                raise
            except Exception as err:  # noqa: BLE001 - a reflector lists again after any failure
                log.warning("node %s: pod watch failed (%s); listing again in 1 s", node, err)
                await asyncio.sleep(1.0)
