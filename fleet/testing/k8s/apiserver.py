"""A STAND-IN for the Kubernetes API server and a simple kubelet, for the operator's integration
tests (tests/integration/test_operator_standin.py, the cluster in a box: fleet/testing/k8s/box.py)
and its benchmark (loadtests/bench_operator.py). It is not Kubernetes: no kube-apiserver can be
installed on these machines (docs/kubernetes.md).

`APIServerStandIn` serves `ObjectStore` (fleet/testing/k8s/store.py) over HTTP (or HTTPS) with the paths and
semantics the operator uses through the official client: list and watch (``?watch=true``:
JSON lines, bookmarks, an ERROR event with code 410 for a too-old resourceVersion), get,
create, PUT (409 on a stale resourceVersion), JSON merge patch, the status subresource, delete
with grace periods and finalizers, pod logs; errors as ``Status`` objects. Labels are checked as
the real server checks them (fleet/testing/k8s/validation.py): a key or value it refuses is 422
``Invalid`` naming ``metadata.labels``, in its words; nothing else of an object is validated.

`KubeletStandIn` pulls the images of each pod bound to its nodes first (`fleet.testing.k8s.kubelet.ImagePuller`:
the image lands in ``Node.status.images``; an unpullable one leaves the pod in ErrImagePull;
a pre-pull pod then completes), then runs each pod bound to its nodes (``spec.nodeName``) as a local process (an
unbound pod is first bound by the scheduler stand-in's pass, `fleet.testing.k8s.workloads.schedule`): the
pod's engine command (the engine SIMULATOR, ``engine.kind: sim``) with the image's ``python``
replaced by this interpreter and ``--host`` by the pod's IP, a loopback address of its own
(127.0.0.N, port 8000 as in a real pod; a ZMQ wildcard bind ``tcp://*:P`` is relayed from it,
`fleet.testing.k8s.portmap`). It reports Running, the exit code when the process ends,
sends SIGTERM on a graceful delete (SIGKILL with grace 0) and removes the pod when its process
has gone, as a kubelet does.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from fleet.k8s.client import PODS, ApiError, Gone, Resource
from fleet.k8s.prepull import is_pull_pod
from fleet.testing.k8s.kubelet import ImagePuller, run_pod, terminate_pod
from fleet.testing.k8s.portmap import WildcardPorts
from fleet.testing.k8s.rbac import Authorizer, RequestAttributes
from fleet.testing.k8s.workloads import schedule
from fleet.testing.k8s.store import _RESOURCES, ObjectStore
from fleet.testing.k8s.validation import check_labels

_BY_PATH = {(r.group, r.version, r.plural): r for r in _RESOURCES}


def _status_body(err: ApiError) -> dict:
    body = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": err.message,
            "reason": err.reason, "code": err.status}  # fmt: skip
    details = getattr(err, "details", None)   # fleet.testing.k8s.validation.Invalid's field causes
    return {**body, "details": details} if details else body


def _check_labels(res: Resource, name: str | None, body: object, patch: bool = False) -> None:
    """Refuse ``body``'s labels as the real server would (422 Invalid); a merge patch's null
    values delete labels and are not checked. ``name``: None on create (the body's). Raises ApiError."""
    meta = body.get("metadata") if isinstance(body, dict) else None
    meta = meta if isinstance(meta, dict) else {}
    labels = meta.get("labels")
    name = str(meta.get("name") or "") if name is None else name
    if patch and isinstance(labels, dict):
        labels = {k: v for k, v in labels.items() if v is not None}
    check_labels(res.kind, res.group, name, labels)


class APIServerStandIn:
    """HTTP on ``127.0.0.1:<port>``; ``store`` is the cluster state (tests read it directly).

    With ``authorizer`` (`fleet.testing.k8s.rbac.Authorizer`) every request needs a bearer token
    it knows (else 401) and RBAC's permission (else 403 Forbidden, recorded in
    ``authorizer.denied``); without one, anything goes (the older tests' mode)."""

    def __init__(self, store: ObjectStore | None = None, bookmark_every_s: float = 1.0,
                 authorizer: Authorizer | None = None, host: str = "127.0.0.1") -> None:  # fmt: skip
        self.store = store or ObjectStore()
        self.authorizer = authorizer
        self.host = host
        self.bookmark_every_s = bookmark_every_s
        self.requests = 0
        self.port = 0
        self._runner: web.AppRunner | None = None
        app = web.Application()
        for prefix in ("/api/{version}", "/apis/{group}/{version}"):
            app.router.add_route("*", prefix + "/namespaces/{ns}/{plural}", self._collection)
            app.router.add_route("*", prefix + "/namespaces/{ns}/{plural}/{name}", self._object)
            app.router.add_route("*", prefix + "/namespaces/{ns}/{plural}/{name}/{sub}", self._object)
            app.router.add_route("*", prefix + "/{plural}", self._collection)
            app.router.add_route("*", prefix + "/{plural}/{name}", self._object)
            app.router.add_route("*", prefix + "/{plural}/{name}/{sub}", self._object)
        self.app = app

    @property
    def url(self) -> str:
        return f"{getattr(self, 'scheme', 'http')}://{self.host}:{self.port}"

    async def start(self, ssl_context=None) -> None:
        """Listen on a free port; with ``ssl_context`` (an `ssl.SSLContext`) over HTTPS."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0, ssl_context=ssl_context)
        self.scheme = "https" if ssl_context is not None else "http"
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig file pointing at this stand-in (what `fleet operator` reads)."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": self.url}}],
            "users": [{"name": "u", "user": {"token": "standin"}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "u", "namespace": "fleet"}}],
        }))  # fmt: skip
        return path

    # ----- routing ----------------------------------------------------------------------------

    def _resource(self, request: web.Request) -> tuple[Resource, str | None]:
        m = request.match_info
        res = _BY_PATH.get((m.get("group", ""), m["version"], m["plural"]))
        if res is None:
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({request.path})")
        if self.authorizer is not None:
            user = self.authorizer.user(request.headers.get("Authorization"))
            if user is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            attrs = RequestAttributes.from_http(request.method, res.group, res.plural, m.get("sub"), m.get("ns"),
                                                m.get("name"), request.query.get("watch") in ("true", "1"))
            if not self.authorizer.allowed(user, attrs):
                raise ApiError(403, "Forbidden", attrs.describe(user))
        return res, m.get("ns")

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        try:
            res, ns = self._resource(request)
            q = request.query
            if request.method == "GET" and q.get("watch") in ("true", "1"):
                return await self._watch(request, res, ns)
            if request.method == "GET":
                items, rv = self.store.list(res, ns, q.get("labelSelector"))
                return web.json_response({"kind": f"{res.kind}List", "apiVersion": res.api_version,
                                          "metadata": {"resourceVersion": rv}, "items": items})  # fmt: skip
            if request.method == "POST":
                body = await request.json()
                _check_labels(res, None, body)
                return web.json_response(self.store.create(res, ns, body), status=201)
            raise ApiError(405, "MethodNotAllowed", request.method)
        except ApiError as err:
            return web.json_response(_status_body(err), status=err.status)

    async def _object(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        try:
            res, ns = self._resource(request)
            name, sub = request.match_info["name"], request.match_info.get("sub")
            if sub == "log" and res is PODS:
                self.store.get(res, ns, name)
                lines = self.store.logs.get((ns, name), "").splitlines()
                tail = int(request.query.get("tailLines", len(lines) or 1))
                return web.Response(text="\n".join(lines[-tail:]))
            if request.method == "GET":
                return web.json_response(self.store.get(res, ns, name))
            if request.method == "PUT":
                body = await request.json()
                _check_labels(res, name, body)
                return web.json_response(self.store.replace(res, ns, name, body))
            if request.method == "PATCH":
                if "merge-patch" not in request.content_type:
                    raise ApiError(415, "UnsupportedMediaType", f"{request.content_type}: use merge-patch+json")
                body = await request.json()
                if sub == "status":
                    return web.json_response(self.store.patch_status(res, ns, name, body))
                _check_labels(res, name, body, patch=True)
                return web.json_response(self.store.patch(res, ns, name, body))
            if request.method == "DELETE":
                body = await request.json() if request.can_read_body else {}
                grace = (body or {}).get("gracePeriodSeconds")
                self.store.delete(res, ns, name, grace)
                return web.json_response({"kind": "Status", "apiVersion": "v1", "status": "Success"})
            raise ApiError(405, "MethodNotAllowed", request.method)
        except ApiError as err:
            return web.json_response(_status_body(err), status=err.status)

    async def _watch(self, request: web.Request, res: Resource, ns: str | None) -> web.StreamResponse:
        q = request.query
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        try:
            w = self.store.subscribe(res, ns, q.get("resourceVersion", ""), q.get("labelSelector"))
        except Gone as err:
            await resp.write(json.dumps({"type": "ERROR", "object": _status_body(err)}).encode() + b"\n")
            return resp
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(q.get("timeoutSeconds", 300))
        bookmarks = q.get("allowWatchBookmarks") in ("true", "1")
        try:
            while loop.time() < deadline:
                try:
                    type_, obj = await asyncio.wait_for(w.queue.get(), timeout=min(self.bookmark_every_s,
                                                                                  max(0.01, deadline - loop.time())))
                except asyncio.TimeoutError:
                    if bookmarks:
                        mark = {"kind": res.kind, "apiVersion": res.api_version,
                                "metadata": {"resourceVersion": str(self.store.current_rv)}}
                        await resp.write(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
                    continue
                await resp.write(json.dumps({"type": type_, "object": obj}).encode() + b"\n")
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            self.store.unsubscribe(w)
        return resp


class KubeletStandIn:
    """Runs the pods of ``nodes`` as local processes (see the module docstring)."""

    def __init__(self, store: ObjectStore, nodes: set[str], log_dir: Path, env: dict[str, str] | None = None,
                 puller: ImagePuller | None = None) -> None:  # fmt: skip
        self.store = store
        self.puller = puller or ImagePuller()
        self.nodes = nodes
        self.log_dir = log_dir
        self.env = env or {}
        self.procs: dict[tuple[str, str], asyncio.subprocess.Process] = {}
        self.ips: dict[tuple[str, str], str] = {}
        self.ports: dict[tuple[str, str], WildcardPorts] = {}   # the pod's wildcard binds, relayed
        self.started = 0
        self.seen_pods: set[str] = set()   # every pod bound to these nodes, by name
        self._next_ip = 10
        self._task: asyncio.Task | None = None
        self._waiters: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
        for proc in self.procs.values():
            if proc.returncode is None:
                proc.kill()
        for proc in self.procs.values():
            await proc.wait()
        for ports in self.ports.values():
            await ports.close()
        for t in self._waiters:
            t.cancel()

    async def _run(self) -> None:
        w = self.store.subscribe(PODS, None, "0", None)
        try:
            while True:
                type_, pod = await w.queue.get()
                if type_ != "DELETED":
                    await self._sync(pod)
        finally:
            self.store.unsubscribe(w)

    async def _sync(self, pod: dict) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        if not (pod.get("spec") or {}).get("nodeName") and not meta.get("deletionTimestamp"):
            schedule(self.store)   # no scheduler runs beside this kubelet: the stand-in's pass binds it
            return
        if (pod.get("spec") or {}).get("nodeName") not in self.nodes:
            return
        self.seen_pods.add(meta["name"])
        proc = self.procs.get(key)
        if meta.get("deletionTimestamp"):
            if proc is None:
                self.store.finish_delete(PODS, *key)
            elif proc.returncode is None:
                grace = meta.get("deletionGracePeriodSeconds", 30)
                proc.send_signal(signal.SIGKILL if grace == 0 else signal.SIGTERM)
            return
        if proc is None and (pod.get("status") or {}).get("phase") in (None, "Pending"):
            try:
                pulled = self.puller.sync(self.store, *key)
            except ApiError:
                return   # deleted meanwhile
            if pulled == "pulled" and not is_pull_pod(pod):
                await self._start(key, pod)

    async def _start(self, key: tuple[str, str], pod: dict) -> None:
        container = pod["spec"]["containers"][0]
        argv = list(container["command"])
        if argv[0] == "python":
            argv[0] = sys.executable
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        if "--host" in argv:
            argv[argv.index("--host") + 1] = ip
        ports = self.ports[key] = WildcardPorts(ip)
        argv = ports.rewrite(argv)
        await ports.serve()
        env = {**os.environ, **self.env, **{e["name"]: e["value"] for e in container.get("env", []) if "value" in e}}
        log_path = self.log_dir / f"{key[0]}_{key[1]}.log"
        log = open(log_path, "wb")
        proc = await asyncio.create_subprocess_exec(*argv, stdout=log, stderr=asyncio.subprocess.STDOUT, env=env,
                                                    start_new_session=True)  # fmt: skip
        log.close()
        self.procs[key] = proc
        self.ips[key] = ip
        self.started += 1
        run_pod(self.store, key[0], key[1], ip)
        waiter = asyncio.get_running_loop().create_task(self._reap(key, proc, log_path))
        self._waiters.add(waiter)

    async def _reap(self, key: tuple[str, str], proc: asyncio.subprocess.Process, log_path: Path) -> None:
        code = await proc.wait()
        await self.ports.pop(key).close()
        self.store.logs[key] = log_path.read_text(errors="replace")
        try:
            pod = self.store.get(PODS, *key)
        except ApiError:
            return
        if pod["metadata"].get("deletionTimestamp"):
            self.store.finish_delete(PODS, *key)
        else:
            terminate_pod(self.store, key[0], key[1], code if code >= 0 else 128 - code)
