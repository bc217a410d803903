"""Fetching one file: resumable, verified, retried with backoff.

Owns `fetch_file` (a `RemoteFile` into a part file: resume from its length with an HTTP Range
request, hash while writing, verify size / sha256 / git blob id, retry with tenacity),
`RetryPolicy`, and the byte path under it: the writer a transport writes into (pooled buffers,
page-cache writes, the kernel's writeback, sha256 on a thread of its own). The transports
(`HttpTransfer`, `HubTransfer`) and their errors are fleet/agent/transports.py's. Called by
`fleet.agent.cache_fill.EntryFill`; tests run it against fleet/testing/hub_server.py.

Why not ``hf_hub_download`` itself: in huggingface_hub 2.x it downloads into a process-unique
temporary file that it deletes on failure (``_download_to_tmp_and_move``), so a download cut by
a crash or a restart starts again from byte 0. Fleet keeps its part file across processes and
hands its length to ``http_get(resume_size=...)``, which sends the Range request.

The byte path (what keeps a verified fill at curl's speed or better, loadtests/bench_cache_fill.py):
``readinto`` pooled ``CHUNK_BYTES`` buffers; page-cache writes of ``WRITE_BYTES``; the kernel's
writeback started every ``WRITEBACK_BYTES`` (the fsync before the rename then has little left);
sha256 on a thread of its own while a core is free for it, else inline (`hash_inline`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import queue
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

import tenacity

from fleet.agent.transports import Transfer, TransferError, VerificationError
from fleet.sources import RemoteFile

CHUNK_BYTES = 1 << 20
WRITE_BYTES = 32 << 10
"""The most bytes one ``write`` hands the page cache. The kernel backs a write with page-cache
folios about its size, and folios above 32 KiB (order 3, the largest its per-CPU free lists
keep) come from the buddy allocator, and on the development VM (Linux 6.18, ext4) they cost
several times the system CPU per byte (most when the memory has been free a second or more;
read as the host taking free guest memory back, not verified): 1 MiB writes cost 1.0 to 2.5 system CPU-s per GB there, 256
KiB writes 0.4 normally and 1.3 to 1.9 after another program's small writes freed its pages,
32 KiB writes 0.7 in both cases, as curl's 16 KiB ones (loadtests/bench_cache_fill.py,
docs/benchmarks.md "The weight cache against curl"). Receiving and hashing keep ``CHUNK_BYTES`` pieces."""
WRITEBACK_BYTES = 32 << 20
"""Every this many bytes written, the kernel is told to start writing them to disk (without
waiting): the fsync before the rename then finds little left to write."""
log = logging.getLogger("fleet.agent.transfer")
OnBytes = Callable[[int], None]


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts per file and the exponential backoff between them (tenacity's
    ``wait_exponential``: ``initial_s * 2**n`` capped at ``max_s``, plus up to ``initial_s`` of
    random jitter)."""

    attempts: int = 5
    initial_s: float = 0.5
    max_s: float = 30.0


class _BufferPool:
    """``CHUNK_BYTES`` buffers kept across files (at most ``keep`` idle), so that each file does
    not fault in fresh pages for its buffers."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.idle: list[bytearray] = []
        self.lock = threading.Lock()

    def take(self) -> bytearray:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return bytearray(CHUNK_BYTES)

    def give(self, buf: bytearray) -> None:
        with self.lock:
            if len(self.idle) < self.keep:
                self.idle.append(buf)


_BUFFERS = _BufferPool(keep=16)


class _Hasher:
    """sha256 (and the git blob id when the source lists one) of a byte stream.

    Hashing runs on a thread of its own, overlapped with receiving (large hashlib updates
    release the GIL), unless ``inline()`` says that this process is already fetching at least
    as many files as it has CPUs: then each fetching thread hashes what it received itself,
    as no core is left for a hashing thread and handing buffers to one only costs wake-ups.
    The choice is made per buffer, and a buffer is hashed inline only when the hashing thread
    has nothing pending, so the bytes are hashed in order. Takes ``bytes`` (``update``) or a
    pooled buffer (``update_buffer``: handed back to the pool once hashed; at most ``POOL``
    buffers exist); ``hexdigests`` waits for the rest."""

    POOL = 8

    def __init__(self, rf: RemoteFile, inline: Callable[[], bool] = lambda: False) -> None:
        self.sha256 = hashlib.sha256()
        self.git = _git_hasher(rf)
        self.inline = inline
        self.q: queue.Queue[bytes | tuple[bytearray, int] | None] = queue.Queue(2 * self.POOL)
        self.free: queue.Queue[bytearray] = queue.Queue()
        self.buffers = 0
        self.pending = 0   # items queued and not yet hashed; only the hashing thread lowers it
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._run, name="fleet-cache-sha256", daemon=True)
        self.thread.start()

    def _hash(self, data: bytes | memoryview) -> None:
        self.sha256.update(data)
        if self.git is not None:
            self.git.update(data)

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            if isinstance(item, tuple):
                buf, n = item
                self._hash(memoryview(buf)[:n])
                self.free.put(buf)
            else:
                self._hash(item)
            with self.lock:
                self.pending -= 1

    def _enqueue(self, item: bytes | tuple[bytearray, int]) -> bool:
        """Queue ``item`` for the hashing thread, or return False when the caller should hash
        it now (inline wanted and nothing queued before it)."""
        with self.lock:
            if self.pending == 0 and self.inline():
                return False
            self.pending += 1
        self.q.put(item)
        return True

    def buffer(self) -> bytearray:
        """A free buffer of ``CHUNK_BYTES`` (waits for one when ``POOL`` are in flight)."""
        try:
            return self.free.get_nowait()
        except queue.Empty:
            if self.buffers < self.POOL:
                self.buffers += 1
                return _BUFFERS.take()
            return self.free.get()

    def give_back(self, buf: bytearray) -> None:
        self.free.put(buf)

    def update(self, chunk: bytes) -> None:
        if not self._enqueue(chunk):
            self._hash(chunk)

    def update_buffer(self, buf: bytearray, n: int) -> None:
        if not self._enqueue((buf, n)):
            self._hash(memoryview(buf)[:n])
            self.free.put(buf)

    def hexdigests(self) -> tuple[str, str | None]:
        """Stop the thread (its buffers go back to the process's pool); returns (sha256, git
        blob id or None)."""
        self.q.put(None)
        self.thread.join()
        while True:
            try:
                _BUFFERS.give(self.free.get_nowait())
            except queue.Empty:
                break
        return self.sha256.hexdigest(), (self.git.hexdigest() if self.git is not None else None)


def hash_inline(fetching: int, cpus: int) -> bool:
    """Whether a fetching thread should hash what it receives itself rather than hand it to a
    hashing thread: when this process fetches at least as many files at once as it may use CPUs
    (``fetching`` counts the file being fetched), a hashing thread would find no free core."""
    return fetching >= max(1, cpus)


class _InFlight:
    """How many files this process is fetching now (`fetch_file` calls inside a transfer)."""

    def __init__(self) -> None:
        self.n = 0
        self.lock = threading.Lock()
        self.cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    @contextmanager
    def one(self) -> Iterator[None]:
        with self.lock:
            self.n += 1
        try:
            yield
        finally:
            with self.lock:
                self.n -= 1

    def hash_inline(self) -> bool:
        return hash_inline(self.n, self.cpus)


_IN_FLIGHT = _InFlight()


class _Writeback:
    """Starts the kernel writing a file range back to disk without waiting for it: Linux's
    ``sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)`` through libc (the standard
    library has no binding). A no-op where libc lacks it; errors are ignored (an optimisation:
    durability comes from the fsync before the rename, fleet/agent/cache_fill.py)."""

    SYNC_FILE_RANGE_WRITE = 2

    def __init__(self) -> None:
        self._call = None
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (OSError, AttributeError):
            return
        fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        fn.restype = ctypes.c_int
        self._call = fn

    def start(self, fd: int, offset: int, nbytes: int) -> None:
        if self._call is not None and nbytes > 0:
            self._call(fd, offset, nbytes, self.SYNC_FILE_RANGE_WRITE)


_WRITEBACK = _Writeback()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` of ``fd`` from ``offset`` back to disk, without waiting
    (`_Writeback`). Used by `_HashingWriter` and loadtests/bench_cache_fill.py."""
    _WRITEBACK.start(fd, offset, nbytes)


class _HashingWriter:
    """The file object handed to a transport: writes at once (what was received is on disk, for
    a later resume), hashes through a `_Hasher`, counts bytes for progress, and re-hashes from
    the file when a transport rewinds and truncates it."""

    def __init__(self, f: BinaryIO, rf: RemoteFile, on_bytes: OnBytes | None) -> None:
        self.f = f
        self.rf = rf
        self.on_bytes = on_bytes
        self.hasher = _Hasher(rf, _IN_FLIGHT.hash_inline)
        self.written = 0
        self.clean_to = 0   # bytes before this offset have been handed to the kernel's writeback

    def _absorb(self, limit: int | None) -> None:
        self.f.seek(0)
        while (limit is None or self.written < limit) and (
                chunk := self.f.read(CHUNK_BYTES if limit is None else min(CHUNK_BYTES, limit - self.written))):
            self.hasher.update(chunk)
            self.written += len(chunk)

    def absorb_existing(self) -> int:
        """Hash the part file's current content (a resumed download); returns its length."""
        self._absorb(None)
        return self.written

    def _write(self, data: memoryview) -> None:
        for off in range(0, len(data), WRITE_BYTES):
            self.f.write(data[off:off + WRITE_BYTES])
        end = self.f.tell()
        if end - self.clean_to >= WRITEBACK_BYTES:
            self.f.flush()
            _WRITEBACK.start(self.f.fileno(), self.clean_to, end - self.clean_to)
            self.clean_to = end

    def write(self, chunk: bytes) -> int:
        chunk = bytes(chunk)
        self._write(memoryview(chunk))
        self.hasher.update(chunk)
        self._count(len(chunk))
        return len(chunk)

    def fill(self, readinto: Callable[[memoryview], int]) -> int:
        """One ``readinto`` into a pooled buffer, written at once and hashed on the hashing
        thread; returns the bytes read (0 at the end)."""
        buf = self.hasher.buffer()
        try:
            n = readinto(memoryview(buf))
        except BaseException:
            self.hasher.give_back(buf)
            raise
        if not n:
            self.hasher.give_back(buf)
            return 0
        self._write(memoryview(buf)[:n])
        self.hasher.update_buffer(buf, n)
        self._count(n)
        return n

    def _count(self, n: int) -> None:
        self.written += n
        if self.on_bytes is not None:
            self.on_bytes(n)

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        at = self.f.seek(pos, whence)
        self.clean_to = min(self.clean_to, at)
        return at

    def truncate(self, size: int | None = None) -> int:
        keep = self.f.tell() if size is None else size
        dropped = self.written - keep
        self.f.truncate(keep)
        self.hasher.hexdigests()
        self.hasher, self.written = _Hasher(self.rf, _IN_FLIGHT.hash_inline), 0
        self._absorb(keep)
        self.f.seek(keep)
        self.clean_to = min(self.clean_to, keep)
        if self.on_bytes is not None and dropped > 0:
            self.on_bytes(-dropped)
        return keep

    def flush(self) -> None:
        self.f.flush()

    def finish(self) -> tuple[str, str | None]:
        return self.hasher.hexdigests()


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
    """Fetch ``rf`` into ``part`` (created, or resumed from its length) and verify it. The part
    file is not fsynced here: the caller does, before renaming it into the store.

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
        before_sleep=tenacity.before_sleep_log(log, logging.WARNING),
        reraise=True,
    )
    return retrying(attempt)


def _fetch_once(rf: RemoteFile, part: Path, transfer: Transfer, headers: dict[str, str],
                on_bytes: OnBytes | None) -> Fetched:
    fd = os.open(part, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+b") as f:
        writer = _HashingWriter(f, rf, None)
        try:
            have = writer.absorb_existing()
            if rf.size is not None and have > rf.size:   # longer than the file: not a prefix of it
                writer.truncate(0)
                have = 0
            if on_bytes is not None and have:
                on_bytes(have)
            writer.on_bytes = on_bytes
            f.seek(have)
            writer.clean_to = have
            if rf.size is None or have < rf.size:
                with _IN_FLIGHT.one():
                    transfer.fetch(rf.url, writer, have, headers, rf.size)
            writer.flush()
        finally:
            digest, git = writer.finish()   # stops the hashing thread, also when the transfer failed
        size = writer.written
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
