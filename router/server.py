"""Run the router under uvicorn (uvloop event loop, httptools HTTP parser).

Owns `serve`, the process entry point used by `python -m router` (router/__main__.py) and
by deployment scripts, `uvicorn_config` (the server settings `serve` and `router.testing` share)
and `HeadGuardProtocol`, uvicorn's httptools protocol with a deadline and a size limit on each
request head. uvloop + httptools and no access log are what the measured figures in README.md
(the router sections) assume; the loop and parser are not options.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.app import create_app

CLIENT_KEEPALIVE_S = 75
"""Seconds an idle client connection stays open (uvicorn's default is 5 s). A client that
reuses a pooled connection just as the server closes it loses that request
(`ServerDisconnectedError` before any byte); client pools keep idle connections 15 s (aiohttp)
or longer, so the router outlasts them. 75 s is nginx's `keepalive_timeout` default. Measured:
bursty trace replay through the router lost 9-29 of 4,132 requests at uvicorn's 5 s."""


DEFAULT_HEAD_TIMEOUT_S = 10.0
"""Longest time (seconds) from a connection's opening, or from the first byte of a request on a
kept-alive one, until the request head (request line and headers) is complete; 408 and the
connection closed after it. uvicorn has no such bound: a client that opens a connection and
sends part of a head would hold it (and its memory) forever. A real client sends its head in one
write; 10 s leaves room for a slow link (nginx's `client_header_timeout` is 60 s)."""

DEFAULT_MAX_HEAD_BYTES = 64 * 1024
"""Most bytes of one request head (431 and the connection closed beyond): nginx's default
allows 4 x 8 KiB header buffers; this is twice that."""


class HeadGuardProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus a deadline and a size limit on each request head.

    The deadline (`head_timeout_s`) runs from `connection_made`, and on a kept-alive
    connection from the first byte of the next request, until the head is complete. The head's
    size is counted over the reads after which it is still incomplete. Beyond either limit the
    client gets 408 / 431 (`connection: close`) and the connection is closed. Subclassed per
    server by `uvicorn_config` with the limits as class attributes, as uvicorn builds protocols
    itself. Costs one timer per request.
    """

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes:
                self._refuse(431, b"Request Header Fields Too Large", b"request head too large",
                             b"request_header_fields_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self._refuse(408, b"Request Timeout", b"request head not received in time", b"request_timeout")

    def _refuse(self, status: int, reason: bytes, message: bytes, code: bytes) -> None:
        """Answer `status` in OpenAI's error format and close, unless a response is in progress
        (a pipelined request's head timed out): then just close after that response."""
        self._disarm_head_timer()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.keep_alive = False
            self.flow.pause_reading()
            return
        body = (b'{"error":{"message":"' + message + b'","type":"invalid_request_error","param":null,"code":"' +
                code + b'"}}')  # fmt: skip
        on_reject = getattr(self.app, "on_server_reject", None)
        if on_reject is not None:
            on_reject(status)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body)) + body
        )
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "warning", loop: str = "uvloop",
                   head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES,
                   **overrides: Any) -> uvicorn.Config:  # fmt: skip
    """The uvicorn settings of the router: httptools parser guarded by `HeadGuardProtocol`,
    `loop` (uvloop in production; "auto" lets tests run in their own loop), lifespan on, no
    access log, no server header, no proxy headers, `CLIENT_KEEPALIVE_S` keep-alive.
    `overrides`: further `uvicorn.Config` arguments."""
    protocol = type("RouterHttpProtocol", (HeadGuardProtocol,),
                    {"head_timeout_s": head_timeout_s, "max_head_bytes": max_head_bytes})  # fmt: skip
    settings: dict[str, Any] = {
        "host": host, "port": port, "loop": loop, "http": protocol, "lifespan": "on", "access_log": False,
        "log_level": log_level, "server_header": False,
        "proxy_headers": False,  # the router does not use the client address; saves a middleware hop
        "timeout_keep_alive": CLIENT_KEEPALIVE_S,
    }  # fmt: skip
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


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


def _print_listening(host: str, port: int) -> None:
    print(f"fleet router listening on http://{host}:{port}", file=sys.stdout, flush=True)


def serve(host: str, port: int, admin_token: str, log_level: str = "warning") -> None:
    """Serve a fresh router app on `host:port` until SIGINT/SIGTERM.

    `port` 0 binds a free port (the printed line says which). `admin_token` guards
    `/admin/v1` (non-empty, else ValueError). `log_level` is uvicorn's (e.g. "info").
    """
    app = create_app(admin_token)
    ListeningServer(uvicorn_config(app, host, port, log_level=log_level), _print_listening).run()
