"""The weight cache's errors and files on disk: locks, JSON records, blobs.

Owns `CacheError` and `InsufficientSpace` (what `fleet cache` and the local backend's CACHING
step catch), and the primitives every part of the cache uses on the store's layout
(fleet/agent/cache.py's docstring draws it): `flock` (the per-model and store locks),
`write_json` / `read_json` (entries, refs, progress; every write a temporary name renamed into
place), `blob_path`, `stale_files` (the stat check of an entry's blobs), `sha256_file` and
`unlink_blob`. Called by `fleet.agent.cache.WeightCache`, `fleet.agent.cache_fill.EntryFill`,
`fleet.cli.agent` and `fleet.local.backend` (the errors).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from fleet.agent.transfer import CHUNK_BYTES


class CacheError(RuntimeError):
    """A model that cannot be cached; the message names the model (and the path or size)."""


class InsufficientSpace(CacheError):
    """Not enough free disk, or not enough byte budget after evicting every unpinned model."""


@contextmanager
def flock(path: Path, on_wait: Callable[[], None] | None = None, poll_s: float = 0.2) -> Iterator[None]:
    """Exclusive flock on ``path`` (released when the holder exits, even by a crash).

    Each call opens its own file description, so threads of one process exclude each other too.
    While waiting, ``on_wait()`` runs every ``poll_s`` seconds.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if on_wait is not None:
                    on_wait()
                time.sleep(poll_s)
        yield
    finally:
        os.close(fd)


def write_json(path: Path, doc: Any) -> None:
    """Write ``doc`` as JSON to ``path`` through a temporary name renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """The JSON document at ``path``; None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def blob_path(root: Path, sha: str) -> Path:
    """Where the blob of sha256 ``sha`` (hex) lives in the store at ``root``."""
    return root / "blobs" / sha


def stale_files(root: Path, record: dict) -> list[dict]:
    """The files of entry ``record`` whose blob is missing or whose size / mtime differ from the
    record (a stat each)."""
    stale = []
    for f in record["files"]:
        try:
            st = blob_path(root, f["sha256"]).stat()
        except OSError:
            stale.append(f)
            continue
        if st.st_size != f["size"] or st.st_mtime_ns != f["mtime_ns"]:
            stale.append(f)
    return stale


def sha256_file(path: Path) -> str:
    """The sha256 (hex) of the file at ``path``."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES * 4):
            h.update(chunk)
    return h.hexdigest()


def unlink_blob(blob: Path) -> None:
    """Delete ``blob``; no error when it is already gone."""
    try:
        blob.unlink()
    except FileNotFoundError:
        pass
