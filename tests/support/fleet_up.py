"""`fleet up` as a real child process, driven the way a user drives it (YAML file, CLI, Ctrl-C),
with every process it starts tracked so a test can prove none is left behind: `FleetUp` and
`fleet_up_factory` (the ``sim_fleet_up`` fixture of tests/integration/conftest.py over the engine
SIMULATOR, the ``fleet_up`` fixture of tests/e2e/conftest.py over real vLLM), and the checks the
fault-injection and weight-cache tests share (`engines`, `router_pid`, `all_ready`, `stop_cleanly`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from fleet.local.backend import FLEET_ID_ENV, REPLICA_ID_ENV
from fleet.local.procs import find_marked
from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO / "examples" / "models" / "tiny-llama"   # where the quickstart expects it
READY_TIMEOUT_S = 420.0        # two replicas importing vLLM on 2 shared cores: ~45 s measured, slack for CI
STOP_TIMEOUT_S = 180.0



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FleetUp:
    """One `fleet up` child process with its own state directory and router port."""

    def __init__(self, files: list[Path], state_dir: Path, port: int | None = None, out_name: str = "fleet-up.out",
                 cli_module: str = "fleet.cli", extra_args: tuple[str, ...] = ()) -> None:
        """``cli_module``: the module run as `fleet` (tests.support.fake_gpu_fleet: over a stand-in NVML);
        ``extra_args``: more `fleet up` options (e.g. ``--prices FILE``)."""
        self.state_dir = state_dir
        self.port = port or free_port()
        # Its own free port: the default (--port + 1) is often taken by an outgoing connection
        # when --port is an ephemeral one.
        self.metrics_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.port}"
        self.out_path = state_dir.parent / out_name
        self._out = open(self.out_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", cli_module, "up", *map(str, files), "--port", str(self.port),
             "--metrics-port", str(self.metrics_port), "--state-dir", str(state_dir), *extra_args],
            stdout=self._out, stderr=subprocess.STDOUT, cwd=REPO,
        )
        self.seen_pids: set[int] = set()

    # --- observing -------------------------------------------------------------------------

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def state(self) -> dict:
        try:
            return json.loads((self.state_dir / "state.json").read_text())
        except (OSError, ValueError):
            return {}

    def replicas(self) -> dict[str, dict]:
        return {r["id"]: r for r in self.state().get("replicas", [])}

    def track_descendants(self) -> None:
        """Remember every process `fleet up` has started so far (router, engines, their workers)."""
        try:
            parent = psutil.Process(self.proc.pid)
            self.seen_pids.update(p.pid for p in parent.children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def wait_for(self, what: str, predicate: Callable[[], bool], timeout_s: float,
                 explain: Callable[[], object] | None = None) -> None:
        """Poll ``predicate`` every 0.5 s (`tests.support.waits.wait_until`) until it holds or
        ``timeout_s`` passes; on a timeout the failure names ``what``, the replicas, what
        ``explain()`` returns (when given) and the output. Fails at once if `fleet up` exits."""

        def holds() -> bool:
            self.track_descendants()
            if predicate():
                return True
            if self.proc.poll() is not None:
                pytest.fail(f"`fleet up` exited with {self.proc.returncode} while waiting for {what}:\n{self.output()}")
            return False

        def context() -> str:
            extra = f"\n{explain()}" if explain is not None else ""
            return f"replicas: { {k: v['status'] for k, v in self.replicas().items()} }{extra}\n{self.output()}"

        wait_until(holds, timeout_s, interval_s=0.5, what=what, explain=context)

    def status_of(self, replica_id: str) -> str | None:
        return self.replicas().get(replica_id, {}).get("status")

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run another `fleet` command against this fleet's state directory."""
        return subprocess.run(
            [sys.executable, "-m", "fleet.cli", *args, "--state-dir", str(self.state_dir)],
            capture_output=True, text=True, cwd=REPO, timeout=STOP_TIMEOUT_S + 30,
            env={**os.environ, "COLUMNS": "200"},
        )

    def admin_token(self) -> str:
        return (self.state_dir / "admin-token").read_text()

    # --- stopping --------------------------------------------------------------------------

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to `fleet up` only, as a terminal sends it; returns its exit code."""
        self.track_descendants()
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=STOP_TIMEOUT_S)

    def leftover_pids(self) -> list[int]:
        """Processes `fleet up` started that still exist (zombies count as gone)."""
        left = []
        for pid in self.seen_pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    left.append(pid)
            except psutil.NoSuchProcess:
                pass
        return left

    def kill_everything(self) -> None:
        """Last resort after a failed test: nothing may leak into the next test or CI."""
        self.track_descendants()
        for pid in [self.proc.pid, *self.seen_pids]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._out.close()


def fleet_up_factory(tmp_path: Path) -> Iterator[Callable[[list[Path]], FleetUp]]:
    started: list[FleetUp] = []

    def start(files: list[Path], port: int | None = None) -> FleetUp:
        f = FleetUp(files, tmp_path / "state", port=port, out_name=f"fleet-up-{len(started)}.out")
        started.append(f)
        return f

    yield start
    for f in started:
        if f.proc.poll() is None or f.leftover_pids():
            f.kill_everything()


def engines(state_dir: Path) -> dict[str, int]:
    """Replica id -> pid of every live engine process marked with this fleet's id."""
    fid = (state_dir / "fleet-id").read_text().strip()
    return {env[REPLICA_ID_ENV]: pid for pid, env in find_marked(FLEET_ID_ENV, fid).items()}


def router_pid(state_dir: Path) -> int | None:
    try:
        pid = json.loads((state_dir / "router.json").read_text())["process"]["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return pid if psutil.pid_exists(pid) else None


def all_ready(fleet: FleetUp, n: int) -> bool:
    state = fleet.state()
    return state.get("phase") == "running" and \
        sum(1 for r in state.get("replicas", []) if r["status"] == "READY") == n


def stop_cleanly(fleet: FleetUp, state_dir: Path) -> None:
    assert fleet.interrupt() == 0, fleet.output()
    assert engines(state_dir) == {} and router_pid(state_dir) is None
