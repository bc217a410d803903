"""What the control-plane fault suite (tests/integration/test_control_faults.py) injects faults
with: a state directory on a small tmpfs in a private mount namespace that can be filled and
freed (`TmpfsNamespace`), `fleet up` whose stdout is a file in that directory or a pipe whose
reader can be killed (`FaultFleet`), the deployment file, the router's pools, the check that
`fleet down` left nothing behind, and the row each test records (`record_row`: printed, and
appended to ``$FLEET_FAULT_ROWS`` for `loadtests.fault_table`).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from tests.support.fleet_up import REPO, STOP_TIMEOUT_S, FleetUp, engines, router_pid
from tests.support.waits import wait_until

MODEL = "llama-8b-sim"
ROWS_ENV = "FLEET_FAULT_ROWS"


def sim_fleet_file(tmp_path: Path, replicas: int = 3) -> Path:
    """A deployment of ``replicas`` engine SIMULATORs (`engine.kind: sim`) serving ``MODEL``."""
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "sim-chat"},
        "spec": {
            "model": {"name": MODEL, "source": "sim://h100-llama-8b"},
            "engine": {"kind": "sim", "args": ["--seed", "1", "--startup-delay-s", "0.5"],
                       "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "cpu"},
            "replicas": {"min": replicas, "max": replicas},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 8, "repeat": 2}],
                       "requestTimeoutSeconds": 60},
        },
    }  # fmt: skip
    f = tmp_path / "sim-fleet.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


# ----- a state directory on a tmpfs of its own -------------------------------------------------


class TmpfsNamespace:
    """A tmpfs of ``size_mib`` mounted on ``mountpoint`` inside a private mount namespace (held by
    a sleeping process), so a test fills and frees a real filesystem without touching the
    machine's mounts. Processes started through `enter` (and all their children) see the
    tmpfs; this process reads and writes it through ``/proc/<holder>/root`` (`view`).

    Needs root (CAP_SYS_ADMIN) and util-linux's `unshare`/`nsenter`: `start` raises
    `Unavailable` saying why not."""

    HOLD_S = 1800
    """The holder sleeps this long at most: a test process killed outright leaks it no longer."""

    class Unavailable(Exception):
        """No private mount namespace with a tmpfs can be made here; the message says why."""

    def __init__(self, mountpoint: Path, size_mib: int = 64) -> None:
        self.mountpoint = Path(mountpoint)
        self.size_mib = size_mib
        self.holder: subprocess.Popen | None = None
        self._filler = 0

    def start(self) -> TmpfsNamespace:
        if os.geteuid() != 0 or not (shutil.which("unshare") and shutil.which("nsenter")):
            raise self.Unavailable("needs root and util-linux's unshare/nsenter to mount a tmpfs in a private "
                                   "mount namespace")  # fmt: skip
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self.holder = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs -o size={self.size_mib}m fleet-fault-tmpfs '{self.mountpoint}' && echo mounted && "
             f"exec sleep {self.HOLD_S}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        line = self.holder.stdout.readline().strip()
        if line != "mounted":
            self.holder.wait(timeout=10)
            raise self.Unavailable(f"cannot mount a tmpfs in a private mount namespace: {self.holder.stderr.read().strip()}")
        return self

    def close(self) -> None:
        if self.holder is not None:
            if self.holder.poll() is None:
                self.holder.kill()
                self.holder.wait(timeout=10)
            self.holder.stdout.close()
            self.holder.stderr.close()

    def view(self, path: Path) -> Path:
        """``path`` as this process reaches it inside the namespace."""
        return Path(f"/proc/{self.holder.pid}/root") / Path(path).resolve().relative_to("/")

    def enter(self) -> list[str]:
        """The argv prefix that runs a command inside the namespace (nsenter execs it: same pid)."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--"]

    def fill(self) -> int:
        """Fill the tmpfs to the last byte; returns the bytes written.

        Appending to a file whose last page is partly used needs no new page, so a full tmpfs
        still takes a few hundred bytes more of each open log; once the filler has taken every
        free page, each ``*.log`` under the mountpoint is appended marker lines until its last
        page is full too, so the next write of any log fails with ENOSPC, as on a disk that
        filled long ago."""
        written = _write_until_full(self.view(self.mountpoint / f"filler-{self._filler}"), b"\0" * (1 << 20))
        self._filler += 1
        for log in self.view(self.mountpoint).rglob("*.log"):
            written += _write_until_full(log, b"[fault injection: disk full]\n")
        return written

    def free(self) -> None:
        for i in range(self._filler):
            self.view(self.mountpoint / f"filler-{i}").unlink(missing_ok=True)
        self._filler = 0

    def free_bytes(self) -> int:
        st = os.statvfs(self.view(self.mountpoint))
        return st.f_bavail * st.f_frsize


def _write_until_full(path: Path, block: bytes) -> int:
    """Append ``block`` (then its pieces down to one byte) to ``path`` until ENOSPC; bytes written."""
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        for size in (len(block), 4096, 64, 1):
            while size <= len(block):
                try:
                    written += os.write(fd, block[:size])
                except OSError as err:
                    if err.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return written


# ----- `fleet up` with its output where the fault is ------------------------------------------


class FaultFleet(FleetUp):
    """`fleet up` as `FleetUp`, with its stdout and stderr going to ``stdout`` (a file object or
    descriptor; default the usual output file) and run behind ``prefix`` (e.g.
    `TmpfsNamespace.enter`). ``view``: how this process reaches the state directory
    (``state_dir`` is what `fleet up` is given); ``out_path``: where to read its output.
    ``shell_out``: a path (as `fleet up` sees it) its output is appended to, by a shell in front
    of it, as `fleet up --detach` does into ``logs/fleet-up.log``."""

    def __init__(self, files: Sequence[Path], state_dir: Path, *, port: int | None = None,
                 prefix: Sequence[str] = (), view: Path | None = None, stdout=None,
                 out_path: Path | None = None, shell_out: Path | None = None) -> None:  # fmt: skip
        from tests.support.fleet_up import free_port

        self.real_state_dir = state_dir
        self.state_dir = view or state_dir
        self.prefix = list(prefix)
        self.port = port or free_port()
        self.metrics_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.port}"
        self.out_path = out_path or state_dir.parent / "fleet-up.out"
        self._out = open(os.devnull, "wb") if (stdout is not None or shell_out) else open(self.out_path, "wb")
        argv = [sys.executable, "-m", "fleet.cli", "up", *map(str, files), "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--state-dir", str(state_dir)]  # fmt: skip
        if shell_out is not None:
            argv = ["sh", "-c", 'mkdir -p "$(dirname "$0")" && exec "$@" >>"$0" 2>&1', str(shell_out), *argv]
        self.proc = subprocess.Popen([*self.prefix, *argv], cwd=REPO, env={**os.environ, "COLUMNS": "160"},
                                     stdout=self._out if stdout is None else stdout, stderr=subprocess.STDOUT)  # fmt: skip
        self.seen_pids: set[int] = set()

    def output(self) -> str:
        try:
            return self.out_path.read_text(errors="replace")
        except OSError as err:
            return f"(output {self.out_path} unreadable: {err})"

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.prefix, sys.executable, "-m", "fleet.cli", *args, "--state-dir", str(self.real_state_dir)],
            capture_output=True, text=True, cwd=REPO, timeout=STOP_TIMEOUT_S + 30,
            env={**os.environ, "COLUMNS": "200"},
        )  # fmt: skip


def stdout_pipe_to(path: Path) -> tuple[int, subprocess.Popen]:
    """A pipe whose only reader is a `cat` appending to ``path``: returns (write end, reader).
    Kill the reader and the next write to the pipe fails with EPIPE."""
    r, w = os.pipe()
    with open(path, "ab") as out:
        reader = subprocess.Popen(["cat"], stdin=r, stdout=out)
    os.close(r)
    return w, reader


# ----- observing -----------------------------------------------------------------------------


def pool_endpoints(fleet: FleetUp) -> list[dict] | None:
    """The endpoints of ``MODEL``'s pool in the router, or None when the router cannot say."""
    try:
        r = httpx.get(f"{fleet.router_url}/admin/v1/pools/{MODEL}", timeout=5,
                      headers={"Authorization": f"Bearer {fleet.admin_token().strip()}"})  # fmt: skip
        return r.json()["endpoints"] if r.status_code == 200 else None
    except (httpx.HTTPError, OSError, ValueError, KeyError):
        return None


def control_write_errors(fleet: FleetUp) -> dict[str, float]:
    """``fleet_control_write_errors_total`` of `fleet up`'s metrics endpoint, by target
    (``stdout``, ``state``, ...); {} when none is exported or the endpoint does not answer."""
    try:
        text = httpx.get(f"http://127.0.0.1:{fleet.metrics_port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("fleet_control_write_errors_total{"):
            labels, _, value = line.rpartition(" ")
            target = labels.split('target="', 1)[1].split('"', 1)[0] if 'target="' in labels else "?"
            out[target] = float(value)
    return out


def ready_since(fleet: FleetUp, n: int, since_unix: float) -> bool:
    """`fleet up` recorded ``n`` READY replicas in a state written after ``since_unix``."""
    state = fleet.state()
    return (state.get("updated_at_unix", 0) > since_unix and state.get("phase") == "running"
            and sum(1 for r in state.get("replicas", []) if r["status"] == "READY") == n)  # fmt: skip


def kill_engine(state_dir: Path, replica_id: str) -> int:
    """SIGKILL to ``replica_id``'s engine (its process group); returns its pid."""
    pid = engines(state_dir)[replica_id]
    os.killpg(pid, signal.SIGKILL)
    return pid


def kill_9_router(state_dir: Path) -> float:
    """SIGKILL to the fleet's router; returns the `time.monotonic` second by which it was gone
    (exited, or a zombie none of whose threads is left: its sockets closed), so a try sent after
    it cannot have reached it. A killed process's first thread turns zombie before the others
    have exited, and its files close with the last of them (2-5 ms later here for a process of
    nine threads; a try sent in between was queued on the dying listener and reset)."""
    pid = router_pid(state_dir)
    assert pid is not None, f"no router recorded in {state_dir}"
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _exited(pid), 30, interval_s=0.005, what=f"the killed router {pid} to be gone")
    return time.monotonic()


def _exited(pid: int) -> bool:
    """True once `pid` is gone or a zombie alone in its thread group (Linux: ``/proc/<pid>/task``)."""
    try:
        if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
            return False
        return len(os.listdir(f"/proc/{pid}/task")) <= 1
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True


def down_leaves_nothing(fleet: FaultFleet, *others: FleetUp) -> str:
    """`fleet down`, then nothing of the fleet may run: no `fleet up`, no engine marked with the
    fleet's id, no router, no process any of ``fleet``/``others`` started. Returns what
    `fleet down` printed; raises AssertionError naming what is left."""
    for f in (fleet, *others):
        f.track_descendants()
    down = fleet.cli("down")
    assert down.returncode == 0, f"`fleet down` exited {down.returncode}:\n{down.stdout}\n{down.stderr}"
    if fleet.proc.poll() is None:
        fleet.proc.wait(timeout=STOP_TIMEOUT_S)
    left_engines = engines(fleet.state_dir)
    left_router = router_pid(fleet.state_dir)
    left = sorted({pid for f in (fleet, *others) for pid in f.leftover_pids()})
    assert not left_engines and left_router is None and not left, (
        f"left after `fleet down`: engines {left_engines}, router {left_router}, processes "
        f"{[(p, _cmdline(p)) for p in left]}\n{down.stdout}")  # fmt: skip
    return down.stdout


def _cmdline(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())[:120]
    except psutil.Error:
        return "?"


def wait_s(what: str, predicate, timeout_s: float, fleet: FleetUp | None = None) -> float:
    """Seconds until ``predicate()`` held (polled every 0.1 s through `tests.support.waits.wait_until`);
    fails the test naming ``what`` (and the fleet's replicas and last output lines) after
    ``timeout_s``, or as soon as ``fleet``'s `fleet up` has exited."""

    def context() -> str:
        if fleet is None:
            return ""
        return (f"replicas {({k: v['status'] for k, v in fleet.replicas().items()})}; `fleet up` "
                f"{'runs' if fleet.proc.poll() is None else f'exited {fleet.proc.returncode}'}; its output ends:\n"
                + "\n".join(fleet.output().splitlines()[-25:]))  # fmt: skip

    def holds() -> bool:
        if predicate():
            return True
        if fleet is not None:
            fleet.track_descendants()
            if fleet.proc.poll() is not None:
                pytest.fail(f"`fleet up` exited while waiting for {what}; {context()}")
        return False

    start = time.monotonic()
    wait_until(holds, timeout_s, interval_s=0.1, what=what, explain=context)
    return time.monotonic() - start


# ----- the row -------------------------------------------------------------------------------


def record_row(fault: str, load, recovery_s: float | None, recovery: str, **extra) -> dict:
    """One row of the fault table: printed as ``FAULT-ROW {json}`` and appended to the file
    named by ``$FLEET_FAULT_ROWS`` (one JSON object a line) when it is set."""
    row = {"fault": fault, "requests": len(load.done), "failed": len(load.failed), "cut": len(load.cut),
           "retried": len(load.retried), "refused": load.refused, "rate_per_s": load.rate_per_s,
           "recovery_s": None if recovery_s is None else round(recovery_s, 2), "recovery": recovery,
           "failures": sorted({r.detail for r in load.failed}), **extra}  # fmt: skip
    print(f"\nFAULT-ROW {json.dumps(row)}")
    if os.environ.get(ROWS_ENV):
        with open(os.environ[ROWS_ENV], "a") as f:
            f.write(json.dumps(row) + "\n")
    return row
