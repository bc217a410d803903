"""Run the router under uvicorn (uvloop event loop, httptools HTTP parser).

Owns `serve`, the process entry point used by `python -m router` (router/__main__.py) and
by deployment scripts, `uvicorn_config` (the server settings `serve` and `tests.support.router` share)
and `RequestGuardProtocol`, uvicorn's httptools protocol with deadlines on receiving each request
(head, then body), limits on its head (its size, the request target, each header field and
their number) however the head is split into reads, and no protocol switching, and
`TickingServer` (uvicorn's server whose own loop turns once a second, woken to shut down;
`ListeningServer` and the router pod's servers, `fleet/k8s/routerpod.py`). uvloop +
httptools and no access log are what the measured figures in docs/benchmarks.md (the router
sections) assume; the loop and parser are not options.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.http.app import create_app
from router.protocol.errors import error_body, error_type

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

MAX_REQUEST_TARGET_BYTES = 8190
"""Most bytes of the request target (path and query; 414 beyond): Apache's `LimitRequestLine`
default. The router's own paths are short; a longer target is an attack or a mistake."""

MAX_HEADER_FIELD_BYTES = 8190
"""Most bytes of one header field, `name: value` (431 beyond): Apache's `LimitRequestFieldSize`
default, and aiohttp's `max_field_size`, so no header the router accepts is one an aiohttp
server (the engine simulator) refuses."""

MAX_HEADER_FIELDS = 100
"""Most header fields in one request (431 beyond): Apache's `LimitRequestFields` default."""


DRAIN_TIMEOUT_S = 30.0
"""Longest time (seconds) a router told to stop (SIGTERM) waits for its requests in flight to
finish after it stopped accepting; then they are cut. `fleet router-pod --drain-timeout-s` sets
its own; the chart passes its router pods' `terminationGracePeriodSeconds` less the `preStop`
sleep less 5 s, so the kubelet's SIGKILL never comes first."""


class _Refusal(Exception):
    """Raised inside an HTTP parser callback to stop parsing; the protocol answers `args`
    (status, reason phrase, message, code) and closes the connection."""


class RequestGuardProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus deadlines on receiving each request, limits on its head,
    and no protocol switching.

    Deadlines: one timer per request, armed at the request's first byte and cancelled when the
    whole request (head and body) has arrived, which for most requests is the same read. Before
    its first byte a connection is idle, new or kept alive, and uvicorn's keep-alive timeout
    (`CLIENT_KEEPALIVE_S`) closes it silently. The head must be complete within
    `head_timeout_s`, the body within `body_timeout_s` of the head's end.

    Head limits, enforced however the head is split into reads (one read, two, or many): the
    bytes of the head as received (`max_head_bytes`, 431: counted over the reads in which the head
    is incomplete, and a read that would carry it past the limit is handed to the parser only up
    to the limit, so a head is never parsed beyond it; when a pipelined request ends inside such
    a read, the next head's bytes in it are not counted, an undercount of at most one limit), and
    as parsed: the request target (`max_target_bytes`, 414), each header field
    (`max_field_bytes`, 431), the number of fields (`max_header_fields`, 431) and their sum
    (`max_head_bytes`, 431), checked exactly in the parser's callbacks as each field completes.

    Upgrade: the router never switches protocols (uvicorn's WebSocket support is off,
    `uvicorn_config`). A request carrying `Connection: upgrade` and `Upgrade` (h2c, websocket) is
    served as plain HTTP/1.1 and its connection closed after the answer (the parser treats
    what follows the head as the other protocol, so nothing more can be read); one with a body
    gets 400 (the parser does not deliver it).

    Beyond a limit the client gets the status in OpenAI's error format with `connection: close`
    (unless the application has begun answering) and the connection is closed; the
    application, if it was waiting for the body, sees a disconnect. Subclassed per server by
    `uvicorn_config` with the limits as class attributes, as uvicorn builds protocols itself.
    Counted through the app's `on_server_reject(status)` when it has one
    (`router.http.app.RouterApp`).
    """

    head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    max_target_bytes: int = MAX_REQUEST_TARGET_BYTES
    max_field_bytes: int = MAX_HEADER_FIELD_BYTES
    max_header_fields: int = MAX_HEADER_FIELDS
    _timer: asyncio.TimerHandle | None = None
    _head_done_s: float | None = None  # loop time the head completed; None while it is incomplete
    _in_head = True         # idle, or a head is incomplete: bytes received count against the head limit
    _head_bytes = 0         # bytes received since the head (or the idle time before it) began
    _message_ended = False  # a request ended during the current read
    _parsed_bytes = 0       # the head as parsed: request target plus header fields
    _fields = 0
    _upgraded = False       # the client asked to switch protocols: nothing more is read

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
        self._unset_keepalive_if_required()
        if self._upgraded:
            return  # the bytes of a protocol the router does not speak: dropped until the close
        try:
            while self._in_head and len(data) > self.max_head_bytes - self._head_bytes:
                room = self.max_head_bytes - self._head_bytes
                self._feed(data[:room])
                if self.transport.is_closing() or self._upgraded:
                    return
                if self._in_head and not self._message_ended:  # the head goes on past the limit
                    self._refuse(431, b"Request Header Fields Too Large",
                                 b"request head exceeds %d bytes" % self.max_head_bytes,
                                 b"request_header_fields_too_large")  # fmt: skip
                    return
                data = data[room:]  # a body, or (a request ended) the next request's head: sliced again
            self._feed(data)
        except _Refusal as refusal:
            self._refuse(*refusal.args)
            return
        except httptools.HttpParserUpgrade:
            self._upgraded = True  # served as HTTP/1.1; on_headers_complete set the close
            return
        except httptools.HttpParserError as err:
            refusal = err.__context__
            if isinstance(refusal, _Refusal):
                self._refuse(*refusal.args)
            else:
                self.send_400_response(str(err))
            return
        if self.transport.is_closing():
            return
        if self._timer is None and self.timeout_keep_alive_task is None and (
                self.cycle is None or self.cycle.response_complete):  # fmt: skip
            # Bytes that began no request (blank lines, which the parser skips): still idle.
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)  # fmt: skip

    def _feed(self, data: bytes) -> None:
        """Hand `data` to the parser; count it against the head while the head is incomplete."""
        self._message_ended = False
        self.parser.feed_data(data)
        if self._in_head and not self._message_ended:
            # (A request that ended in this read and a next one begun: its bytes are not counted
            # here, the parsed sizes still are.)
            self._head_bytes += len(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._parsed_bytes = 0
        self._fields = 0
        if self._timer is None:
            self._arm()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        if len(self.url) > self.max_target_bytes:
            raise _Refusal(414, b"URI Too Long", b"request target exceeds %d bytes" % self.max_target_bytes,
                           b"uri_too_long")  # fmt: skip

    def on_header(self, name: bytes, value: bytes) -> None:
        size = len(name) + 2 + len(value)
        self._fields += 1
        self._parsed_bytes += size + 2
        if size > self.max_field_bytes:
            raise _Refusal(431, b"Request Header Fields Too Large", b"header field %s exceeds %d bytes" % (
                name[:64].lower(), self.max_field_bytes), b"request_header_fields_too_large")  # fmt: skip
        if self._fields > self.max_header_fields:
            raise _Refusal(431, b"Request Header Fields Too Large", b"more than %d header fields" %
                           self.max_header_fields, b"request_header_fields_too_large")  # fmt: skip
        if len(self.url) + self._parsed_bytes > self.max_head_bytes:
            raise _Refusal(431, b"Request Header Fields Too Large", b"request head exceeds %d bytes" %
                           self.max_head_bytes, b"request_header_fields_too_large")  # fmt: skip
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if self.parser.should_upgrade():
            if any(name in (b"content-length", b"transfer-encoding") and value.strip() not in (b"", b"0")
                   for name, value in self.headers):  # fmt: skip
                raise _Refusal(400, b"Bad Request", b"protocol upgrade is not supported; send the request "
                               b"without Connection: upgrade", b"upgrade_not_supported")  # fmt: skip
        self._head_done_s = self.loop.time()
        self._in_head = False
        super().on_headers_complete()
        if self.parser.should_upgrade():
            self.cycle.keep_alive = False  # what follows the head is another protocol: close after the answer

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        self._head_bytes = 0
        self._message_ended = True
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """A request the HTTP parser cannot read: 400 in OpenAI's format (uvicorn's is plain text)."""
        self._refuse(400, b"Bad Request", b"invalid HTTP request", b"invalid_http_request")

    def _arm(self) -> None:
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

    def _count_reject(self, status: int) -> None:
        on_reject = getattr(self.app, "on_server_reject", None)
        if on_reject is not None:
            on_reject(status)

    def _refuse(self, status: int, reason: bytes, message: bytes, code: bytes) -> None:
        """Answer `status` (unless a response has begun) and close the connection; a request
        task waiting for its body sees a disconnect."""
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and (cycle.response_started or self._in_head):
            # An answer is under way, or (a pipelined request refused in its head) an earlier
            # request's answer is still to come: let it finish, then close.
            cycle.keep_alive = False
            self.flow.pause_reading()
            if self._in_head:
                self._count_reject(status)
            return
        if cycle is not None and cycle.response_started:
            if not self._in_head:  # this request was answered before it had fully arrived
                self.transport.close()
                return
            cycle = None  # the answered request was an earlier one on this connection: refuse this one
        if cycle is not None:
            cycle.disconnected = True  # the app's receive() answers http.disconnect, its sends are dropped
            cycle.message_event.set()
        self._count_reject(status)
        body = error_body(message.decode("latin-1"), type_=error_type(status), code=code.decode())
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n"
            % (status, reason, len(body)) + body
        )
        self.transport.close()


def uvicorn_config(app: Any, host: str, port: int, *, log_level: str = "warning", loop: str = "uvloop",
                   head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                   max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES, max_target_bytes: int = MAX_REQUEST_TARGET_BYTES,
                   max_field_bytes: int = MAX_HEADER_FIELD_BYTES, max_header_fields: int = MAX_HEADER_FIELDS,
                   **overrides: Any) -> uvicorn.Config:  # fmt: skip
    """The uvicorn settings of the router: httptools parser guarded by `RequestGuardProtocol`
    (deadlines and head limits as given, in seconds and bytes), `loop` (uvloop in production;
    "auto" lets tests run in their own loop), lifespan on, no WebSocket, no access log, no server
    header, no proxy headers, `CLIENT_KEEPALIVE_S` keep-alive. `overrides`: further
    `uvicorn.Config` arguments. Raises ValueError for a limit that is not positive."""
    limits = {"head_timeout_s": head_timeout_s, "body_timeout_s": body_timeout_s, "max_head_bytes": max_head_bytes,
              "max_target_bytes": max_target_bytes, "max_field_bytes": max_field_bytes,
              "max_header_fields": max_header_fields}  # fmt: skip
    bad = [name for name, value in limits.items() if not value > 0]
    if bad:
        raise ValueError(f"{', '.join(bad)} must be > 0")
    protocol = type("RouterHttpProtocol", (RequestGuardProtocol,), limits)
    settings: dict[str, Any] = {
        "host": host, "port": port, "loop": loop, "http": protocol, "lifespan": "on", "access_log": False,
        "log_level": log_level, "server_header": False,
        "proxy_headers": False,  # the router does not use the client address; saves a middleware hop
        "timeout_keep_alive": CLIENT_KEEPALIVE_S,
        "ws": "none",  # the router never switches protocols (RequestGuardProtocol)
    }  # fmt: skip
    settings.update(overrides)
    return uvicorn.Config(app, **settings)


SERVER_TICK_S = 1.0
"""Seconds between two turns of the server's own loop (`TickingServer`): uvicorn's turn refreshes
the `date` header, which changes once a second. uvicorn turns every 0.1 s to notice `should_exit`,
10 wakeups a second of every idle router; here `should_exit` wakes the loop itself."""


class TickingServer(uvicorn.Server):
    """uvicorn's server whose own loop (`main_loop`: the `date` header, `should_exit`) turns once
    per `SERVER_TICK_S` instead of ten times a second, and at once when `should_exit` is set (by
    uvicorn's signal handler, or by the owner from any thread). Shutdown then starts as soon as it
    is asked, as uvicorn's does. Used by `ListeningServer` and the router pod's servers
    (`fleet/k8s/routerpod.py`)."""

    _wake_on_exit: Callable[[], None] | None = None

    @property
    def should_exit(self) -> bool:   # type: ignore[override]
        return self._exit_asked

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit_asked = value
        wake = self._wake_on_exit
        if value and wake is not None:
            wake()

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        asked = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):   # the loop closed: nothing waits any more
                loop.call_soon_threadsafe(asked.set)

        self._wake_on_exit = wake
        counter = 0
        try:
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + 10) % 864000   # uvicorn counts 0.1 s turns, the date at every 10th: each turn
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asked.wait(), SERVER_TICK_S)
                should_exit = await self.on_tick(counter)
        finally:
            self._wake_on_exit = None


class ListeningServer(TickingServer):
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


def serve(host: str, port: int, admin_token: str, log_level: str = "warning",
          models_path: Path | None = None, engine_load_interval_s: float | None = None,
          fd: int | None = None, picker: tuple[str, int, float] | None = None) -> None:  # fmt: skip
    """Serve a fresh router app on `host:port` until SIGINT/SIGTERM.

    `port` 0 binds a free port (the printed line says which). `fd`: a listening TCP socket
    inherited from the parent, served instead of binding `host:port` (`inherited_listener`).
    SIGTERM stops accepting and lets the requests in flight finish (uvicorn's graceful
    shutdown), for at most `DRAIN_TIMEOUT_S`. `admin_token` guards
    `/admin/v1` (non-empty, else ValueError). `log_level` is uvicorn's (e.g. "info").
    `models_path`: the models file (`router.http.remembered`; None: none).
    `engine_load_interval_s`: seconds between engine load polls (`router.signals.engine_poll`; None: off).
    `picker`: the endpoint picker's (host, port, deadline in seconds), or None (`router.http.app.create_app`).
    """
    app = create_app(admin_token, models_path=models_path, engine_load_interval_s=engine_load_interval_s,
                     picker=picker)
    config = uvicorn_config(app, host, port, log_level=log_level, timeout_graceful_shutdown=DRAIN_TIMEOUT_S)
    sockets = None if fd is None else [inherited_listener(fd)]
    ListeningServer(config, _print_listening).run(sockets=sockets)


def inherited_listener(fd: int) -> socket.socket:
    """The listening socket at descriptor `fd` (inherited from the parent; its family read from
    the socket itself, where uvicorn's own ``fd=`` takes every descriptor for AF_UNIX).

    Raises ValueError naming `--fd` when `fd` is not a listening TCP socket."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as err:
        raise ValueError(f"--fd {fd}: not an open socket ({err.strerror or err})") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6) or not listening:
        sock.detach()
        raise ValueError(f"--fd {fd}: not a listening TCP socket")
    return sock
