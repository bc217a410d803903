"""The router as a Kubernetes pod: the OpenAI API on one port, the admin API on another.

Owns `serve_router_pod` (`fleet router-pod`, what the chart's router Deployment runs). The
router's app (`router.http.app.create_app`) serves ``/v1`` and ``/admin/v1`` on one port; in a
cluster the public Service must never carry the admin API, so this process serves the same app
twice, from one event loop and one pool table: on ``port`` with every ``/admin`` path answered
404 (`PublicOnly`), and on ``admin_port`` in full (the operator pushes pools there; the chart's
NetworkPolicy option admits only the operator to it). The endpoint picker is reached at a static
``--picker HOST:PORT`` or at the ready address of the picker Service's Endpoints
(``--picker-endpoints SERVICE:PORT``: `fleet.k8s.service_endpoints.ServiceLocator`, read with the
pod's service account, injected here into the router's `router.picker.client.PickerClient`; no
cluster DNS or kube-proxy needed). Called by `fleet.cli.k8s`.

Told to stop (SIGTERM from the kubelet, after the chart's ``preStop`` sleep has let the Service's
endpoints drop the pod), the public server stops accepting and its requests in flight finish, up
to ``drain_timeout_s``; only then does the admin server stop and the app (its upstream sessions)
shut down, so no stream in flight is cut by the shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from fleet.k8s.client import KubeClient
from fleet.k8s.service_endpoints import EndpointsAddresses, ServiceLocator, pod_namespace
from router.http.app import create_app
from router.http.server import CLIENT_KEEPALIVE_S, DRAIN_TIMEOUT_S, TickingServer

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]], Awaitable[None]]

ADMIN_PREFIX = "/admin"


class PublicOnly:
    """ASGI wrapper: every path under ``/admin`` is 404; lifespan is not forwarded (the admin
    server's copy of the app owns start-up and shutdown of the shared proxy)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] == "http" and (scope["path"] == ADMIN_PREFIX or scope["path"].startswith(ADMIN_PREFIX + "/")):
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json")]})  # fmt: skip
            await send({"type": "http.response.body", "body": b'{"detail":"Not Found"}'})
            return
        await self.app(scope, receive, send)


class _QuietServer(TickingServer):
    """A uvicorn server that leaves signals to `serve_router_pod` (two servers share them); its
    own loop turns once a second (`router.http.server.TickingServer`)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _config(app, host: str, port: int, lifespan: str, log_level: str, drain_timeout_s: float) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, loop="none", http="httptools", lifespan=lifespan,
                          access_log=False, log_level=log_level, server_header=False, proxy_headers=False,
                          timeout_keep_alive=CLIENT_KEEPALIVE_S, timeout_graceful_shutdown=drain_timeout_s)  # fmt: skip


async def serve_router_pod(host: str, port: int, admin_port: int, admin_token: str,
                           log_level: str = "warning", stop: asyncio.Event | None = None,
                           kube: KubeClient | None = None, drain_timeout_s: float = DRAIN_TIMEOUT_S,
                           picker: tuple[str, int] | None = None,
                           picker_endpoints: tuple[str, int] | None = None) -> None:  # fmt: skip
    """Serve the OpenAI API on ``host:port`` and the admin API on ``host:admin_port`` until
    ``stop`` is set (None: until SIGINT/SIGTERM), then drain: no new connection, the requests in
    flight finish for up to ``drain_timeout_s`` seconds (then they are cut). The endpoint picker
    every pool asks (`router.picker`) is at ``picker`` ((host, port), static) or at the ready
    address of ``picker_endpoints`` ((Service name in the pod's namespace, the picker's port):
    the Service's Endpoints, read with ``kube``, by default `KubeClient.load_for`, the pod's
    service account; the namespace from `fleet.k8s.service_endpoints.pod_namespace`); at most one
    of the two; neither: the router picks alone.

    Raises:
        ValueError: the ports are equal, ``drain_timeout_s`` is not > 0, both picker addresses are given,
            or (with ``picker_endpoints``) the pod's namespace or API credentials are missing.
    """
    if port == admin_port:
        raise ValueError(f"--admin-port must differ from --port ({port}): the admin API never shares the public port")
    if not drain_timeout_s > 0:
        raise ValueError(f"--drain-timeout-s must be > 0 seconds, not {drain_timeout_s:g}")
    if picker is not None and picker_endpoints is not None:
        raise ValueError("--picker and --picker-endpoints are two ways to find the same picker: give one")
    locate, own_kube = None, None
    if picker_endpoints is not None:
        namespace = pod_namespace()
        if kube is None:
            kube = own_kube = KubeClient.load_for("--picker-endpoints")
        locate = ServiceLocator(EndpointsAddresses(kube, namespace), *picker_endpoints)
    try:
        await _serve(host, port, admin_port, log_level, stop, drain_timeout_s,
                     create_app(admin_token, picker=picker, picker_locate=locate))
    finally:
        if own_kube is not None:
            own_kube.close()


async def _serve(host: str, port: int, admin_port: int, log_level: str,
                 stop: asyncio.Event | None, drain_timeout_s: float, app) -> None:  # fmt: skip
    """Serve ``app`` twice: in full on ``admin_port``, `PublicOnly` on ``port``. Stopping drains
    the public server first; the admin server (which owns the app's lifespan) stops after it."""
    admin = _QuietServer(_config(app, host, admin_port, "on", log_level, drain_timeout_s))
    public = _QuietServer(_config(PublicOnly(app), host, port, "off", log_level, drain_timeout_s))
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    async def stopper() -> None:
        await stop.wait()
        public.should_exit = True
        if not admin.started:   # stopped while starting: nothing public to drain
            admin.should_exit = True

    stopper_task = loop.create_task(stopper())
    admin_task = loop.create_task(admin.serve())
    while not admin.started and not admin_task.done():   # the proxy starts with the admin server's lifespan
        await asyncio.sleep(0.05)
    try:
        if admin_task.done():
            await admin_task
            return
        print(f"fleet router listening on http://{host}:{port} (admin API on port {admin_port})", flush=True)
        await public.serve()
        admin.should_exit = True
        await admin_task
    finally:
        stopper_task.cancel()
