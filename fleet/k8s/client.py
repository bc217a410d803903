"""The one thin wrapper every cluster call of Fleet goes through.

Owns `Resource` (a kind's API group, version and plural: the paths), the resources Fleet uses
(`PODS`, `NODES`, `EVENTS`, `LEASES`, `SECRETS`, `INFERENCE_DEPLOYMENTS`, `CRDS`),
`WatchEvent`, the errors (`ApiError`, `Conflict`, `NotFound`, `Gone`), the `Kube` protocol
(list, watch, get, create, replace, patch, patch_status, delete, read_log: objects are plain
dicts as the API serves them) and `KubeClient`, its implementation on the official `kubernetes`
Python client.

Why the synchronous official client and not `kubernetes_asyncio`: it is the Kubernetes
project's own client (kubernetes-client/python), released with every Kubernetes version, and
it brings the kubeconfig / in-cluster service-account handling and TLS; `kubernetes_asyncio` is a
community port that trails it. Fleet uses the client's `ApiClient` (configuration, auth,
connection pool) with generic paths rather than its generated model classes: objects stay JSON
dicts (no model deserialization of 10,000 pods), and one code path serves every kind, custom
resources included. Each blocking call runs in a worker thread (`asyncio.to_thread`); a watch
streams in a thread and hands its events to the event loop.

Callers: the Kubernetes backend (`fleet.k8s.backend`), the operator (`fleet.k8s.operator`),
leader election (`fleet.k8s.lease`). Unit tests use the in-repo fake (tests/support/fake_kube.py), which
keeps resourceVersion, answers 409 on stale writes, filters by label selector and delivers watch
events; the integration test runs `KubeClient` against an HTTP stand-in of the API server
(fleet/testing/k8s/apiserver.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

from fleet.k8s.crd import GROUP, PLURAL, VERSION
from fleet.spec import KIND


@dataclass(frozen=True)
class Resource:
    """One kind of object: ``/api/v1/...`` for the core group, ``/apis/GROUP/VERSION/...`` else."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        """``/api/v1/namespaces/NS/pods/NAME/status``; namespace None lists across namespaces."""
        base = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        if self.namespaced and namespace is not None:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name is not None:
            base += f"/{quote(name)}"
        if sub is not None:
            base += f"/{sub}"
        return base


PODS = Resource("", "v1", "pods", "Pod")
NODES = Resource("", "v1", "nodes", "Node", namespaced=False)
EVENTS = Resource("", "v1", "events", "Event")
LEASES = Resource("coordination.k8s.io", "v1", "leases", "Lease")
SECRETS = Resource("", "v1", "secrets", "Secret")   # the router admin token (fleet/k8s/admin_token.py)
SERVICE_ACCOUNTS = Resource("", "v1", "serviceaccounts", "ServiceAccount")
CONFIGMAPS = Resource("", "v1", "configmaps", "ConfigMap")   # the autoscaler's arrival history (fleet/k8s/arrival_history.py)
INFERENCE_DEPLOYMENTS = Resource(GROUP, VERSION, PLURAL, KIND)
CRDS = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition",
                namespaced=False)  # fmt: skip


class ApiError(Exception):
    """The API server refused a call. ``status``: HTTP status; ``reason``: the Status reason
    (``Conflict``, ``AlreadyExists``, ``NotFound``, ``Expired``, ...)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Conflict(ApiError):
    """409: a write with a stale resourceVersion, or a create of a name that exists."""


class NotFound(ApiError):
    """404."""


class Gone(ApiError):
    """410: the resourceVersion a watch asked for is too old; list again."""


def api_error(status: int, body: Any) -> ApiError:
    """The error for an HTTP ``status`` and its Status ``body`` (dict, bytes or text)."""
    if isinstance(body, (bytes, str)):
        try:
            body = json.loads(body)
        except ValueError:
            body = {"message": body.decode(errors="replace") if isinstance(body, bytes) else body}
    body = body if isinstance(body, dict) else {}
    cls = {409: Conflict, 404: NotFound, 410: Gone}.get(status, ApiError)
    return cls(status, body.get("reason", ""), body.get("message", ""))


@dataclass(frozen=True)
class WatchEvent:
    """One watch event: ``type`` ADDED, MODIFIED, DELETED or BOOKMARK (``object`` carries only
    metadata.resourceVersion then)."""

    type: str
    object: dict


class Kube(Protocol):
    """What Fleet asks of an API server. Raises `ApiError` (or a subclass) on refusal."""

    async def list(self, res: Resource, namespace: str | None = None,
                   label_selector: str | None = None) -> tuple[list[dict], str]:  # fmt: skip
        """Objects and the list's resourceVersion (where a watch starts)."""
        ...

    def watch(self, res: Resource, namespace: str | None, resource_version: str,
              label_selector: str | None = None, timeout_s: float = 300.0) -> AsyncIterator[WatchEvent]:  # fmt: skip
        """Events after ``resource_version``, with bookmarks, until the server ends the watch
        (about ``timeout_s``). Raises `Gone` when the version is too old."""
        ...

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict: ...

    async def create(self, res: Resource, namespace: str | None, body: dict) -> dict:
        """Raises `Conflict` (reason AlreadyExists) when the name is taken."""
        ...

    async def replace(self, res: Resource, namespace: str | None, name: str, body: dict) -> dict:
        """PUT; ``body.metadata.resourceVersion`` makes it conditional (`Conflict` when stale)."""
        ...

    async def patch(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        """JSON merge patch (RFC 7386) of the object."""
        ...

    async def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        """JSON merge patch of the status subresource."""
        ...

    async def delete(self, res: Resource, namespace: str | None, name: str,
                     grace_period_s: int | None = None) -> None:  # fmt: skip
        """Delete (absent is fine: no error)."""
        ...

    async def read_log(self, namespace: str, pod: str, tail_lines: int = 20) -> str: ...


def _query(**params: Any) -> list[tuple[str, str]]:
    out = []
    for key, value in params.items():
        if value is None:
            continue
        out.append((key, str(value).lower() if isinstance(value, bool) else str(value)))
    return out


class KubeClient:
    """`Kube` on the official client (`kubernetes.client.ApiClient`): in-cluster service
    account or kubeconfig (`load`), or an ``ApiClient`` the caller configured (tests)."""

    def __init__(self, api_client) -> None:
        self.api = api_client

    @classmethod
    def load(cls) -> KubeClient:
        """The pod's service account when running in a cluster, else the current kubeconfig
        context. Raises kubernetes.config.ConfigException when neither is there."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    @classmethod
    def load_for(cls, flag: str) -> KubeClient:
        """`load`, for a command whose ``flag`` needs the API. Raises ValueError naming ``flag``
        when there are no credentials."""
        from kubernetes.config import ConfigException

        try:
            return cls.load()
        except ConfigException as err:
            raise ValueError(f"{flag}: no Kubernetes API credentials (the pod's service account token, else a "
                             f"kubeconfig): {err}") from None

    @staticmethod
    def for_host(host: str, token: str | None = None) -> KubeClient:
        """A client of the API server at ``host`` (http(s)://...), with a bearer token if given."""
        from kubernetes import client

        cfg = client.Configuration()
        cfg.host = host
        if token:
            cfg.api_key = {"authorization": token}
            cfg.api_key_prefix = {"authorization": "Bearer"}
        return KubeClient(client.ApiClient(cfg))

    def close(self) -> None:
        self.api.close()

    # ----- requests ---------------------------------------------------------------------------

    def _send(self, method: str, path: str, query: list[tuple[str, str]] | None = None, body: Any = None,
              content_type: str = "application/json", timeout_s: float | None = 30.0):  # fmt: skip
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        _method, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"])
        return self.api.call_api(_method, url, header_params=headers, body=body, _request_timeout=timeout_s)

    def request(self, method: str, path: str, **kw: Any) -> Any:
        """One request, BLOCKING the calling thread (what every async method runs in a worker
        thread): ``path`` from `Resource.path`, ``query`` a list of pairs, ``body`` JSON-able,
        ``content_type`` (default ``application/json``). Returns the decoded body (None when
        empty). Raises `ApiError` (or a subclass) on a non-2xx answer."""
        resp = self._send(method, path, **kw)
        data = resp.read()
        if not 200 <= resp.status < 300:
            raise api_error(resp.status, data)
        return json.loads(data) if data else None

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        return await asyncio.to_thread(self.request, method, path, **kw)

    # ----- Kube -------------------------------------------------------------------------------

    async def list(self, res: Resource, namespace: str | None = None, label_selector: str | None = None,
                   field_selector: str | None = None) -> tuple[list[dict], str]:  # fmt: skip
        """`Kube.list`; ``field_selector`` as the API takes it (``spec.nodeName=NODE``)."""
        data = await self._call("GET", res.path(namespace), query=_query(labelSelector=label_selector,
                                                                         fieldSelector=field_selector))
        kind = res.kind
        items = [{"apiVersion": res.api_version, "kind": kind, **o} for o in data.get("items", [])]
        return items, data.get("metadata", {}).get("resourceVersion", "")

    async def watch(self, res: Resource, namespace: str | None, resource_version: str,
                    label_selector: str | None = None, timeout_s: float = 300.0,
                    field_selector: str | None = None) -> AsyncIterator[WatchEvent]:  # fmt: skip
        """`Kube.watch`; ``field_selector`` as in `list`."""
        from kubernetes.watch.watch import iter_resp_lines

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()
        query = _query(watch=True, allowWatchBookmarks=True, resourceVersion=resource_version,
                       labelSelector=label_selector, fieldSelector=field_selector,
                       timeoutSeconds=int(timeout_s))  # fmt: skip

        def hand(item: object) -> None:
            with contextlib.suppress(RuntimeError):   # the consumer's loop closed before the watch ended
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def pump() -> None:
            try:
                resp = self._send("GET", res.path(namespace), query=query, timeout_s=(10.0, timeout_s + 30.0))
                if not 200 <= resp.status < 300:
                    raise api_error(resp.status, resp.read())
                try:
                    for line in iter_resp_lines(resp.response):
                        if stop.is_set():
                            break
                        if line:
                            hand(json.loads(line))
                finally:
                    resp.response.release_conn()
                hand(None)
            except BaseException as err:  # noqa: BLE001 - handed to the consumer
                hand(err)

        thread = threading.Thread(target=pump, name=f"watch-{res.plural}", daemon=True)
        thread.start()
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                if item.get("type") == "ERROR":
                    status = item.get("object") or {}
                    raise api_error(int(status.get("code") or 500), status)
                yield WatchEvent(item["type"], item["object"])
        finally:
            stop.set()

    async def get(self, res: Resource, namespace: str | None, name: str) -> dict:
        return await self._call("GET", res.path(namespace, name))

    async def create(self, res: Resource, namespace: str | None, body: dict) -> dict:
        return await self._call("POST", res.path(namespace), body=body)

    async def replace(self, res: Resource, namespace: str | None, name: str, body: dict) -> dict:
        return await self._call("PUT", res.path(namespace, name), body=body)

    async def patch(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        return await self._call("PATCH", res.path(namespace, name), body=patch,
                                content_type="application/merge-patch+json")  # fmt: skip

    async def patch_status(self, res: Resource, namespace: str | None, name: str, patch: dict) -> dict:
        return await self._call("PATCH", res.path(namespace, name, "status"), body=patch,
                                content_type="application/merge-patch+json")  # fmt: skip

    async def delete(self, res: Resource, namespace: str | None, name: str,
                     grace_period_s: int | None = None) -> None:  # fmt: skip
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": "Background"}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        try:
            await self._call("DELETE", res.path(namespace, name), body=body)
        except NotFound:
            pass

    async def read_log(self, namespace: str, pod: str, tail_lines: int = 20) -> str:
        def read() -> str:
            resp = self._send("GET", PODS.path(namespace, pod, "log"), query=_query(tailLines=tail_lines))
            data = resp.read()
            if not 200 <= resp.status < 300:
                raise api_error(resp.status, data)
            return data.decode(errors="replace")

        return await asyncio.to_thread(read)
