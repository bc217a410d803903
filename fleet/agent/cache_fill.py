"""Filling one entry of the weight cache: the files a model lacks, fetched into the store.

Owns `EntryFill` (``repair`` an entry's blobs whose stat changed, ``fetch_missing`` the files of
a `ModelPlan` the store lacks, several at once, each made durable and renamed into ``blobs/``,
``commit`` the entry's symlink directory and record) and `ProgressMeter` (bytes done across the
file threads, mirrored into ``partial/<key>/progress.json``). Called by
`fleet.agent.cache.WeightCache.ensure` with the model's lock held; one file's transfer is
`fleet.agent.transfer.fetch_file`'s.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from fleet.agent.cache_files import CacheError, blob_path, sha256_file, stale_files, unlink_blob, write_json
from fleet.agent.transfer import RetryPolicy, fetch_file
from fleet.agent.transports import Transfer
from fleet.sources import ModelPlan, RemoteFile

Progress = Callable[[int, int], None]
"""``progress(done_bytes, total_bytes)``: called while a model is being cached."""


class EntryFill:
    """Fills entries of the store at ``root``.

    ``retry``: each file's attempts and backoff (`fleet.agent.transfer.RetryPolicy`).
    ``parallel_files``: files of one model fetched at once. ``make_room(plan, key, need_bytes)``:
    evicts until ``need_bytes`` more fit (`WeightCache`'s space accounting; raises
    InsufficientSpace). ``clock``: seconds, the entry's ``created_s``.
    """

    def __init__(self, root: Path, retry: RetryPolicy, parallel_files: int,
                 make_room: Callable[[ModelPlan, str, int], None], clock: Callable[[], float]) -> None:
        self.root = root
        self.retry = retry
        self.parallel_files = max(1, parallel_files)
        self.make_room = make_room
        self.clock = clock

    def repair(self, record: dict) -> bool:
        """Re-hash blobs whose stat changed; delete those whose content changed too. Returns
        whether ``record`` was updated (a blob touched but unchanged gets its new mtime)."""
        updated = False
        for f in stale_files(self.root, record):
            blob = blob_path(self.root, f["sha256"])
            if not blob.is_file():
                continue
            if sha256_file(blob) == f["sha256"]:
                f["mtime_ns"] = blob.stat().st_mtime_ns
                updated = True
            else:
                unlink_blob(blob)
        return updated

    def present(self, rf: RemoteFile, known: dict[str, str]) -> str | None:
        """The sha256 of ``rf`` when its blob is already in the store: by the digest the source
        lists, or (size-only files) by the digest this entry recorded when it was verified."""
        sha = rf.sha256 or known.get(rf.path)
        if not sha:
            return None
        try:
            size = blob_path(self.root, sha).stat().st_size
        except OSError:
            return None
        return sha if rf.size is None or size == rf.size else None

    def fetch_missing(self, key: str, plan: ModelPlan, transfer: Transfer, progress: Progress | None,
                      known: dict[str, str]) -> dict[str, str]:
        """Fetch every file of ``plan`` not in the store through ``transfer``, after making room
        for them (``make_room``); returns {path: sha256}. Raises CacheError (the first file that
        could not be fetched or verified; the others fetched are in the store) or what
        ``make_room`` raises."""
        partial = self.root / "partial" / key
        partial.mkdir(parents=True, exist_ok=True)
        done: dict[str, str] = {}
        missing: list[RemoteFile] = []
        for rf in plan.files:
            sha = self.present(rf, known)
            if sha:
                done[rf.path] = sha
            else:
                missing.append(rf)
        present_bytes = sum(rf.size or 0 for rf in plan.files if rf.path in done)
        parts = {rf.path: partial / f"{hashlib.sha256(rf.path.encode()).hexdigest()[:24]}.part" for rf in missing}
        in_parts = sum(p.stat().st_size for p in parts.values() if p.is_file())
        need = sum(rf.size or 0 for rf in missing) - in_parts
        self.make_room(plan, key, max(need, 0))
        meter = ProgressMeter(present_bytes, plan.total_bytes, progress, partial / "progress.json")

        def one(rf: RemoteFile) -> tuple[str, str]:
            try:
                got = fetch_file(rf, parts[rf.path], transfer, plan.headers, meter.add, self.retry)
            except Exception as err:
                raise CacheError(f"{plan.source}: {rf.path}: {err}") from err
            return rf.path, got.sha256

        fetched: dict[str, str] = {}
        errors: list[CacheError] = []
        try:
            with ThreadPoolExecutor(min(self.parallel_files, max(1, len(missing))),
                                    thread_name_prefix="fleet-cache") as pool:
                futures = [pool.submit(one, rf) for rf in sorted(missing, key=lambda r: -(r.size or 0))]
                for fut in futures:
                    try:
                        path, sha = fut.result()
                        fetched[path] = sha
                    except CacheError as err:
                        errors.append(err)
        finally:
            meter.close()
        # Made durable once all are fetched (the kernel has been writing them back meanwhile, as
        # for any download), then renamed into the store: a blob is never a torn file.
        for path, sha in fetched.items():
            part, blob = parts[path], blob_path(self.root, sha)
            if blob.is_file():
                part.unlink(missing_ok=True)
                continue
            fd = os.open(part, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            os.chmod(part, 0o444)
            os.replace(part, blob)
        if errors:   # the files that were fetched are in the store: the next attempt skips them
            raise errors[0]
        done.update(fetched)
        return done

    def commit(self, identity: str, key: str, plan: ModelPlan, shas: dict[str, str]) -> None:
        """Write the symlink directory and the entry record (renamed into place: a crash leaves
        either the old entry or the new one)."""
        models = self.root / "models"
        for stale in models.glob(f".{key}.*.tmp"):   # left by a process that crashed here (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = models / f".{key}.{os.getpid()}.{threading.get_ident()}.tmp"
        files = []
        for rf in plan.files:
            sha = shas[rf.path]
            link = tmp / rf.path
            link.parent.mkdir(parents=True, exist_ok=True)
            blob = blob_path(self.root, sha)
            os.symlink(os.path.relpath(blob, start=(models / key / rf.path).parent), link)
            st = blob.stat()
            files.append({"path": rf.path, "sha256": sha, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
        final = models / key
        (models / f"{key}.json").unlink(missing_ok=True)   # not usable while it is rebuilt
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_json((models / f"{key}.json"), {
            "source": identity, "revision": plan.revision, "files": files, "created_s": self.clock()})


class ProgressMeter:
    """Bytes done / total of one model across its file threads, mirrored every 0.25 s into
    progress.json (by a daemon thread, until ``close``) for processes waiting on the download."""

    def __init__(self, done: int, total: int, progress: Progress | None, path: Path) -> None:
        self.done, self.total = done, total
        self.progress, self.path = progress, path
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self._write()
        self.thread = threading.Thread(target=self._mirror, name="fleet-cache-progress", daemon=True)
        self.thread.start()
        self.add(0)

    def add(self, n: int) -> None:
        with self.lock:
            self.done += n
            if self.progress is not None:
                self.progress(self.done, self.total)

    def _write(self) -> None:
        try:
            write_json(self.path, {"done": self.done, "total": self.total})
        except OSError:
            pass   # the directory is gone: the download finished or was evicted

    def _mirror(self) -> None:
        while not self.closed.wait(0.25):
            self._write()

    def close(self) -> None:
        self.closed.set()
        self.thread.join()
        self._write()
