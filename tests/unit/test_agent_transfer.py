"""fleet.agent.transfer's receive/write/hash path, without a server: when a fetching thread hashes
inline, that the bytes are hashed in order across the switch, the page-cache write size, and the
buffer pool. The transfer against a real HTTP server is tests/unit/test_agent_cache.py's."""

from __future__ import annotations

import hashlib
import io
import os
import sys
import threading
from pathlib import Path

import pytest

from fleet.agent import transfer
from fleet.sources import RemoteFile
from fleet.agent.transfer import (
    CHUNK_BYTES, WRITE_BYTES, RetryPolicy, _BufferPool, _Hasher, _HashingWriter, fetch_file, hash_inline,
)
from fleet.agent.transports import VerificationError

FAST = RetryPolicy(attempts=2, initial_s=0.0, max_s=0.0)


def _data(n: int, seed: int = 0) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * 2048   # 64 KiB
    return (block * (n // len(block) + 1))[:n]


def _rf(data: bytes, sha: bool = True) -> RemoteFile:
    return RemoteFile("model.safetensors", "http://unused/model.safetensors", len(data),
                      hashlib.sha256(data).hexdigest() if sha else None)


class BytesTransfer:
    """A transport that serves ``data`` from ``resume_size`` through ``out.fill`` in reads of at
    most ``read_bytes`` (as http.client's ``readinto`` returns what the socket holds)."""

    def __init__(self, data: bytes, read_bytes: int = 300_000) -> None:
        self.data = data
        self.read_bytes = read_bytes
        self.inline_seen: set[bool] = set()

    def fetch(self, url, out, resume_size, headers, expected_size) -> None:
        src = io.BytesIO(self.data[resume_size:])

        def readinto(mv: memoryview) -> int:
            self.inline_seen.add(transfer._IN_FLIGHT.hash_inline())
            return src.readinto(mv[:self.read_bytes])
        while out.fill(readinto):
            pass


def test_a_fetching_thread_hashes_inline_only_when_the_fetches_fill_the_cpus():
    assert not hash_inline(fetching=1, cpus=2)    # one file on two cores: a hashing thread has a core
    assert hash_inline(fetching=2, cpus=2)
    assert hash_inline(fetching=4, cpus=2)
    assert hash_inline(fetching=1, cpus=1)
    assert not hash_inline(fetching=4, cpus=64)
    assert hash_inline(fetching=1, cpus=0)        # an unknown CPU count counts as one


class GatedHasher(_Hasher):
    """A `_Hasher` whose hashing thread waits for ``gate`` before hashing anything, so that items
    stay queued while the caller switches to hashing inline."""

    def __init__(self, rf: RemoteFile, inline) -> None:
        self.gate = threading.Event()
        super().__init__(rf, inline)

    def _hash(self, data) -> None:
        if threading.current_thread() is self.thread:
            self.gate.wait(timeout=30)
        super()._hash(data)


def test_switching_to_inline_hashing_keeps_the_bytes_in_order():
    chunks = [_data(CHUNK_BYTES, seed=i) for i in range(4)]
    inline = {"now": False}
    h = GatedHasher(_rf(b"".join(chunks)), lambda: inline["now"])
    buf = h.buffer()
    buf[:] = chunks[0]
    h.update_buffer(buf, len(chunks[0]))   # queued: the hashing thread holds it at the gate
    inline["now"] = True
    h.update(chunks[1])                    # must queue behind it, not be hashed first
    assert h.pending == 2
    h.gate.set()
    h.update(chunks[2])                    # once the queue has drained this may go inline...
    h.update(chunks[3])
    digest, _ = h.hexdigests()
    assert digest == hashlib.sha256(b"".join(chunks)).hexdigest()


def test_inline_hashing_runs_on_the_calling_thread():
    data = _data(3 * CHUNK_BYTES)
    h = _Hasher(_rf(data), lambda: True)
    h.update(data)
    assert h.pending == 0 and h.sha256.hexdigest() == hashlib.sha256(data).hexdigest()
    h.hexdigests()


class RecordingFile(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.write_sizes: list[int] = []

    def write(self, b) -> int:
        self.write_sizes.append(len(memoryview(b)))
        return super().write(b)


def test_the_page_cache_is_written_in_pieces_of_at_most_write_bytes():
    data = _data(CHUNK_BYTES * 2 + 12345)
    f = RecordingFile()
    w = _HashingWriter(f, _rf(data), None)
    try:
        BytesTransfer(data, read_bytes=CHUNK_BYTES).fetch("", w, 0, {}, None)
        w.write(data[:3 * WRITE_BYTES + 7])   # what huggingface_hub's http_get hands over (10 MiB pieces)
    finally:
        digest, _ = w.finish()
    assert max(f.write_sizes) == WRITE_BYTES
    assert f.getvalue() == data + data[:3 * WRITE_BYTES + 7]
    assert digest == hashlib.sha256(data + data[:3 * WRITE_BYTES + 7]).hexdigest()


@pytest.mark.parametrize("cpus", [1, 1000], ids=["inline", "hashing-thread"])
def test_fetch_file_verifies_with_either_way_of_hashing(tmp_path: Path, monkeypatch, cpus):
    monkeypatch.setattr(transfer._IN_FLIGHT, "cpus", cpus)
    data = _data(5 * CHUNK_BYTES + 999, seed=7)
    t = BytesTransfer(data)
    got = fetch_file(_rf(data), tmp_path / "m.part", t, retry=FAST)
    assert t.inline_seen == {cpus == 1}
    assert got.sha256 == hashlib.sha256(data).hexdigest() and got.size == len(data)
    assert (tmp_path / "m.part").read_bytes() == data
    assert transfer._IN_FLIGHT.n == 0


def test_a_resumed_file_is_hashed_from_its_part_then_the_rest(tmp_path: Path):
    data = _data(3 * CHUNK_BYTES + 5, seed=3)
    part = tmp_path / "m.part"
    part.write_bytes(data[:CHUNK_BYTES + 77])
    done: list[int] = []
    got = fetch_file(_rf(data), part, BytesTransfer(data), on_bytes=done.append, retry=FAST)
    assert got.sha256 == hashlib.sha256(data).hexdigest()
    assert sum(done) == len(data) and done[0] == CHUNK_BYTES + 77


def test_a_wrong_digest_deletes_the_part_file(tmp_path: Path):
    data = _data(2 * CHUNK_BYTES, seed=4)
    rf = RemoteFile("m", "http://unused/m", len(data), hashlib.sha256(b"other").hexdigest())
    with pytest.raises(VerificationError, match="sha256"):
        fetch_file(rf, tmp_path / "m.part", BytesTransfer(data), retry=FAST)
    assert not (tmp_path / "m.part").exists()


def test_the_buffer_pool_reuses_buffers_and_keeps_a_bounded_number():
    pool = _BufferPool(keep=2)
    bufs = [pool.take() for _ in range(3)]
    assert all(len(b) == CHUNK_BYTES for b in bufs)
    for b in bufs:
        pool.give(b)
    assert len(pool.idle) == 2
    again = pool.take()
    assert any(again is b for b in bufs)


def test_a_file_s_buffers_go_back_to_the_pool(tmp_path: Path, monkeypatch):
    pool = _BufferPool(keep=16)
    monkeypatch.setattr(transfer, "_BUFFERS", pool)
    data = _data(4 * CHUNK_BYTES)
    fetch_file(_rf(data), tmp_path / "a.part", BytesTransfer(data, read_bytes=CHUNK_BYTES), retry=FAST)
    kept = {id(b) for b in pool.idle}
    assert kept
    taken: list[int] = []
    take = pool.take
    monkeypatch.setattr(pool, "take", lambda: taken.append(id(b := take())) or b)
    fetch_file(_rf(data), tmp_path / "b.part", BytesTransfer(data, read_bytes=CHUNK_BYTES), retry=FAST)
    assert taken and taken[0] in kept                          # the second file reused the first's
    assert {id(b) for b in pool.idle} == kept | set(taken)     # and gave back all it took
    assert os.path.getsize(tmp_path / "b.part") == len(data)


class RecordingWriteback:
    def __init__(self) -> None:
        self.ranges: list[tuple[int, int]] = []

    def start(self, fd: int, offset: int, nbytes: int) -> None:
        self.ranges.append((offset, nbytes))


def test_writeback_is_started_every_writeback_bytes_over_contiguous_ranges(tmp_path: Path, monkeypatch):
    wb = RecordingWriteback()
    monkeypatch.setattr(transfer, "_WRITEBACK", wb)
    monkeypatch.setattr(transfer, "WRITEBACK_BYTES", 2 * CHUNK_BYTES)
    data = _data(7 * CHUNK_BYTES + 5, seed=9)
    part = tmp_path / "m.part"
    part.write_bytes(data[:CHUNK_BYTES])          # resumed: the first MiB is already on disk
    fetch_file(_rf(data), part, BytesTransfer(data, read_bytes=CHUNK_BYTES), retry=FAST)
    assert wb.ranges[0][0] == CHUNK_BYTES       # starts where this attempt started writing
    for (off, n), (next_off, _) in zip(wb.ranges, wb.ranges[1:]):
        assert next_off == off + n and n >= 2 * CHUNK_BYTES
    assert wb.ranges[-1][0] + wb.ranges[-1][1] > len(data) - 2 * CHUNK_BYTES
    assert part.read_bytes() == data


def test_writeback_of_a_real_file_range_returns_without_error(tmp_path: Path):
    p = tmp_path / "f"
    p.write_bytes(b"x" * 100_000)
    wb = transfer._Writeback()
    if sys.platform.startswith("linux"):
        assert wb._call is not None                  # glibc and musl both have sync_file_range
    fd = os.open(p, os.O_RDWR)
    try:
        wb.start(fd, 0, 100_000)   # sync_file_range where libc has it, else nothing
        os.fsync(fd)
    finally:
        os.close(fd)
    assert p.read_bytes() == b"x" * 100_000
