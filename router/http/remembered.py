"""The models a router serves, kept on disk so that a restarted router answers 503, not 404.

Owns `ModelsFile`: the file (`fleet up` puts it beside the admin token in its state directory,
`router-models.json`; `python -m router --models-file PATH`) that lists the models with a pool.
A router that starts reads it (`read`) and `router.pools.pool.PoolTable` answers a request for one of
these models, until its controller has spoken for it, with 503 + Retry-After instead of 404:
OpenAI clients retry a 503 and give up on a 404, and the controller republishes every pool
within a tick or two of a router restart.

Written whenever the set of models changes (`changed`, called by `router.http.admin` after each pool
PUT or DELETE): in a background task, off the event loop (a worker thread), atomically (a
temporary file in the same directory, fsynced, renamed over the old one), so a crash mid-write
leaves the old list or the new one, never half of one. A failed write (a full disk, a read-only
directory) is logged, counted in `fleet_router_state_write_errors_total`, and retried with
backoff until it succeeds or the set changes again; serving never waits on it. An unreadable file
(missing, garbled, the wrong shape) is logged and ignored: the router then starts knowing no
model, as a router started without a models file does. Document: `{"version": 1, "models": [name, ...]}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FILE_VERSION = 1
"""`version` of the document this code writes and reads."""

RETRY_FIRST_S = 1.0
"""Seconds before a failed write is first retried; doubled after each failure up to `RETRY_MAX_S`."""
RETRY_MAX_S = 30.0
"""Longest wait (seconds) between two tries of a failing write."""


class ModelsFile:
    """The router's models file at `path`.

    `models`: returns the model names that have a pool now (`router.pools.pool.PoolTable.models`).
    `on_write_error`: called once per failed write (the metric). `retry_first_s` / `retry_max_s`:
    the retry backoff (seconds). `write`: the function that writes a document to a path
    atomically (`write_atomically`; tests inject failures here).
    """

    def __init__(self, path: Path, models: Callable[[], list[str]], *,
                 on_write_error: Callable[[], None] = lambda: None, retry_first_s: float = RETRY_FIRST_S,
                 retry_max_s: float = RETRY_MAX_S,
                 write: Callable[[Path, bytes], None] | None = None) -> None:  # fmt: skip
        self.path = Path(path)
        self._models = models
        self._on_write_error = on_write_error
        self._retry_first_s = retry_first_s
        self._retry_max_s = retry_max_s
        self._write = write or write_atomically
        self._written: list[str] | None = None   # what the file holds, as far as this process knows
        self._task: asyncio.Task[None] | None = None
        self.failures = 0   # consecutive failed writes (0 once one succeeds)

    def read(self) -> list[str]:
        """The model names the file lists; [] when it is missing, and also (logged as a warning)
        when it cannot be read or parsed or has the wrong shape. Never raises."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return []
        except OSError as err:
            log.warning("cannot read the models file %s (%s): starting with no remembered model", self.path, err)
            return []
        try:
            doc = json.loads(raw)
            models = doc["models"]
            if doc.get("version") != FILE_VERSION or not isinstance(models, list) or \
                    not all(isinstance(m, str) and m for m in models):  # fmt: skip
                raise ValueError(f"expected {{\"version\": {FILE_VERSION}, \"models\": [name, ...]}}")
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
            log.warning("the models file %s is not readable (%s): starting with no remembered model", self.path,
                        str(err)[:200])  # fmt: skip
            return []
        self._written = sorted(set(models))
        return self._written

    def changed(self) -> None:
        """The set of pools may have changed: write the file in the background if it did
        (a write under way is followed by another if needed). Call on the event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._flush())

    async def flushed(self) -> None:
        """Wait until the background write (with its retries) is over (tests, shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    async def _flush(self) -> None:
        delay_s = self._retry_first_s
        while True:
            models = sorted(set(self._models()))
            if models == self._written:
                return
            doc = json.dumps({"version": FILE_VERSION, "models": models}).encode()
            try:
                await asyncio.to_thread(self._write, self.path, doc)
            except Exception as err:  # noqa: BLE001 - OSError above all; a failed write never stops serving
                self.failures += 1
                self._on_write_error()
                if self.failures == 1:
                    log.warning("cannot write the models file %s: %s (retrying; serving is not affected)",
                                self.path, err)  # fmt: skip
                await asyncio.sleep(delay_s)
                delay_s = min(delay_s * 2, self._retry_max_s)
                continue
            if self.failures:
                log.warning("the models file %s is written again after %d failed attempt(s)", self.path,
                            self.failures)  # fmt: skip
            self.failures = 0
            self._written = models
            delay_s = self._retry_first_s


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data`: a temporary file in the same directory, written, fsynced and
    renamed over it (`os.replace`), so a reader sees the old content or the new, never a mix.
    Raises OSError (the temporary file is removed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
