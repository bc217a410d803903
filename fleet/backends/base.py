"""The protocol between the controller and whatever runs replica processes.

Owns `LaunchSpec` (what to run), `ProcessHandle` (what was started) and `Backend`. The local
backend (`fleet.backends.local`) implements it with child processes; the Kubernetes backend will
implement it with pods. Tests use an in-memory fake (tests/fakes.py). Every call is
non-blocking: stopping is a request (`stop`), escalated by the controller with `kill` after a
grace period, and observed with `poll`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class LaunchSpec:
    replica_id: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)   # merged over the backend's environment
    port: int = 0
    log_path: Path | None = None


@dataclass(frozen=True)
class ProcessHandle:
    replica_id: str
    pid: int
    port: int
    log_path: Path | None


class LaunchError(Exception):
    """The backend could not start the process at all (e.g. executable missing)."""


class Backend(Protocol):
    def allocate_port(self) -> int:
        """A TCP port on loopback that is free now."""
        ...

    def launch(self, spec: LaunchSpec) -> ProcessHandle:
        """Start a replica process. Raises LaunchError."""
        ...

    def poll(self, handle: ProcessHandle) -> int | None:
        """Exit code if the process has exited (and reap it), else None."""
        ...

    def stop(self, handle: ProcessHandle) -> None:
        """Ask the process (and its children) to exit: SIGTERM. Idempotent."""
        ...

    def kill(self, handle: ProcessHandle) -> None:
        """Force the process (and its children) to exit: SIGKILL. Idempotent."""
        ...

    def log_tail(self, handle: ProcessHandle, lines: int = 20) -> list[str]:
        """The last ``lines`` lines of the process's log."""
        ...
