"""The liveness check `fleet status`/`fleet down` use (fleet.cli.local), on a real child process:
a zombie counts as gone (tests/unit/test_fleet_cli.py: the rest of the command line)."""

from __future__ import annotations

import os
import subprocess
import time

from fleet.cli.local import _pid_alive


def test_pid_alive_treats_a_zombie_as_gone() -> None:
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _pid_alive(proc.pid):
        time.sleep(0.05)  # `true` exits at once and stays a zombie until wait()
    assert not _pid_alive(proc.pid)
    assert proc.poll() == 0   # it really was a zombie we had not reaped
    assert _pid_alive(os.getpid())
