"""The hub stand-in (`python -m fleet.testing.hub_server`) and `fleet node-agent` as real
processes: a model directory served for hf:// sources, and the agent's loop serving its status
and stopping on SIGTERM (tests/unit/test_cli_agent.py: the CLI in-process)."""

from __future__ import annotations

import json
import os


from fleet.cli import app
from tests.unit.test_cli_agent import runner  # the subject's helpers live in its unit file


def test_hub_server_serves_a_model_directory_for_hf_sources(tmp_path, monkeypatch):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    model = tmp_path / "tiny"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "sub" / "weights.bin").write_bytes(os.urandom(5000))
    proc = subprocess.Popen([sys.executable, "-m", "fleet.testing.hub_server", "--repo", f"org/tiny={model}"], cwd=repo,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(repo)})
    try:
        url = proc.stdout.readline().strip()
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        r = runner.invoke(app, ["cache", "pull", "hf://org/tiny", "--root", str(tmp_path / "cache")])
        assert r.exit_code == 0, r.output
        path = Path(r.stdout.strip().splitlines()[-1])
        assert (path / "sub" / "weights.bin").read_bytes() == (model / "sub" / "weights.bin").read_bytes()
    finally:
        proc.kill()
        proc.wait()


def test_node_agent_loop_serves_status_and_stops_on_sigterm(tmp_path):
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    import httpx

    from tests.support.waits import wait_until

    repo = Path(__file__).resolve().parents[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "fleet.cli", "node-agent", "--interval-s", "0.2", "--metrics-port", str(port),
         "--metrics-host", "127.0.0.1", "--node-name", "n2", "--root", str(tmp_path / "cache"),
         "--status-file", str(tmp_path / "status.json")],
        cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:

        def checked() -> dict | None:
            assert proc.poll() is None, proc.stderr.read().decode()
            status = httpx.get(f"http://127.0.0.1:{port}/status", timeout=2).json()
            return status if status.get("checked_at_s") else None

        status = wait_until(checked, 60, interval_s=0.1, what="the node agent's first check in its /status",
                            ignoring=(httpx.HTTPError,))
        assert status["node"] == "n2"
        assert json.loads((tmp_path / "status.json").read_text())["node"] == "n2"
        assert "fleet_weight_cache_models" in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
