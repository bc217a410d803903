"""Run the router under uvicorn (uvloop event loop, httptools HTTP parser).

Owns `serve`, the process entry point used by `python -m router` (router/__main__.py) and
by deployment scripts. uvloop + httptools and no access log are what the measured figures
in /work/shared/notes/router-performance.md assume; the loop and parser are not options.
"""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

import uvicorn

from router.app import create_app


class ListeningServer(uvicorn.Server):
    """uvicorn server that calls `on_listening(host, port)` once its socket is bound
    (port 0 resolves to the real port). Used by `serve` and by `router.testing`."""

    def __init__(self, config: uvicorn.Config, on_listening: Callable[[str, int], None]) -> None:
        super().__init__(config)
        self._on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self._on_listening(host, port)


CLIENT_KEEPALIVE_S = 75
"""Seconds an idle client connection stays open (uvicorn's default is 5 s). A client that
reuses a pooled connection just as the server closes it loses that request
(`ServerDisconnectedError` before any byte); client pools keep idle connections 15 s (aiohttp)
or longer, so the router outlasts them. 75 s is nginx's `keepalive_timeout` default. Measured:
bursty trace replay through the router lost 9-29 of 4,132 requests at uvicorn's 5 s."""


def _print_listening(host: str, port: int) -> None:
    print(f"fleet router listening on http://{host}:{port}", file=sys.stdout, flush=True)


def serve(host: str, port: int, admin_token: str, log_level: str = "warning") -> None:
    """Serve a fresh router app on `host:port` until SIGINT/SIGTERM.

    `port` 0 binds a free port (the printed line says which). `admin_token` guards
    `/admin/v1` (non-empty, else ValueError). `log_level` is uvicorn's (e.g. "info").
    """
    app = create_app(admin_token)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level=log_level,
        server_header=False,
        proxy_headers=False,  # the router does not use the client address; saves a middleware hop
        timeout_keep_alive=CLIENT_KEEPALIVE_S,
    )
    ListeningServer(config, _print_listening).run()
