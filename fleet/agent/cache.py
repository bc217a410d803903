"""The weight cache: one content-addressed store of model files per node.

Owns `WeightCache` (``ensure`` a model, ``lookup`` whether it is warm, ``pin`` / ``unpin`` the
models running replicas use, ``entries`` / ``remove`` / ``verify`` for `fleet cache`, LRU
eviction to a byte budget), `cached_hub_dir` (a hub source's cached directory, for reading its
config offline) and the store's layout on disk. Called by `fleet cache` (`fleet.cli.agent`), the
node agent (`fleet.agent.runner`, `fleet.agent.pins`), the local backend's CACHING step
(`fleet.local.backend`, `fleet up`) and the controller (`cached_hub_dir`). Filling an entry
(the files a model lacks, fetched and committed) is `fleet.agent.cache_fill.EntryFill`'s; the
locks, records and errors are fleet/agent/cache_files.py's.

Layout under ``root`` (every write is a temporary name renamed into place)::

    blobs/<sha256>             file contents, read-only, named by their sha256
    models/<key>/              what the engine is given: the model's files as relative
                               symlinks into blobs/ (nested paths kept)
    models/<key>.json          the entry: source, pinned revision, files (path, sha256, size,
                               mtime_ns), created_s
    models/<key>.used          last use (clock seconds), for LRU
    refs/<id>.json             the revision a source string last resolved to (offline lookups)
    partial/<key>/*.part       downloads in progress; a later ensure resumes them (HTTP Range);
                               they count against the budget, and abandoned ones are the first
                               space given back
    partial/<key>/progress.json  bytes done / total, for processes waiting on the download
    pins/<key>/<holder>        one file per replica using the model: never evicted while any
    locks/<key>.lock           flock: one download per model across threads and processes
    locks/store.lock           flock: eviction and space accounting (taken after an entry's
                               lock, never before; eviction only tries entry locks)

Verification: a file is verified when fetched (sha256 where the source lists one, the hub's git
blob id for small files, the size otherwise; `fleet.agent.transfer`). Each use (``lookup``,
``ensure``) checks every blob's size and mtime against the entry (a stat per file); a blob that
changed is re-hashed, and one whose sha256 differs is deleted and fetched again. ``verify``
re-hashes everything (``fleet cache verify``).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fleet.sources import (
    HttpSource, HubSource, LocalSource, ModelPlan, ModelSource, Scheme, SourceError, parse_source,
)
from fleet.agent.cache_files import (
    CacheError, InsufficientSpace, blob_path, flock, read_json, sha256_file, stale_files, unlink_blob, write_json,
)
from fleet.agent.cache_fill import EntryFill, Progress
from fleet.agent.transfer import RetryPolicy
from fleet.agent.transports import HttpTransfer, HubTransfer, Transfer

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_cache_root() -> Path:
    """``$FLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/fleet/weights``, else ``~/.cache/fleet/weights``."""
    if os.environ.get("FLEET_CACHE_DIR"):
        return Path(os.environ["FLEET_CACHE_DIR"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "fleet" / "weights"


def cached_hub_dir(source: str, root: Path | None = None) -> Path | None:
    """The directory of the hub source ``source`` (``hf://org/name[@revision]``) in the weight
    cache at ``root`` (default `default_cache_root`), or None: not a hub source, no cache there,
    not cached, or unreadable. No network (`WeightCache.lookup`). Called by
    `fleet.controller.model_memory` (a model's config, read offline) and `fleet.controller.pools`
    (the tokenizer's directory)."""
    try:
        if ModelSource.parse(source).scheme is not Scheme.HF:
            return None
        root = root or default_cache_root()
        return WeightCache(root).lookup(source) if root.is_dir() else None
    except (OSError, ValueError):   # SourceError is a ValueError
        return None


@dataclass(frozen=True)
class CacheEntry:
    """One cached model. ``size_bytes`` counts its files (a blob shared with another model is
    counted in both); ``pinned_by``: the holders (replica ids) using it."""

    key: str
    source: str
    revision: str
    path: Path
    size_bytes: int
    files: int
    created_s: float
    last_used_s: float
    pinned_by: tuple[str, ...]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


class WeightCache:
    """A node's weight cache rooted at ``root``.

    ``budget_bytes``: the most the blobs may take (None: only the disk limits it); eviction is
    least-recently-used over unpinned models. ``clock``: seconds (LRU times). ``http_client``:
    an ``httpx.Client`` for reading http(s) manifests (one is made when None). ``reserve_bytes``: free disk
    left untouched. ``parallel_files``: files of one model fetched at once. ``disk_usage`` is
    ``shutil.disk_usage`` (tests inject a full disk).
    """

    def __init__(self, root: Path, budget_bytes: int | None = None, clock: Callable[[], float] = time.time,
                 http_client: Any = None, retry: RetryPolicy = RetryPolicy(), reserve_bytes: int = 256 << 20,
                 parallel_files: int = 4, disk_usage: Callable[[Path], Any] = shutil.disk_usage,
                 transfers: dict[str, Transfer] | None = None) -> None:
        self.root = Path(root)
        self.budget_bytes = budget_bytes
        self.clock = clock
        self.retry = retry
        self.reserve_bytes = reserve_bytes
        self.parallel_files = max(1, parallel_files)
        self._disk_usage = disk_usage
        self._http_client = http_client
        self._transfers = dict(transfers or {})
        for d in ("blobs", "models", "refs", "partial", "pins", "locks"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self._fill = EntryFill(self.root, retry, self.parallel_files, self._make_room, clock)

    # -- paths -------------------------------------------------------------------------------
    def _blob(self, sha: str) -> Path:
        return blob_path(self.root, sha)

    def _record_path(self, key: str) -> Path:
        return self.root / "models" / f"{key}.json"

    def _ref_path(self, canonical: str) -> Path:
        return self.root / "refs" / f"{hashlib.sha256(canonical.encode()).hexdigest()[:24]}.json"

    @staticmethod
    def key_for(canonical: str, revision: str) -> str:
        """The entry name of ``canonical`` at ``revision``: readable and unique,
        e.g. ``hf--org--name--3f2c9a1b0c4d-5e6f7a8b``."""
        slug = _SAFE.sub("--", canonical.split("://", 1)[-1].split("@", 1)[0]).strip("-.")[-60:]
        digest = hashlib.sha256(f"{canonical}\0{revision}".encode()).hexdigest()[:8]
        scheme = canonical.split("://", 1)[0]
        return f"{scheme}--{slug}--{_SAFE.sub('', revision)[:12]}-{digest}"

    def _transfer(self, kind: str) -> Transfer:
        if kind not in self._transfers:
            if kind == "hub":
                self._transfers[kind] = HubTransfer()
            else:
                self._transfers[kind] = HttpTransfer()
        return self._transfers[kind]

    def _client(self) -> Any:
        if self._http_client is None:
            import httpx

            self._http_client = httpx.Client(timeout=httpx.Timeout(30.0, read=60.0))
        return self._http_client

    # -- reading -----------------------------------------------------------------------------
    def _source(self, source: str, revision: str | None) -> LocalSource | HttpSource | HubSource:
        src = parse_source(source)
        if isinstance(src, HubSource) and revision and "@" not in source:
            src = HubSource(src.repo_id, revision)
        return src

    def _record(self, key: str) -> dict | None:
        return read_json(self._record_path(key))

    def lookup(self, source: str, revision: str | None = None) -> Path | None:
        """The directory of ``source`` if it is cached and its files pass the stat check, else
        None. No network: a hub branch means the commit it last resolved to. A local source is
        its directory when that exists. Not a use: LRU order changes only with ``ensure``."""
        src = self._source(source, revision)
        if isinstance(src, LocalSource):
            return src.path if src.path.is_dir() else None
        ref = read_json(self._ref_path(src.canonical))
        if not ref:
            return None
        key = self.key_for(src.identity, ref["revision"])
        record = self._record(key)
        if record is None or not (self.root / "models" / key).is_dir() or stale_files(self.root, record):
            return None
        return self.root / "models" / key

    def cached_sources(self) -> frozenset[str]:
        """The canonical sources (`fleet.sources` ``canonical``: ``hf://org/name@revision``,
        a manifest URL) whose entry is cached and passes the stat check: what this node reports as
        warm for placement (`fleet.placement.shapes.PlacementRequest.is_warm`). No network."""
        out = set()
        for ref_path in (self.root / "refs").glob("*.json"):
            ref = read_json(ref_path)
            if not ref or "source" not in ref:
                continue
            try:
                if self.lookup(ref["source"]) is not None:
                    out.add(ref["source"])
            except SourceError:
                continue
        return frozenset(out)

    def entries(self) -> list[CacheEntry]:
        """Every cached model, least recently used first."""
        out = []
        for rec_path in (self.root / "models").glob("*.json"):
            rec = read_json(rec_path)
            if not rec:
                continue
            key = rec_path.name[: -len(".json")]
            out.append(CacheEntry(
                key=key, source=rec["source"], revision=rec["revision"], path=self.root / "models" / key,
                size_bytes=sum(f["size"] for f in rec["files"]), files=len(rec["files"]),
                created_s=rec["created_s"], last_used_s=self._last_used(key, rec),
                pinned_by=self.pinned_by(key),
            ))
        return sorted(out, key=lambda e: (e.last_used_s, e.key))

    def blob_bytes(self) -> int:
        """Bytes the blobs take (what the budget counts)."""
        return sum(e.stat().st_size for e in os.scandir(self.root / "blobs") if e.is_file())

    def _last_used(self, key: str, rec: dict) -> float:
        try:
            return float((self.root / "models" / f"{key}.used").read_text())
        except (OSError, ValueError):
            return float(rec.get("created_s", 0.0))

    def _touch(self, key: str) -> None:
        write_json(self.root / "models" / f"{key}.used", self.clock())

    # -- pins --------------------------------------------------------------------------------
    def pin(self, key: str, holder: str) -> None:
        """Mark ``key`` as used by ``holder`` (a replica id): eviction and ``remove`` leave it.

        Raises KeyError when no such model is cached.
        """
        with flock(self.root / "locks" / f"{key}.lock"):
            if self._record(key) is None:
                raise KeyError(f"no cached model {key!r}")
            self._pin_locked(key, holder)

    def _pin_locked(self, key: str, holder: str) -> None:
        d = self.root / "pins" / key
        d.mkdir(parents=True, exist_ok=True)
        (d / _SAFE.sub("_", holder)).write_text(str(self.clock()))

    def unpin(self, key: str, holder: str) -> None:
        """Drop ``holder``'s pin (no error when there is none)."""
        (self.root / "pins" / key / _SAFE.sub("_", holder)).unlink(missing_ok=True)

    def pinned_at(self, key: str, holder: str) -> float:
        """When ``holder`` pinned ``key`` (the cache's clock, seconds); +inf when it has no pin."""
        try:
            return float((self.root / "pins" / key / _SAFE.sub("_", holder)).read_text())
        except (OSError, ValueError):
            return float("inf")

    def pinned_by(self, key: str) -> tuple[str, ...]:
        d = self.root / "pins" / key
        return tuple(sorted(p.name for p in d.iterdir())) if d.is_dir() else ()

    # -- caching -----------------------------------------------------------------------------
    def ensure(self, source: str, revision: str | None = None, progress: Progress | None = None,
               pin_as: str | None = None) -> Path:
        """The local directory of ``source``'s weights, fetched first when not cached. Blocking.

        Several threads or processes asking for one model cause one download: the others wait on
        its lock (``progress`` keeps reporting the download's bytes) and then use the result.
        ``revision``: the hub revision when an ``hf://`` source names none (``spec.model.revision``
        is Fleet's label and is not passed here). ``pin_as``: pin the entry for this holder before
        returning (no eviction window between ``ensure`` and ``pin``). The returned directory's
        name is the entry's key. Local sources are returned in place.

        Raises SourceError (bad source, unreachable and never cached), InsufficientSpace (disk or
        budget; names the model, the bytes needed and the path), CacheError (a file could not be
        fetched or verified after the retries).
        """
        src = self._source(source, revision)
        if isinstance(src, LocalSource):
            if not src.path.is_dir():
                raise SourceError(f"{source!r}: {src.path} is not a directory")
            return src.path
        try:
            plan = src.resolve(self._client()) if isinstance(src, HttpSource) else src.resolve()
        except SourceError:
            cached = self.lookup(source, revision)   # offline: the revision it last resolved to
            if cached is None:
                raise
            self._touch(cached.name)
            if pin_as:
                self.pin(cached.name, pin_as)
            return cached
        key = self.key_for(src.identity, plan.revision)
        waiting = self._waiter(key, plan, progress)
        with flock(self.root / "locks" / f"{key}.lock", on_wait=waiting):
            path = self._ensure_locked(src.canonical, src.identity, key, plan, progress)
            if pin_as:
                self._pin_locked(key, pin_as)
        self._enforce_budget(keep=key)
        return path

    def _waiter(self, key: str, plan: ModelPlan, progress: Progress | None) -> Callable[[], None] | None:
        if progress is None:
            return None
        path = self.root / "partial" / key / "progress.json"

        def report() -> None:
            doc = read_json(path)
            if doc:
                progress(int(doc["done"]), int(doc["total"]))
        return report

    def _ensure_locked(self, canonical: str, identity: str, key: str, plan: ModelPlan,
                       progress: Progress | None) -> Path:
        model_dir = self.root / "models" / key
        record = self._record(key)
        known: dict[str, str] = {}
        if record is not None and model_dir.is_dir():
            if self._fill.repair(record):
                write_json(self._record_path(key), record)
            known = {f["path"]: f["sha256"] for f in record["files"]}
            if not stale_files(self.root, record):
                self._finish(canonical, key, plan)
                if progress:
                    progress(plan.total_bytes, plan.total_bytes)
                return model_dir
        for _ in range(3):   # a blob evicted by another process meanwhile is fetched on the next pass
            fetched = self._fill.fetch_missing(key, plan, self._transfer(plan.transfer), progress, known)
            if all(self._blob(sha).is_file() for sha in fetched.values()):
                break
        else:
            raise CacheError(f"{canonical}: blobs kept disappearing while caching it (eviction race)")
        self._fill.commit(identity, key, plan, fetched)
        self._finish(canonical, key, plan)
        return model_dir

    def _finish(self, canonical: str, key: str, plan: ModelPlan) -> None:
        write_json(self._ref_path(canonical), {"source": canonical, "revision": plan.revision})
        self._touch(key)
        shutil.rmtree(self.root / "partial" / key, ignore_errors=True)

    # -- space -------------------------------------------------------------------------------
    def _make_room(self, plan: ModelPlan, key: str, need: int) -> None:
        """Evict LRU unpinned models until ``need`` more bytes fit the budget and the disk.

        Raises InsufficientSpace naming the model, the bytes and the path."""
        with flock(self.root / "locks" / "store.lock"):
            while True:
                used = self.blob_bytes() + self._partial_bytes(exclude=key)
                free = self._disk_usage(self.root).free
                over_budget = self.budget_bytes is not None and used + need > self.budget_bytes
                over_disk = need + self.reserve_bytes > free
                if not (over_budget or over_disk):
                    return
                if not (self._drop_abandoned_partial(keep=key) or self._evict_one(keep=key)):
                    break
        if over_disk:
            raise InsufficientSpace(
                f"cannot cache {plan.source} (revision {plan.revision}): {human_bytes(need)} to fetch, "
                f"{human_bytes(free)} free on the disk of {self.root} (keeping {human_bytes(self.reserve_bytes)} "
                "free), and no unpinned model left to evict")
        raise InsufficientSpace(
            f"cannot cache {plan.source} (revision {plan.revision}): {human_bytes(need)} to fetch, cache "
            f"{self.root} holds {human_bytes(used)} of its {human_bytes(self.budget_bytes or 0)} budget, "
            "and no unpinned model left to evict")

    def _partial_bytes(self, exclude: str) -> int:
        """Bytes of downloads in progress or abandoned, other than ``exclude``'s."""
        total = 0
        for d in (self.root / "partial").iterdir():
            if d.is_dir() and d.name != exclude:
                total += sum(p.stat().st_size for p in d.glob("*.part"))
        return total

    def _drop_abandoned_partial(self, keep: str) -> bool:
        """Delete the part files of one download nobody is running (a crashed process's, or a
        model never asked for again): the first space to give back. Store lock held."""
        for d in sorted((self.root / "partial").iterdir()):
            if not d.is_dir() or d.name == keep or not any(d.glob("*.part")):
                continue
            fd = os.open(self.root / "locks" / f"{d.name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue   # being downloaded right now
                shutil.rmtree(d, ignore_errors=True)
                return True
            finally:
                os.close(fd)
        return False

    def _enforce_budget(self, keep: str | None = None) -> None:
        if self.budget_bytes is None:
            return
        with flock(self.root / "locks" / "store.lock"):
            while self.blob_bytes() > self.budget_bytes and self._evict_one(keep=keep):
                pass

    def _evict_one(self, keep: str | None) -> bool:
        """Remove the least recently used unpinned model that is not being fetched (store lock held)."""
        for entry in self.entries():
            if entry.key == keep or entry.pinned_by:
                continue
            if self._remove_if_free(entry.key):
                return True
        return False

    def _remove_if_free(self, key: str) -> bool:
        fd = os.open(self.root / "locks" / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False   # being fetched or pinned right now
            if self.pinned_by(key):
                return False
            self._drop_entry(key)
            return True
        finally:
            os.close(fd)

    def _drop_entry(self, key: str) -> None:
        rec = self._record(key) or {"files": []}
        self._record_path(key).unlink(missing_ok=True)
        shutil.rmtree(self.root / "models" / key, ignore_errors=True)
        (self.root / "models" / f"{key}.used").unlink(missing_ok=True)
        shutil.rmtree(self.root / "partial" / key, ignore_errors=True)
        still = self._referenced_blobs()
        for f in rec["files"]:
            if f["sha256"] not in still:
                unlink_blob(self._blob(f["sha256"]))

    def _referenced_blobs(self) -> set[str]:
        out = set()
        for rec_path in (self.root / "models").glob("*.json"):
            rec = read_json(rec_path)
            out.update(f["sha256"] for f in (rec or {}).get("files", []))
        return out

    def remove(self, key: str, force: bool = False) -> int:
        """Delete a cached model (blobs other models share stay); returns the bytes freed.

        Raises KeyError (no such model), CacheError (pinned by a replica, unless ``force``).
        """
        # Lock order everywhere: the entry's lock, then the store's (ensure holds its entry's
        # lock when it makes room under the store's).
        with flock(self.root / "locks" / f"{key}.lock"), flock(self.root / "locks" / "store.lock"):
            if self._record(key) is None:
                raise KeyError(f"no cached model {key!r}")
            holders = self.pinned_by(key)
            if holders and not force:
                raise CacheError(f"{key} is in use by {', '.join(holders)}; drain those replicas first (or --force)")
            before = self.blob_bytes()
            self._drop_entry(key)
            shutil.rmtree(self.root / "pins" / key, ignore_errors=True)
            return before - self.blob_bytes()

    def verify(self, key: str) -> list[str]:
        """Re-hash every file of ``key``; delete blobs whose content is wrong (the next ``ensure``
        fetches them again). Returns the paths found corrupt. Raises KeyError."""
        with flock(self.root / "locks" / f"{key}.lock"):
            rec = self._record(key)
            if rec is None:
                raise KeyError(f"no cached model {key!r}")
            bad = []
            for f in rec["files"]:
                blob = self._blob(f["sha256"])
                if not blob.is_file() or sha256_file(blob) != f["sha256"]:
                    bad.append(f["path"])
                    unlink_blob(blob)
            return bad

