"""The transports one file is fetched over, behind one signature.

Owns the `Transfer` protocol (write a URL's bytes from an offset into a `Sink`), its two
implementations, `HttpTransfer` (http(s) manifests; the standard library's http.client, with the
environment's proxies) and `HubTransfer` (huggingface_hub's own ``file_download.http_get``, the
code ``hf_hub_download`` streams with), and the errors a transfer raises: `TransferError`
(retried), `FetchRefused` (not) and `VerificationError`. Called by
`fleet.agent.transfer.fetch_file` (each attempt) and `fleet.agent.cache.WeightCache` (which
transport a model's plan names); tests run them against fleet/testing/hub_server.py.
"""

from __future__ import annotations

import base64
import http.client
import ssl
import threading
import urllib.request
from typing import Callable, Protocol
from urllib.parse import unquote, urljoin, urlsplit


class TransferError(RuntimeError):
    """A transfer that may succeed when tried again (connection cut, 5xx, 429, timeout)."""


class FetchRefused(RuntimeError):
    """The server refused the file for good (404, 401, 403, other 4xx). Not retried."""


class VerificationError(RuntimeError):
    """A complete download whose size or digest differs from what the source listed. The part
    file is deleted, so the next attempt fetches it from byte 0."""


class Sink(Protocol):
    """Where a transport writes: positioned at the resume offset. ``fill(readinto)`` does one
    ``readinto`` into a buffer of the sink's and writes it, returning the bytes read (0 at the
    end); ``write``, ``seek``, ``tell``, ``truncate`` as a binary file's (a transport that
    rewinds truncates to 0 and writes from the start)."""

    def fill(self, readinto: Callable[[memoryview], int]) -> int: ...
    def write(self, chunk: bytes) -> int: ...
    def seek(self, pos: int, whence: int = 0) -> int: ...
    def tell(self) -> int: ...
    def truncate(self, size: int | None = None) -> int: ...


class Transfer(Protocol):
    """One way of fetching a file's bytes (`HttpTransfer`, `HubTransfer`)."""

    def fetch(self, url: str, out: Sink, resume_size: int, headers: dict[str, str],
              expected_size: int | None) -> None:
        """Write the bytes of ``url`` from offset ``resume_size`` to ``out`` (positioned there;
        file-like: ``write``, ``seek``, ``tell``, ``truncate``, and ``fill(readinto)``).

        A server that ignores the Range answers 200: the transport then truncates ``out`` to 0
        and writes the whole body. Raises TransferError (retryable) or FetchRefused.
        """
        ...


class HttpTransfer:
    """GET with the standard library's ``http.client``, ``readinto`` pooled ``CHUNK_BYTES``
    buffers written in ``WRITE_BYTES`` pieces (`Sink.fill`, `fleet.agent.transfer`'s writer):
    about half of curl's CPU per byte, where httpx's 64 KiB event loop costs twice curl's
    (loadtests/bench_cache_fill.py).
    Follows up to ``MAX_REDIRECTS`` redirects (dropping ``Authorization`` when the host
    changes); keeps one connection per host per thread.

    Proxies as curl, httpx (the manifests) and huggingface_hub (hub sources) take them:
    ``http_proxy`` / ``https_proxy`` / ``no_proxy`` (either case), read by the standard
    library's ``urllib.request.getproxies`` and ``proxy_bypass`` when a connection is opened.
    An http URL goes to the proxy in absolute form; an https URL through a ``CONNECT`` tunnel,
    TLS end to end with the origin. User and password in the proxy's URL become a basic
    ``Proxy-Authorization``."""

    MAX_REDIRECTS = 5

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _conn(self, scheme: str, netloc: str) -> tuple[http.client.HTTPConnection, bool]:
        """The kept connection for ``(scheme, netloc)`` (opened now if none), and whether it is
        a plain-http proxy's (requests then name the whole URL)."""
        conns = self._local.__dict__.setdefault("conns", {})
        key = (scheme, netloc)
        if key not in conns:
            conns[key] = _open_connection(scheme, netloc, self.timeout_s)
        return conns[key]

    def _drop(self, scheme: str, netloc: str) -> None:
        kept = self._local.__dict__.setdefault("conns", {}).pop((scheme, netloc), None)
        if kept is not None:
            kept[0].close()

    def fetch(self, url: str, out: Sink, resume_size: int, headers: dict[str, str],
              expected_size: int | None) -> None:
        req_headers = dict(headers)
        if resume_size:
            req_headers["Range"] = f"bytes={resume_size}-"
        first_host = urlsplit(url).netloc
        hops = redials = 0
        while hops <= self.MAX_REDIRECTS:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https"):
                raise FetchRefused(f"{url}: not an http(s) URL")
            if parts.netloc != first_host:
                req_headers.pop("Authorization", None)
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            reused = (parts.scheme, parts.netloc) in self._local.__dict__.get("conns", {})
            got = 0
            try:
                conn, via_proxy = self._conn(parts.scheme, parts.netloc)
                conn.request("GET", url if via_proxy else target, headers=req_headers)
                resp = conn.getresponse()
                location = resp.getheader("Location")
                if resp.status in (301, 302, 303, 307, 308) and location:
                    resp.read()
                    url = urljoin(url, location)
                    hops += 1
                    continue
                if resp.status == 416 and expected_size == resume_size:
                    resp.read()
                    return   # already complete
                if resp.status >= 400:
                    resp.read()
                    _raise_for_status(resp.status, url)
                if resume_size and resp.status == 200:   # the server ignored the Range
                    out.seek(0)
                    out.truncate()
                elif resp.status == 206 and not (resp.getheader("Content-Range") or "").startswith(
                        f"bytes {resume_size}-"):
                    raise TransferError(f"{url}: asked for bytes {resume_size}- and got "
                                        f"{resp.getheader('Content-Range')!r}")
                length = resp.getheader("Content-Length")
                while n := out.fill(resp.readinto):
                    got += n
                if length is not None and got < int(length):   # http.client ends a cut body quietly
                    raise TransferError(f"{url}: connection closed after {got} of {length} bytes")
                return
            except (OSError, http.client.HTTPException) as err:
                self._drop(parts.scheme, parts.netloc)
                if reused and got == 0 and redials == 0:   # a kept-alive connection the server had closed
                    redials += 1
                    continue
                refused = _refused_tunnel(err)
                if refused is not None:
                    _raise_for_status(refused, url, f"the proxy refused the CONNECT tunnel: {err}")
                raise TransferError(f"{url}: {type(err).__name__}: {err}") from None
        raise FetchRefused(f"{url}: more than {self.MAX_REDIRECTS} redirects")


def _open_connection(scheme: str, netloc: str, timeout_s: float) -> tuple[http.client.HTTPConnection, bool]:
    """A connection to ``scheme://netloc``, through the environment's proxy for ``scheme`` unless
    ``no_proxy`` bypasses the host (`HttpTransfer`); and whether requests on it name the whole
    URL (plain http through a proxy). Raises FetchRefused for a proxy URL that is not http."""
    origin = urlsplit(f"//{netloc}")
    proxy = urllib.request.getproxies().get(scheme)
    if proxy and urllib.request.proxy_bypass(origin.hostname or netloc):
        proxy = None
    context = ssl.create_default_context() if scheme == "https" else None
    if not proxy:
        if context is not None:
            return http.client.HTTPSConnection(netloc, timeout=timeout_s, context=context), False
        return http.client.HTTPConnection(netloc, timeout=timeout_s), False
    p = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if p.scheme != "http" or not p.hostname:
        raise FetchRefused(f"{scheme}_proxy={proxy!r}: only an http:// proxy is supported")
    proxy_headers = {}
    if p.username is not None:
        credentials = f"{unquote(p.username)}:{unquote(p.password or '')}".encode()
        proxy_headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials).decode()
    if context is None:
        return _ProxiedHTTPConnection(p.hostname, p.port or 80, proxy_headers, timeout=timeout_s), True
    conn = http.client.HTTPSConnection(p.hostname, p.port or 80, timeout=timeout_s, context=context)
    conn.set_tunnel(origin.hostname or netloc, origin.port or 443, headers=proxy_headers)
    return conn, False


def _refused_tunnel(err: BaseException) -> int | None:
    """The status a proxy answered a ``CONNECT`` with, when that is why ``err`` was raised, else
    None. http.client reports it only in the message of an OSError: ``Tunnel connection failed:
    407 Proxy Authentication Required``."""
    prefix = "Tunnel connection failed: "
    text = str(err)
    if type(err) is OSError and text.startswith(prefix) and text[len(prefix):len(prefix) + 3].isdigit():
        return int(text[len(prefix):len(prefix) + 3])
    return None


class _ProxiedHTTPConnection(http.client.HTTPConnection):
    """A plain-http connection to a proxy that adds the proxy's credentials to every request."""

    def __init__(self, host: str, port: int, proxy_headers: dict[str, str], **kw) -> None:
        super().__init__(host, port, **kw)
        self._proxy_headers = proxy_headers

    def request(self, method, url, body=None, headers=None, **kw):  # type: ignore[override]
        super().request(method, url, body, {**(headers or {}), **self._proxy_headers}, **kw)


class HubTransfer:
    """huggingface_hub's ``file_download.http_get`` (its retries on cut connections included).

    ``http_get`` writes in ``constants.DOWNLOAD_CHUNK_SIZE`` (10 MiB) pieces: a cut loses the
    piece in flight, everything written before it is resumed from."""

    def fetch(self, url: str, out: Sink, resume_size: int, headers: dict[str, str],
              expected_size: int | None) -> None:
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.file_download import http_get

        try:
            http_get(url, out, resume_size=resume_size, headers=headers, expected_size=expected_size,
                     displayed_filename=url.rsplit("/", 1)[-1])
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else 0
            _raise_for_status(status, url, str(err).splitlines()[0])
            raise TransferError(f"{url}: {err}") from None
        except ValueError as err:   # e.g. a file over http_get's plain-HTTP size limit
            raise FetchRefused(f"{url}: {err}") from None
        except Exception as err:    # the client library's transport errors (its HTTP client varies by version)
            if "Consistency check failed" in str(err):
                raise VerificationError(f"{url}: {str(err).splitlines()[0]}") from None
            raise TransferError(f"{url}: {type(err).__name__}: {err}") from None


def _raise_for_status(status: int, url: str, detail: str = "") -> None:
    if status < 400:
        return
    msg = f"{url}: HTTP {status}" + (f" ({detail})" if detail else "")
    if status in (408, 429) or status >= 500:
        raise TransferError(msg)
    raise FetchRefused(msg)
