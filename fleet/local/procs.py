"""Local processes that outlive the controller that started them, and know them again by identity.

Owns `ProcessRecord` (what identifies one started process: pid plus the kernel's start time of
that pid, so a reused pid is never mistaken for ours), `LocalProcesses` (start, observe, signal
and reap such processes) and `find_marked` (the processes whose environment carries a fleet's
marker, for what a crash left unrecorded). Used by the local backend (`fleet.local.backend`,
engine replicas) and by `fleet up`'s router supervisor (`fleet.local.up`). Every `subprocess` and
`os.kill` call for those processes is here.

Each process starts in a new session (its own process group, so a terminal's Ctrl-C reaches only
`fleet up`, and a stop or kill reaches the engine's workers too) and is NOT tied to the
controller's life: no ``PR_SET_PDEATHSIG``. A controller that dies leaves its engines and router
serving; the next `fleet up` on the same state directory adopts them, `fleet down` stops them.

Linux only for identity: ``/proc/PID/stat`` field 22 is the process's start time in clock ticks
since boot (proc(5)); ``/proc/PID/environ`` holds the marker. Elsewhere a process this controller
did not start is taken as gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class ProcessRecord:
    """One started process. ``start_ticks``: /proc/PID/stat field 22 at start (clock ticks
    since boot); ``started_at_unix``: wall-clock start (seconds); ``log_path``: its stdout+stderr."""

    pid: int
    start_ticks: int
    argv: tuple[str, ...]
    log_path: str | None
    started_at_unix: float

    def to_dict(self) -> dict:
        return {**asdict(self), "argv": list(self.argv)}

    @classmethod
    def from_dict(cls, d: dict) -> ProcessRecord:
        return cls(int(d["pid"]), int(d["start_ticks"]), tuple(d["argv"]), d.get("log_path"), float(d["started_at_unix"]))


def start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None when no such live process
    (zombies count as gone: they have exited)."""
    try:
        fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # After the ")" that closes the command name: field 3 (state) is fields[0], field 22 is fields[19].
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def environ_of(pid: int) -> dict[str, str]:
    """Environment of ``pid`` ({} when unreadable)."""
    try:
        raw = (PROC / str(pid) / "environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def find_marked(key: str, value: str) -> dict[int, dict[str, str]]:
    """Live processes whose environment has ``key=value``: pid -> their environment. Only group
    leaders (pid == process group id) are returned, so an engine's workers do not count twice."""
    found = {}
    try:
        pids = [int(p.name) for p in PROC.iterdir() if p.name.isdigit()]
    except OSError:
        return {}
    for pid in pids:
        try:
            if os.getpgid(pid) != pid:
                continue
        except OSError:
            continue
        env = environ_of(pid)
        if env.get(key) == value:
            found[pid] = env
    return found


class LocalProcesses:
    """Processes started here (children: exit codes known) or adopted (identity checked)."""

    def __init__(self) -> None:
        self._children: dict[int, subprocess.Popen] = {}

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path | None,
              pass_fds: tuple[int, ...] = (), relay: bool = False) -> ProcessRecord:  # fmt: skip
        """Start ``argv`` with ``env`` merged over this process's environment, in a new session,
        output appended to ``log_path``; ``relay``: through the log relay (`fleet.local.logrelay`,
        a process of its own reading a pipe: for a log on a full disk) instead of straight.
        ``pass_fds``: descriptors the process inherits under the same numbers (every other one
        is closed). Raises OSError when it cannot be started."""
        out = None
        try:
            if log_path is not None:
                log_path.parent.mkdir(parents=True, exist_ok=True)
                out = _relay_pipe(log_path) if relay else os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                                                                 0o644)  # fmt: skip
            proc = subprocess.Popen(
                argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                stdout=out if out is not None else subprocess.DEVNULL, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True, pass_fds=pass_fds,
            )  # fmt: skip
        finally:
            if out is not None:
                os.close(out)  # the child holds its own descriptor
        self._children[proc.pid] = proc
        ticks = start_ticks(proc.pid)
        return ProcessRecord(proc.pid, ticks if ticks is not None else -1, tuple(argv),
                             str(log_path) if log_path else None, time.time())  # fmt: skip

    def is_ours(self, record: ProcessRecord) -> bool:
        """The pid still runs the process of ``record`` (not a reused pid)."""
        if record.pid in self._children:
            return self._children[record.pid].poll() is None
        ticks = start_ticks(record.pid)
        return ticks is not None and ticks == record.start_ticks

    def poll(self, record: ProcessRecord) -> tuple[bool, int | None]:
        """(alive, exit code). The exit code is known for children of this process only; once a
        child's group leader is gone, what it started is killed so nothing outlives it."""
        child = self._children.get(record.pid)
        if child is not None:
            code = child.poll()
            if code is None:
                return True, None
            self._signal_group(record.pid, signal.SIGKILL)
            return False, code
        # Not a child: its exit code is the reaper's. Its group is not signalled either: the pid
        # may already be someone else's.
        return self.is_ours(record), None

    def stop(self, record: ProcessRecord) -> None:
        """SIGTERM to the process group, if the process is still ours."""
        if self.is_ours(record):
            self._signal_group(record.pid, signal.SIGTERM)

    def kill(self, record: ProcessRecord) -> None:
        """SIGKILL to the process group, if the process is still ours."""
        if self.is_ours(record):
            self._signal_group(record.pid, signal.SIGKILL)

    def release(self, record: ProcessRecord) -> None:
        """Forget an exited process (its Popen object, if a child)."""
        self._children.pop(record.pid, None)

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _relay_pipe(log_path: Path) -> int:
    """Start the log relay of ``log_path`` (its own session: it outlives this process and exits
    when its input ends) and return the write end of its input pipe. Raises OSError."""
    r, w = os.pipe()
    try:
        subprocess.Popen([sys.executable, "-m", "fleet.local.logrelay", str(log_path)], stdin=r,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                         close_fds=True)  # fmt: skip
    except OSError:
        os.close(w)
        raise
    finally:
        os.close(r)
    return w


def read_log_tail(path: Path | str | None, lines: int = 20) -> list[str]:
    """Last ``lines`` lines of a text log (decoding errors replaced); [] if there is none."""
    if path is None:
        return []
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            tail = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
    except OSError:
        return []
    return [line.rstrip() for line in tail]
