"""Writes of `fleet up`'s control plane that fail soft: its output, its log and its records.

Owns `WriteErrors` (per write target: how many writes failed, the last error, and the backoff
before the next try; exported as ``fleet_control_write_errors_total{target}`` and in the state
snapshot for `fleet status`) and `FailSoftStream` (stands in for ``sys.stdout`` / ``sys.stderr``
while `fleet up` runs: a write that fails, a full disk (``ENOSPC``) or a pipe whose reader has gone
(``EPIPE``), is dropped and counted instead of raised; a copy of every line can go to
``logs/fleet-up.log`` so `fleet logs controller` works with `fleet up` in the foreground too).

Why: a control plane that cannot write its output or state must not take the data plane down
with it (docs/crash-safety.md, "When the control plane cannot write"). Only `fleet down` or Ctrl-C
drains. Used by `fleet.local.state`, `fleet.local.backend`, `fleet.local.routerproc`,
`fleet.local.control` and `fleet.local.up`.

Retry: a target that failed is tried again after a backoff that doubles from ``base_s`` up to
``max_s`` (1 s to 60 s by default); writes in between are dropped (output lines) or left to the
next try (a state snapshot is written whole at the next one). Not tenacity: nothing here may wait,
the next write is the retry.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily

log = logging.getLogger("fleet.local.failsoft")

WRITE_ERRORS = (OSError, ValueError)
"""What a failed write raises: OSError (ENOSPC, EPIPE, EIO, EACCES...), ValueError (a closed file)."""

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@dataclass
class TargetState:
    """One write target. ``errors``: writes that failed (a counter); ``dropped``: writes skipped
    while backing off; ``retry_at_s``: no try before (monotonic seconds); ``delay_s``: the current
    backoff (0: healthy)."""

    errors: int = 0
    dropped: int = 0
    last_error: str | None = None
    last_error_at_unix: float | None = None
    retry_at_s: float = 0.0
    delay_s: float = 0.0

    @property
    def failing(self) -> bool:
        return self.delay_s > 0


class WriteErrors:
    """Failed writes per target (``stdout``, ``log``, ``state``, ``replicas``, ``router_json``,
    ``admin_token``, ``events``, ``control``, ``observability``...) with a backoff each.

    ``clock``: monotonic seconds (backoff); ``wall``: Unix seconds (when the last error was, for
    people). Thread-safe (the node agent's thread and the event loop share one)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time,
                 base_s: float = 1.0, max_s: float = 60.0) -> None:  # fmt: skip
        self.clock = clock
        self.wall = wall
        self.base_s = base_s
        self.max_s = max_s
        self._targets: dict[str, TargetState] = {}
        self._lock = threading.Lock()
        self._quiet = threading.local()   # set while a stream reports its own failure (no log loop)

    def state(self, target: str) -> TargetState:
        with self._lock:
            return self._targets.setdefault(target, TargetState())

    def due(self, target: str) -> bool:
        """Whether a write to ``target`` should be tried now (not backing off)."""
        return self.clock() >= self.state(target).retry_at_s

    def failed(self, target: str, err: BaseException, *, quiet: bool = False) -> None:
        """Count a failed write of ``target`` and back off. Logged (a warning) unless ``quiet``:
        the output streams report their own failures only here, since logging writes to them."""
        with self._lock:
            t = self._targets.setdefault(target, TargetState())
            t.errors += 1
            t.last_error = _describe(err)
            t.last_error_at_unix = self.wall()
            t.delay_s = min(max(self.base_s, 2 * t.delay_s), self.max_s)
            t.retry_at_s = self.clock() + t.delay_s
            delay_s = t.delay_s
        if not quiet and not getattr(self._quiet, "on", False):
            log.warning("cannot write %s: %s (next try in %.0f s; the fleet keeps serving)", target,
                        _describe(err), delay_s)  # fmt: skip

    def ok(self, target: str) -> None:
        """A write of ``target`` succeeded: the backoff ends."""
        with self._lock:
            t = self._targets.get(target)
            if t is None or not t.failing:
                return
            t.delay_s, t.retry_at_s = 0.0, 0.0
        if not getattr(self._quiet, "on", False):
            log.warning("writing %s works again", target)

    def dropped(self, target: str) -> None:
        with self._lock:
            self._targets.setdefault(target, TargetState()).dropped += 1

    def attempt(self, target: str, write: Callable[[], object], *, force: bool = False) -> bool:
        """Run ``write`` unless ``target`` is backing off (``force``: try anyway). True when it
        ran and succeeded; a failure (`WRITE_ERRORS`) is counted, never raised."""
        if not force and not self.due(target):
            self.dropped(target)
            return False
        try:
            write()
        except WRITE_ERRORS as err:
            self.failed(target, err)
            return False
        self.ok(target)
        return True

    def snapshot(self) -> dict[str, dict]:
        """JSON-ready: target -> {errors, dropped, last_error, last_error_at_unix, failing}; only
        targets that ever failed (for the state file and `fleet status`)."""
        with self._lock:
            return {name: {"errors": t.errors, "dropped": t.dropped, "last_error": t.last_error,
                           "last_error_at_unix": t.last_error_at_unix, "failing": t.failing}
                    for name, t in sorted(self._targets.items()) if t.errors}  # fmt: skip

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Prometheus collector: ``fleet_control_write_errors_total{target}``."""
        family = CounterMetricFamily("fleet_control_write_errors", "Writes of fleet up's control plane that failed "
                                     "(output, log, state and record files), by target.", labels=["target"])  # fmt: skip
        with self._lock:
            for name, t in sorted(self._targets.items()):
                family.add_metric([name], t.errors)
        yield family

    def describe(self) -> list:
        return []   # unchecked collector: no samples at registration time


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        return f"[Errno {err.errno}] {os.strerror(err.errno)} ({errno.errorcode.get(err.errno, '?')})"
    return f"{type(err).__name__}: {err}"


class FailSoftStream:
    """A text stream over file descriptor ``fd`` whose writes never raise: a failed write is
    counted under ``target`` in ``errors`` and dropped, and the next write is tried after the
    target's backoff. Bytes go to the descriptor with `os.write` (no buffer to flush at exit, so
    a pipe whose reader died cannot fail the interpreter's exit either).

    ``tee``: a file that gets a copy of every write with terminal colour codes removed (the
    controller log of a foreground `fleet up`), counted under ``tee_target``."""

    def __init__(self, fd: int, target: str, errors: WriteErrors, *, tee: Path | None = None,
                 tee_target: str = "log", encoding: str = "utf-8") -> None:  # fmt: skip
        self.fd = fd
        self.target = target
        self.errors = errors
        self.tee = tee
        self.tee_target = tee_target
        self.encoding = encoding
        self.errors_mode = "replace"
        self._tee_fd: int | None = None
        self._isatty = _isatty(fd)

    # ----- the text stream protocol (what print, rich and logging use) -------------------------

    def write(self, text: str) -> int:
        if not text:
            return 0
        data = text.encode(self.encoding, "replace")
        self._write(self.fd, self.target, data)
        if self.tee is not None:
            plain = _ANSI.sub("", text).encode(self.encoding, "replace") if self._isatty else data
            self._write_tee(plain)
        return len(text)

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        return None   # unbuffered

    def isatty(self) -> bool:
        return self._isatty

    def fileno(self) -> int:
        return self.fd

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False

    def close(self) -> None:
        if self._tee_fd is not None:
            try:
                os.close(self._tee_fd)
            except OSError:
                pass
            self._tee_fd = None

    # ----- internals -----------------------------------------------------------------------

    def _write(self, fd: int, target: str, data: bytes) -> None:
        if not self.errors.due(target):
            self.errors.dropped(target)
            return
        try:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except WRITE_ERRORS as err:
            self._report(target, err)
            return
        self._quietly(self.errors.ok, target)

    def _write_tee(self, data: bytes) -> None:
        if self._tee_fd is None:
            if not self.errors.due(self.tee_target):
                self.errors.dropped(self.tee_target)
                return
            try:
                self.tee.parent.mkdir(parents=True, exist_ok=True)
                self._tee_fd = os.open(self.tee, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            except OSError as err:
                self._report(self.tee_target, err)
                return
        self._write(self._tee_fd, self.tee_target, data)

    def _report(self, target: str, err: BaseException) -> None:
        self._quietly(self.errors.failed, target, err, quiet=True)

    def _quietly(self, fn, *args, **kw) -> None:
        self.errors._quiet.on = True
        try:
            fn(*args, **kw)
        finally:
            self.errors._quiet.on = False


LOG_ROOM_BYTES = 1 << 20
"""Free space a new process's log needs at its start (see `log_target`)."""


def log_target(path: Path, errors: WriteErrors, target: str) -> tuple[Path, bool]:
    """Where a new process's output goes: ``(path, False)`` when its file system has
    `LOG_ROOM_BYTES` free; else ``(path, True)``: through the log relay
    (`fleet.local.logrelay`), counted under ``target``. A process writing its log straight to a
    full disk would die on its first line (Python's print raises ENOSPC); through the relay it
    serves, its output is dropped while the disk is full and written again once it has room."""
    try:
        st = os.statvfs(path.parent)
    except OSError:
        return path, False
    if st.f_bavail * st.f_frsize >= LOG_ROOM_BYTES:
        errors.ok(target)
        return path, False
    errors.failed(target, OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)}: {path} (output through the log "
                                                f"relay until the disk has room)"))  # fmt: skip
    return path, True


def _isatty(fd: int) -> bool:
    try:
        return os.isatty(fd)
    except OSError:
        return False


def same_file(fd: int, path: Path) -> bool:
    """Whether descriptor ``fd`` is the file at ``path`` (`fleet up --detach` writes its output
    to the controller log itself: no copy is needed)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
