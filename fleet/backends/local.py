"""Local backend: each replica is a child process of `fleet up` on this machine.

Owns process launch, port allocation, per-replica log files, and stopping whole process trees.
Every call into `subprocess`/`os.kill` for replicas is here, so tests can fake this class.

Each replica starts in a new session (its own process group, so a terminal's Ctrl-C reaches only
`fleet up`, which then drains in order) with ``PR_SET_PDEATHSIG`` = SIGTERM, so the engine
is told to exit even if `fleet up` itself is killed. `stop` and `kill` signal the whole
process group: vLLM starts its EngineCore and workers as child processes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
from collections import deque
from pathlib import Path

from fleet.backends.base import LaunchError, LaunchSpec, ProcessHandle

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the process-group kill at shutdown still applies


class LocalBackend:
    """Child processes on this machine, one process group per replica."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._procs: dict[int, subprocess.Popen] = {}
        self._reserved_ports: set[int] = set()

    def allocate_port(self) -> int:
        # Ask the kernel for a free ephemeral port; remember it so two replicas launched in the
        # same tick never get the same one before either has bound it.
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((self.host, 0))
                port = s.getsockname()[1]
            if port not in self._reserved_ports:
                self._reserved_ports.add(port)
                return port
        raise LaunchError("no free TCP port found on loopback")

    def launch(self, spec: LaunchSpec) -> ProcessHandle:
        env = {**os.environ, **spec.env}
        log = None
        try:
            if spec.log_path is not None:
                spec.log_path.parent.mkdir(parents=True, exist_ok=True)
                log = open(spec.log_path, "ab", buffering=0)
            proc = subprocess.Popen(
                spec.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log if log is not None else subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                close_fds=True,
            )
        except OSError as err:
            raise LaunchError(f"cannot start {spec.argv[0]}: {err.strerror or err}") from err
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor
        self._procs[proc.pid] = proc
        return ProcessHandle(spec.replica_id, proc.pid, spec.port, spec.log_path)

    def poll(self, handle: ProcessHandle) -> int | None:
        proc = self._procs.get(handle.pid)
        if proc is None:
            return 0
        code = proc.poll()
        if code is not None:
            self._reserved_ports.discard(handle.port)
            # The group leader is gone; make sure nothing it started outlives it.
            self._signal_group(handle.pid, signal.SIGKILL)
        return code

    def stop(self, handle: ProcessHandle) -> None:
        self._signal_group(handle.pid, signal.SIGTERM)

    def kill(self, handle: ProcessHandle) -> None:
        self._signal_group(handle.pid, signal.SIGKILL)

    def log_tail(self, handle: ProcessHandle, lines: int = 20) -> list[str]:
        return read_log_tail(handle.log_path, lines)

    def live_pids(self) -> list[int]:
        """Pids of launched processes not yet reaped."""
        return [pid for pid, p in self._procs.items() if p.poll() is None]

    @staticmethod
    def _signal_group(pgid: int, sig: int) -> None:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass


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
