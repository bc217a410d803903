"""Run the router under uvicorn (uvloop event loop, httptools HTTP parser).

Owns `serve`, the process entry point used by `python -m router` (router/__main__.py) and
by deployment scripts, `uvicorn_config` (the server settings `serve` and `tests.support.router` share)
and `RequestGuardProtocol`, uvicorn's httptools protocol with deadlines on receiving each request
(head, then body) and a size limit on its head. uvloop + httptools and no access log are what
the measured figures in docs/benchmarks.md (the router sections) assume; the loop and parser are not
options.
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
"""Longest time (seconds) from the first byte of a request until its head (request line and
headers) is complete; 408 and the connection closed after it. uvicorn has no such bound: a
client that sends part of a head would hold the connection (and its memory) forever. A real client sends its head in one
write; 10 s leaves room for a slow link (nginx's `client_header_timeout` is 60 s)."""

DEFAULT_BODY_TIMEOUT_S = 60.0
"""Longest time (seconds) from the end of a request's head until its whole body has arrived; a
client slower than that (or one that declares more bytes than it sends) gets 408 and its
connection is closed. 64 MiB (the proxy's `DEFAULT_MAX_BODY_BYTES`) in 60 s needs ~1.1 MB/s;
nginx's `client_body_timeout` is 60 s (between two reads; here for the whole body)."""

DEFAULT_MAX_HEAD_BYTES = 64 * 1024
"""Most bytes of one request head (431 and the connection closed beyond): nginx's default
allows 4 x 8 KiB header buffers; this is twice that."""


class RequestGuardProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus deadlines on receiving each request and a size limit on
    its head.

    One timer per request, armed at the request's first byte and cancelled when the whole
    request (head and body) has arrived, which for most requests is the same read. Before its
    first byte a connection is idle, new or kept alive, and uvicorn's keep-alive timeout
    (`CLIENT_KEEPALIVE_S`) closes it silently.
    The head must be complete within `head_timeout_s`, the body within `body_timeout_s` of the
    head's end; the head's size is counted over the reads after which it is still incomplete.
    Beyond a limit the client gets 408 / 431 in OpenAI's error format with `connection: close`
    (unless the application has begun answering) and the connection is closed; the
    application, if it was waiting for the body, sees a disconnect. Subclassed per server by
    `uvicorn_config` with the limits as class attributes, as uvicorn builds protocols itself.
    Counted through the app's `on_server_reject(status)` when it has one
    (`router.app.RouterApp`).
    """

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    _timer: asyncio.TimerHandle | None = None
    _head_done_s: float | None = None  # loop time the head completed; None while it is incomplete
    _head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # Until its first byte, a new connection is idle like a kept-alive one: uvicorn's
        # keep-alive timer closes it silently (uvicorn arms none here, so an idle connection
        # stayed open forever); the first byte cancels it and starts the request's deadline.
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)  # fmt: skip

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)  # cancels the keep-alive timer
        if self.transport.is_closing():
            return
        if self._timer is not None:
            if self._head_done_s is None:
                self._head_bytes += len(data)
                if self._head_bytes > self.max_head_bytes:
                    self._refuse(431, b"Request Header Fields Too Large", b"request head too large",
                                 b"request_header_fields_too_large")  # fmt: skip
        elif self.timeout_keep_alive_task is None and (self.cycle is None or self.cycle.response_complete):
            # Bytes that began no request (blank lines, which the parser skips): still idle.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)  # fmt: skip

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._head_done_s = self.loop.time()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser cannot read: 400 in OpenAI's format (uvicorn's is plain text)."""
        self._refuse(400, b"Bad Request", b"invalid HTTP request", b"invalid_http_request")

    def _arm(self) -> None:
        self._head_bytes = 0
        self._head_done_s = None
        self._timer = self.loop.call_later(self.head_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._head_done_s is None:
            self._refuse(408, b"Request Timeout", b"request head not received in time", b"request_timeout")
            return
        body_deadline_s = self._head_done_s + self.body_timeout_s
        if self.loop.time() < body_deadline_s:  # the head was in time: now the body's turn
            self._timer = self.loop.call_at(body_deadline_s, self._timed_out)
            return
        self._refuse(408, b"Request Timeout", b"request body not received in time", b"request_timeout")

    def _refuse(self, status: int, reason: bytes, message: bytes, code: bytes) -> None:
        """Answer `status` (unless a response has begun) and close the connection; a request
        task waiting for its body sees a disconnect."""
        self._disarm()
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            if not cycle.response_complete:
                cycle.keep_alive = False  # a response is under way: close when it is done
                self.flow.pause_reading()
            else:
                self.transport.close()
            return
        if cycle is not None:
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its sends are dropped
            cycle.message_event.set()
        on_reject = getattr(self.app, "on_server_reject", None)
        if on_reject is not None:
            on_reject(status)
        body = (b'{"error":{"message":"' + message + b'","type":"invalid_request_error","param":null,"code":"' +
                code + b'"}}')  # fmt: skip
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body)) + body
        )
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "warning", loop: str = "uvloop",
                   head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                   max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES, **overrides: Any) -> uvicorn.Config:  # fmt: skip
    """The uvicorn settings of the router: httptools parser guarded by `RequestGuardProtocol`,
    `loop` (uvloop in production; "auto" lets tests run in their own loop), lifespan on, no
    access log, no server header, no proxy headers, `CLIENT_KEEPALIVE_S` keep-alive.
    `overrides`: further `uvicorn.Config` arguments."""
    if not (head_timeout_s > 0 and body_timeout_s > 0 and max_head_bytes > 0):
        raise ValueError("head_timeout_s, body_timeout_s and max_head_bytes must be > 0")
    protocol = type("RouterHttpProtocol", (RequestGuardProtocol,), {
        "head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s, "max_head_bytes": max_head_bytes})
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
    (port 0 resolves to the real port). Used by `serve` and by `tests.support.router`."""

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
