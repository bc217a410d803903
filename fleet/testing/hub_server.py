"""A local HTTP server speaking the part of the Hugging Face Hub's HTTP API that model downloads
use, plus plain static files (for http(s) manifest sources), with fault injection.

Used by the weight-cache tests (tests/unit/test_agent_cache.py, test_agent_proxy.py) and by
loadtests/bench_cache_fill.py; the real `huggingface_hub` client code runs against it (set
``HF_ENDPOINT`` to ``server.url``). No hub is reachable from CI, so this is the hub there.

Routes (as huggingface.co answers them, read from huggingface_hub 2.x's client code:
``HfApi.model_info``, ``hf_hub_url``, ``file_download.http_get``, ``utils._http.hf_raise_for_status``):

- ``GET /api/models/{org}/{name}/revision/{rev}[?blobs=true]``: ``{"id", "sha", "siblings":
  [{"rfilename", "size", "blobId", "lfs": {"sha256", "size", "pointerSize"}}]}``; an unknown
  repository is 404 with ``X-Error-Code: RepoNotFound``, an unknown revision 404 with
  ``X-Error-Code: RevisionNotFound``; a repository marked private wants ``Authorization: Bearer
  <token>`` (401 + RepoNotFound without it, as the hub answers);
- ``GET|HEAD /{org}/{name}/resolve/{rev}/{path}``: the file, with ``ETag``, ``X-Repo-Commit``,
  ``X-Linked-Size`` / ``X-Linked-Etag`` for LFS files, and ``Range: bytes=N-`` answered 206;
- ``GET /static/{path}``: a file of ``static_root`` (Range too), sent with ``sendfile``.

``GET /_log``: the request log as JSON (for a client in another process).

Run alone (loadtests/bench_cache_fill.py does, so that the server does not share the client's
GIL): ``python -m fleet.testing.hub_server [STATIC_ROOT] [--repo org/name=DIR] [--port N]`` prints its
URL and serves until killed (``fleet make-tiny-model DIR`` then ``--repo org/tiny=DIR`` and
``HF_ENDPOINT=<url>`` give ``hf://org/tiny`` to ``fleet cache pull`` or a deployment).

Faults: ``cut_after[path] = n`` closes the connection after ``n`` bytes of that file (once);
``hold_after[path] = n`` sends ``n`` bytes then waits until ``release`` is set (a client can be
killed mid-download); ``corrupt.add(path)`` flips a byte of what is sent (once); ``redirect[path] = location``
answers 302; ``ignore_range.add(path)`` answers 200 in full to a Range request.
"""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_THRESHOLD_BYTES = 1024   # files this size or larger are "LFS" files (sha256 listed), like the hub's *.safetensors


@dataclass
class HubRepo:
    files: dict[str, bytes]
    commit: str = ""
    branches: tuple[str, ...] = ("main",)
    private: bool = False

    def __post_init__(self) -> None:
        if not self.commit:
            h = hashlib.sha1(usedforsecurity=False)
            for name in sorted(self.files):
                h.update(name.encode() + b"\0" + self.files[name])
            self.commit = h.hexdigest()


@dataclass
class ServerLog:
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)   # (method, path, Range)
    body_bytes: int = 0

    def file_gets(self, suffix: str) -> list[str | None]:
        """The Range header of every GET whose path ends with ``suffix``."""
        return [rng for m, p, rng in self.requests if m == "GET" and p.endswith(suffix)]


class HubServer:
    """Start with ``with HubServer(...) as hub:``; ``hub.url`` is ``http://127.0.0.1:<port>``
    (``https://`` with ``tls``)."""

    def __init__(self, repos: dict[str, HubRepo] | None = None, static_root: Path | None = None,
                 token: str | None = None, port: int = 0, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: a server-side context; the server then speaks https (``url`` says so)."""
        self.repos = dict(repos or {})
        self.static_root = static_root
        self.token = token
        self.cut_after: dict[str, int] = {}
        self.hold_after: dict[str, int] = {}
        self.corrupt: set[str] = set()
        self.redirect: dict[str, str] = {}     # path suffix -> Location (302), always
        self.ignore_range: set[str] = set()    # path suffixes answered 200 in full even with a Range
        self.drop_kept_alive = False           # close every connection after one response, unannounced
        self.release = threading.Event()
        self.log = ServerLog()
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._httpd.daemon_threads = True
        self.scheme = "http"
        if tls is not None:
            self._httpd.socket = tls.wrap_socket(self._httpd.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="hub-server", daemon=True)  # shutdown() waits one poll

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> HubServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()
        self._httpd.shutdown()
        self._httpd.server_close()

    def record(self, method: str, path: str, rng: str | None) -> None:
        with self._lock:
            self.log.requests.append((method, path, rng))

    def sent(self, n: int) -> None:
        with self._lock:
            self.log.body_bytes += n

    def take_fault(self, table: dict[str, int], path: str) -> int | None:
        with self._lock:
            for key in list(table):
                if path.endswith(key):
                    return table.pop(key)
        return None

    def take_corrupt(self, path: str) -> bool:
        with self._lock:
            for key in list(self.corrupt):
                if path.endswith(key):
                    self.corrupt.discard(key)
                    return True
        return False


def _sibling(name: str, data: bytes) -> dict:
    git = hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()
    if len(data) >= LFS_THRESHOLD_BYTES:
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
        return {"rfilename": name, "size": len(data), "blobId": hashlib.sha1(pointer.encode()).hexdigest(),
                "lfs": {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": len(pointer)}}
    return {"rfilename": name, "size": len(data), "blobId": git}


def _handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:   # quiet
            pass

        def _error(self, status: int, code: str | None = None, message: str = "") -> None:
            body = json.dumps({"error": message or code or str(status)}).encode()
            self.send_response(status)
            if code:
                self.send_header("X-Error-Code", code)
                self.send_header("X-Error-Message", message or code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, doc) -> None:
            body = json.dumps(doc).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self, repo: HubRepo) -> bool:
            if not repo.private:
                return True
            return self.headers.get("Authorization") == f"Bearer {server.token}"

        def _repo(self, repo_id: str, rev: str) -> HubRepo | None:
            repo = server.repos.get(repo_id)
            if repo is None or not self._authorized(repo):
                status = 401 if repo is not None else 404
                self._error(status, "RepoNotFound", f"Repository Not Found for url: {self.path}")
                return None
            if rev not in repo.branches and rev != repo.commit:
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def do_HEAD(self) -> None:
            self.do_GET()

        def do_GET(self) -> None:
            try:
                self._get()
            finally:
                if server.drop_kept_alive:
                    self.close_connection = True   # no "Connection: close": the client finds out on reuse

        def _get(self) -> None:
            path = unquote(urlsplit(self.path).path)
            server.record(self.command, path, self.headers.get("Range"))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
                repo_id, rev = "/".join(parts[2:4]), parts[5]
                repo = self._repo(repo_id, rev)
                if repo is not None:
                    self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": repo.private,
                                "siblings": [_sibling(n, d) for n, d in sorted(repo.files.items())]})
                return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, rev, name = "/".join(parts[:2]), parts[3], "/".join(parts[4:])
                repo = self._repo(repo_id, rev)
                if repo is None:
                    return
                if name not in repo.files:
                    self._error(404, "EntryNotFound", f"{name} does not exist at {rev}")
                    return
                data = repo.files[name]
                sib = _sibling(name, data)
                etag = sib["lfs"]["sha256"] if "lfs" in sib else sib["blobId"]
                extra = {"ETag": f'"{etag}"', "X-Repo-Commit": repo.commit}
                if "lfs" in sib:
                    extra.update({"X-Linked-Size": str(len(data)), "X-Linked-Etag": f'"{etag}"'})
                self._send_bytes(path, len(data), lambda off, n: data[off:off + n], extra)
                return
            if path == "/_log":   # the request log, for a client in another process (the benchmark)
                self._json({"requests": server.log.requests, "body_bytes": server.log.body_bytes})
                return
            target = next((loc for suffix, loc in server.redirect.items() if path.endswith(suffix)), None)
            if target is not None:
                self.send_response(302)
                self.send_header("Location", target)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            if parts[0] == "static" and server.static_root is not None:
                file = (server.static_root / "/".join(parts[1:])).resolve()
                if not file.is_file() or server.static_root.resolve() not in file.parents:
                    self._error(404, None, "not found")
                    return
                with file.open("rb") as f:
                    self._send_file(path, f)
                return
            self._error(404, None, "no such route")

        def _range_start(self, size: int) -> int | None:
            rng = self.headers.get("Range")
            if any(unquote(urlsplit(self.path).path).endswith(s) for s in server.ignore_range):
                return None
            if not rng or not rng.startswith("bytes=") or not rng.endswith("-"):
                return None
            return int(rng[len("bytes="):-1])

        def _head(self, size: int, extra: dict[str, str]) -> tuple[int, int] | None:
            start = self._range_start(size)
            if start is not None and start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            self.send_response(206 if start else 200)
            start = start or 0
            if start:
                self.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
            self.send_header("Content-Length", str(size - start))
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Type", "application/octet-stream")
            for k, v in extra.items():
                self.send_header(k, v)
            self.end_headers()
            return start, size - start

        def _faults(self, path: str) -> tuple[int | None, int | None, bool]:
            return (server.take_fault(server.cut_after, path), server.take_fault(server.hold_after, path),
                    server.take_corrupt(path))

        def _send_bytes(self, path: str, size: int, read, extra: dict[str, str]) -> None:
            span = self._head(size, extra)
            if span is None or self.command == "HEAD":
                return
            start, count = span
            cut, hold, corrupt = self._faults(path)
            sent = 0
            while sent < count:
                n = min(1 << 20, count - sent)
                if cut is not None:
                    n = min(n, cut - sent)
                if hold is not None and sent < hold:
                    n = min(n, hold - sent)
                chunk = bytes(read(start + sent, n))
                if corrupt and sent == 0 and chunk:
                    chunk = bytes([chunk[0] ^ 0xFF]) + chunk[1:]
                self.wfile.write(chunk)
                sent += len(chunk)
                server.sent(len(chunk))
                if cut is not None and sent >= cut:
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                if hold is not None and sent >= hold:
                    self.wfile.flush()
                    server.release.wait()
                    hold = None

        def _send_file(self, path: str, f) -> None:
            size = os.fstat(f.fileno()).st_size
            cut, hold, corrupt = self._faults(path)
            if cut is not None or hold is not None or corrupt:
                server.cut_after.update({path: cut} if cut is not None else {})
                server.hold_after.update({path: hold} if hold is not None else {})
                if corrupt:
                    server.corrupt.add(path)

                def read(off: int, n: int) -> bytes:
                    f.seek(off)
                    return f.read(n)
                self._send_bytes(path, size, read, {})
                return
            span = self._head(size, {})
            if span is None or self.command == "HEAD":
                return
            start, count = span
            self.wfile.flush()
            sent = 0
            while sent < count:
                n = self.connection.sendfile(f, start + sent, count - sent)
                if n == 0:
                    break
                sent += n
            server.sent(sent)

    return Handler


def repo_from_dir(model_dir: Path, private: bool = False) -> HubRepo:
    """A hub repository holding every file under ``model_dir`` (read into memory: test models)."""
    files = {p.relative_to(model_dir).as_posix(): p.read_bytes()
             for p in sorted(model_dir.rglob("*")) if p.is_file()}
    return HubRepo(files, private=private)


def main(argv: list[str] | None = None) -> None:
    """``python -m fleet.testing.hub_server [--static DIR] [--repo org/name=DIR ...] [--port N]``: serve
    until killed, printing the URL first. For demos of ``fleet up`` with an ``hf://`` source:
    ``HF_ENDPOINT=<url>`` and ``source: hf://org/name``."""
    import argparse
    import time

    ap = argparse.ArgumentParser(description="A local stand-in for the Hugging Face Hub (tests only).")
    ap.add_argument("static", nargs="?", type=Path, help="Directory served under /static/.")
    ap.add_argument("--static", dest="static_opt", type=Path, help="Same as the positional argument.")
    ap.add_argument("--repo", action="append", default=[], metavar="ORG/NAME=DIR",
                    help="Serve DIR as the hub model repository ORG/NAME (repeatable).")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args(argv)
    repos = {}
    for spec in args.repo:
        name, _, d = spec.partition("=")
        if not d or not Path(d).is_dir():
            ap.error(f"--repo {spec!r}: expected ORG/NAME=DIR with DIR a directory")
        repos[name] = repo_from_dir(Path(d))
    server = HubServer(repos, static_root=args.static_opt or args.static, port=args.port)
    with server:
        print(server.url, flush=True)
        while True:
            time.sleep(3600)


if __name__ == "__main__":
    main()
