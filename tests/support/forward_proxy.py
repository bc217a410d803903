"""A forward HTTP proxy for tests: a STAND-IN for squid or a corporate proxy (no proxy runs in
CI). It speaks the two things clients send a proxy (RFC 9110 section 7.1, RFC 9112 section 3.2):

- ``GET http://host:port/path``: the request in absolute form, fetched from the origin with
  ``http.client`` and streamed back;
- ``CONNECT host:port``: a TCP tunnel, ``200`` then bytes relayed both ways until either side
  closes (TLS runs end to end through it).

``require_auth``: a ``Proxy-Authorization`` value every request must carry (407 otherwise).
``hosts``: names only the proxy resolves (an internal host, reachable through the proxy alone).
``log`` records ``(method, target, Proxy-Authorization)`` for every request.
"""

from __future__ import annotations

import http.client
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit


class ForwardProxy:
    """``with ForwardProxy() as proxy:``; ``proxy.url`` is ``http://127.0.0.1:<port>``."""

    def __init__(self, require_auth: str | None = None, hosts: dict[str, str] | None = None) -> None:
        self.require_auth = require_auth
        self.hosts = dict(hosts or {})
        self.log: list[tuple[str, str, str | None]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="forward-proxy", daemon=True)  # shutdown() waits one poll

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> ForwardProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def record(self, method: str, target: str, auth: str | None) -> None:
        with self._lock:
            self.log.append((method, target, auth))


def _handler(proxy: ForwardProxy):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:   # quiet
            pass

        def _allowed(self) -> bool:
            auth = self.headers.get("Proxy-Authorization")
            proxy.record(self.command, self.path, auth)
            if proxy.require_auth is not None and auth != proxy.require_auth:
                self.send_response(407)
                self.send_header("Proxy-Authenticate", 'Basic realm="test"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return False
            return True

        def do_CONNECT(self) -> None:
            if not self._allowed():
                return
            host, _, port = self.path.rpartition(":")
            upstream = socket.create_connection((proxy.hosts.get(host, host), int(port)), timeout=30)
            self.send_response(200, "Connection established")
            self.end_headers()
            sockets = [self.connection, upstream]
            try:
                while True:
                    readable, _, _ = select.select(sockets, [], [], 30)
                    if not readable:
                        return
                    for sock in readable:
                        data = sock.recv(65536)
                        if not data:
                            return
                        (upstream if sock is self.connection else self.connection).sendall(data)
            finally:
                upstream.close()
                self.close_connection = True

        def do_GET(self) -> None:
            if not self._allowed():
                return
            url = urlsplit(self.path)
            if url.scheme != "http" or not url.hostname:
                self.send_error(400, "a proxy wants an absolute http URL")
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("proxy-authorization", "host")}
            conn = http.client.HTTPConnection(proxy.hosts.get(url.hostname, url.hostname), url.port or 80, timeout=30)
            try:
                conn.request("GET", (url.path or "/") + (f"?{url.query}" if url.query else ""), headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            finally:
                conn.close()

    return Handler
