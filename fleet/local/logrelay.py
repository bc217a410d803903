"""The log relay of a process started on a full disk: `python -m fleet.local.logrelay PATH`.

Owns `LogRelay`: what the relay process does with each chunk of its standard input (the output
of an engine or router `fleet up` started while its log's file system had no room,
`fleet.local.failsoft.log_target`): append it to ``PATH``, and while that fails (``ENOSPC``) drop
it and try again after a backoff that doubles from 1 s to 60 s (`fleet.local.failsoft.WriteErrors`);
the first write that succeeds is preceded by a line saying how many bytes were dropped. So the
process serves from its start, as on /dev/null, and logs again once the disk has room.

Started by `fleet.local.procs.LocalProcesses.spawn` in a session of its own; it ignores SIGINT
and SIGTERM (the process it relays may still be writing its last lines) and exits when its
input ends: when the process and every worker holding its output have exited.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from fleet.local.failsoft import WriteErrors

TARGET = "log"
READ_BYTES = 64 * 1024


class LogRelay:
    """Appends chunks to ``path``; a chunk that cannot be written is dropped and counted, and the
    next write is tried once the backoff of ``errors`` allows (fake time in tests)."""

    def __init__(self, path: Path, errors: WriteErrors | None = None) -> None:
        self.path = Path(path)
        self.errors = errors or WriteErrors()
        self.dropped_bytes = 0
        self._fd: int | None = None

    def feed(self, data: bytes) -> bool:
        """Write ``data`` (after the note of what was dropped, if anything was); True when
        written, False when dropped. Never raises for a failed write."""
        if self.errors.attempt(TARGET, lambda: self._write(data)):
            return True
        self.dropped_bytes += len(data)
        return False

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.dropped_bytes:
            note = f"[fleet: {self.dropped_bytes} bytes of output dropped while {self.path} could not be written]\n"
            _write_all(self._fd, note.encode())
            self.dropped_bytes = 0
        _write_all(self._fd, data)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m fleet.local.logrelay PATH (the output to relay on standard input)", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    relay = LogRelay(Path(args[0]))
    try:
        while chunk := os.read(0, READ_BYTES):
            relay.feed(chunk)
    finally:
        relay.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
