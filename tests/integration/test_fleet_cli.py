"""The liveness check `fleet status`/`fleet down` use (fleet.cli.local), on a real child process:
a zombie counts as gone (tests/unit/test_fleet_cli.py: the rest of the command line)."""

from __future__ import annotations

import os
import subprocess

from fleet.cli.local import _pid_alive
from tests.support.waits import wait_until


def test_pid_alive_treats_a_zombie_as_gone() -> None:
    proc = subprocess.Popen(["true"])
    # `true` exits at once and stays a zombie until wait()
    wait_until(lambda: not _pid_alive(proc.pid), 30, what=f"`true` ({proc.pid}) to count as gone")
    assert proc.poll() == 0   # it really was a zombie we had not reaped
    assert _pid_alive(os.getpid())
