"""The router as a Kubernetes pod: the OpenAI API on one port, the admin API on another.

Owns `serve_router_pod` (`fleet router-pod`, what the chart's router Deployment runs). The
router's app (`router.http.app.create_app`) serves ``/v1`` and ``/admin/v1`` on one port; in a
cluster the public Service must never carry the admin API, so this process serves the same app
twice, from one event loop and one pool table: on ``port`` with every ``/admin`` path answered
404 (`PublicOnly`), and on ``admin_port`` in full (the operator pushes pools there; the chart's
NetworkPolicy option admits only the operator and the other router pods to it: with
``--peers-dns`` the router pods post their load to each other's admin port,
`router.signals.peer_discovery`). Called by `fleet.cli.k8s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import uvicorn

from router.http.app import create_app
from router.http.server import CLIENT_KEEPALIVE_S

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


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to `serve_router_pod` (two servers share them)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def _config(app, host: str, port: int, lifespan: str, log_level: str) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, loop="none", http="httptools", lifespan=lifespan,
                          access_log=False, log_level=log_level, server_header=False, proxy_headers=False,
                          timeout_keep_alive=CLIENT_KEEPALIVE_S)  # fmt: skip


async def serve_router_pod(host: str, port: int, admin_port: int, admin_token: str,
                           log_level: str = "warning", stop: asyncio.Event | None = None,
                           peers_dns: tuple[str, int] | None = None, pod_ip: str = "",
                           router_id: str = "") -> None:  # fmt: skip
    """Serve the OpenAI API on ``host:port`` and the admin API on ``host:admin_port`` until
    ``stop`` is set (None: until SIGINT/SIGTERM). ``peers_dns``: (headless Service name, peers'
    admin port) of the other router pods, which this one shares its load with (``pod_ip``, its
    own address, left out; ``router_id``, its id in its reports: the pod name;
    `router.signals.peer_discovery`). Raises ValueError when the ports are equal or the token is empty."""
    if port == admin_port:
        raise ValueError(f"--admin-port must differ from --port ({port}): the admin API never shares the public port")
    app = create_app(admin_token, peers_dns=peers_dns, self_addresses=[pod_ip] if pod_ip else [],
                     router_id=router_id)  # fmt: skip
    admin = _QuietServer(_config(app, host, admin_port, "on", log_level))
    public = _QuietServer(_config(PublicOnly(app), host, port, "off", log_level))
    loop = asyncio.get_running_loop()
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

    async def stopper() -> None:
        await stop.wait()
        admin.should_exit = public.should_exit = True

    stopper_task = loop.create_task(stopper())
    admin_task = loop.create_task(admin.serve())
    while not admin.started and not admin_task.done():   # the proxy starts with the admin server's lifespan
        await asyncio.sleep(0.05)
    try:
        if admin_task.done():
            await admin_task
            return
        await app.listening(host, admin_port)   # the peers' UDP load reports, beside the admin API
        print(f"fleet router listening on http://{host}:{port} (admin API on port {admin_port})", flush=True)
        await public.serve()
        admin.should_exit = True
        await admin_task
    finally:
        stopper_task.cancel()
