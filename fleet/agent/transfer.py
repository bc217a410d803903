"""Fetching one file: resumable, verified, retried with backoff.

Owns `fetch_file` (a `RemoteFile` into a part file: resume from its length with an HTTP Range
request, hash while writing, verify size / sha256 / git blob id, retry with tenacity) and the two
transports behind one signature: `HttpxTransfer` (http(s) manifests) and `HubTransfer`
(huggingface_hub's own ``file_download.http_get``, the code ``hf_hub_download`` streams with).
Called by `fleet.agent.cache.WeightCache`; tests run it against tests/hub_server.py.

Why not ``hf_hub_download`` itself: in huggingface_hub 2.x it downloads into a process-unique
temporary file that it deletes on failure (``_download_to_tmp_and_move``), so a download cut by
a crash or a restart starts again from byte 0. Fleet keeps its part file across processes and
hands its length to ``http_get(resume_size=...)``, which sends the Range request.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Protocol

import tenacity

from fleet.agent.sources import RemoteFile

CHUNK_BYTES = 1 << 20
OnBytes = Callable[[int], None]


class TransferError(RuntimeError):
    """A transfer that may succeed when tried again (connection cut, 5xx, 429, timeout)."""


class FetchRefused(RuntimeError):
    """The server refused the file for good (404, 401, 403, other 4xx). Not retried."""


class VerificationError(RuntimeError):
    """A complete download whose size or digest differs from what the source listed. The part
    file is deleted, so the next attempt fetches it from byte 0."""


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per file and the exponential backoff between them (tenacity's
    ``wait_exponential``: ``initial_s * 2**n`` capped at ``max_s``, plus up to ``initial_s`` of
    random jitter)."""

    attempts: int = 5
    initial_s: float = 0.5
    max_s: float = 30.0


class Transfer(Protocol):
    def fetch(self, url: str, out: BinaryIO, resume_size: int, headers: dict[str, str],
              expected_size: int | None) -> None:
        """Write the bytes of ``url`` from offset ``resume_size`` to ``out`` (positioned there).

        A server that ignores the Range answers 200: the transport then truncates ``out`` to 0
        and writes the whole body. Raises TransferError (retryable) or FetchRefused.
        """
        ...


class HttpxTransfer:
    """GET with httpx, streaming ``CHUNK_BYTES`` at a time. ``client``: an ``httpx.Client``."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def fetch(self, url: str, out: BinaryIO, resume_size: int, headers: dict[str, str],
              expected_size: int | None) -> None:
        import httpx

        req_headers = dict(headers)
        if resume_size:
            req_headers["Range"] = f"bytes={resume_size}-"
        try:
            with self.client.stream("GET", url, headers=req_headers, follow_redirects=True) as resp:
                if resp.status_code == 416 and expected_size == resume_size:
                    return   # already complete
                _raise_for_status(resp.status_code, url)
                if resume_size and resp.status_code == 200:
                    out.seek(0)
                    out.truncate()
                for chunk in resp.iter_raw():   # as read from the socket: a cut loses nothing written
                    out.write(chunk)
        except httpx.TransportError as err:
            raise TransferError(f"{url}: {type(err).__name__}: {err}") from None


class HubTransfer:
    """huggingface_hub's ``file_download.http_get`` (its retries on cut connections included).

    ``http_get`` writes in ``constants.DOWNLOAD_CHUNK_SIZE`` (10 MiB) pieces: a cut loses the
    piece in flight, everything written before it is resumed from."""

    def fetch(self, url: str, out: BinaryIO, resume_size: int, headers: dict[str, str],
              expected_size: int | None) -> None:
        import httpx2
        from huggingface_hub.errors import HfHubHTTPError
        from huggingface_hub.file_download import http_get

        try:
            http_get(url, out, resume_size=resume_size, headers=headers, expected_size=expected_size,
                     displayed_filename=url.rsplit("/", 1)[-1])
        except HfHubHTTPError as err:
            status = err.response.status_code if err.response is not None else 0
            _raise_for_status(status, url, str(err).splitlines()[0])
            raise TransferError(f"{url}: {err}") from None
        except (httpx2.HTTPError, OSError) as err:
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


class _HashingWriter:
    """The file object handed to a transport: hashes what is written, counts it for progress,
    and re-hashes from the file when a transport rewinds and truncates it."""

    def __init__(self, f: BinaryIO, rf: RemoteFile, on_bytes: OnBytes | None) -> None:
        self.f = f
        self.rf = rf
        self.on_bytes = on_bytes
        self.sha256 = hashlib.sha256()
        self.git = _git_hasher(rf)
        self.written = 0

    def absorb_existing(self) -> int:
        """Hash the part file's current content (a resumed download); returns its length."""
        self.f.seek(0)
        while chunk := self.f.read(CHUNK_BYTES):
            self._update(chunk)
        return self.written

    def _update(self, chunk: bytes) -> None:
        self.sha256.update(chunk)
        if self.git is not None:
            self.git.update(chunk)
        self.written += len(chunk)

    def write(self, chunk: bytes) -> int:
        n = self.f.write(chunk)
        self._update(chunk)
        if self.on_bytes is not None:
            self.on_bytes(len(chunk))
        return n

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self.f.seek(pos, whence)

    def truncate(self, size: int | None = None) -> int:
        keep = self.f.tell() if size is None else size
        dropped = self.written - keep
        self.f.truncate(keep)
        self.f.seek(keep)
        self.sha256, self.git, self.written = hashlib.sha256(), _git_hasher(self.rf), 0
        self.f.seek(0)
        while self.written < keep and (chunk := self.f.read(min(CHUNK_BYTES, keep - self.written))):
            self._update(chunk)
        if self.on_bytes is not None and dropped > 0:
            self.on_bytes(-dropped)
        return keep

    def flush(self) -> None:
        self.f.flush()


def _git_hasher(rf: RemoteFile):
    if rf.git_sha1 is None or rf.size is None:
        return None
    h = hashlib.sha1(usedforsecurity=False)
    h.update(b"blob %d\0" % rf.size)
    return h


@dataclass(frozen=True)
class Fetched:
    """A verified part file: its sha256 (hex) and size in bytes."""

    sha256: str
    size: int


def fetch_file(rf: RemoteFile, part: Path, transfer: Transfer, headers: dict[str, str] | None = None,
               on_bytes: OnBytes | None = None, retry: RetryPolicy = RetryPolicy()) -> Fetched:
    """Fetch ``rf`` into ``part`` (created, or resumed from its length) and verify it.

    ``on_bytes(n)`` is called with each chunk's length (negative when a transport discards bytes).
    Transient failures are retried with exponential backoff (``retry``); a verification failure
    deletes the part file and is retried from byte 0. Raises FetchRefused, TransferError or
    VerificationError when the attempts are used up.
    """
    part.parent.mkdir(parents=True, exist_ok=True)

    def attempt() -> Fetched:
        return _fetch_once(rf, part, transfer, headers or {}, on_bytes)

    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_attempt(retry.attempts),
        wait=tenacity.wait_exponential(multiplier=retry.initial_s, max=retry.max_s) + tenacity.wait_random(0, retry.initial_s),
        retry=tenacity.retry_if_exception_type((TransferError, VerificationError)),
        reraise=True,
    )
    return retrying(attempt)


def _fetch_once(rf: RemoteFile, part: Path, transfer: Transfer, headers: dict[str, str],
                on_bytes: OnBytes | None) -> Fetched:
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+b") as f:
        writer = _HashingWriter(f, rf, None)
        have = writer.absorb_existing()
        if rf.size is not None and have > rf.size:   # longer than the file: not a prefix of it
            writer.truncate(0)
            have = 0
        if on_bytes is not None and have:
            on_bytes(have)
        writer.on_bytes = on_bytes
        f.seek(have)
        if rf.size is None or have < rf.size:
            transfer.fetch(rf.url, writer, have, headers, rf.size)
        f.flush()
        os.fsync(f.fileno())
        size = writer.written
        digest = writer.sha256.hexdigest()
        git = writer.git.hexdigest() if writer.git is not None else None
    problem = None
    if rf.size is not None and size != rf.size:
        problem = f"size {size} bytes, the source lists {rf.size}"
    elif rf.sha256 is not None and digest != rf.sha256:
        problem = f"sha256 {digest}, the source lists {rf.sha256}"
    elif rf.git_sha1 is not None and git is not None and git != rf.git_sha1:
        problem = f"git blob id {git}, the source lists {rf.git_sha1}"
    if problem is not None:
        part.unlink(missing_ok=True)
        if on_bytes is not None:
            on_bytes(-size)
        raise VerificationError(f"{rf.path} from {rf.url}: {problem}")
    return Fetched(digest, size)
