"""The simulator's command lines as real processes: `fleet sim-engine` and `python -m fleet.enginesim`
(tests/unit/test_sim_cli.py: the flags parsed in-process)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.waits import wait_until


REPO = Path(__file__).resolve().parents[2]
FLEET = [sys.executable, "-c", "from fleet.cli import app; app()"]


def ports_of(path: Path, proc: subprocess.Popen, timeout_s: float = 20.0) -> dict:
    """The ports file ``proc`` writes, once it is there; fails at once if ``proc`` exits first."""

    def written() -> bool:
        if proc.poll() is not None and not path.exists():
            pytest.fail(f"exited early with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}")
        return path.exists()

    wait_until(written, timeout_s, what=f"{path} to appear")
    return json.loads(path.read_text())


def get(url: str) -> tuple[int, bytes]:
    """Status and body of ``url``, retried while the server does not answer yet (up to 20 s)."""

    def answer() -> tuple[int, bytes]:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()

    return wait_until(answer, 20, what=f"an answer from {url}", ignoring=(OSError,))


def test_fleet_sim_engine_serves_several_replicas_and_stops_on_sigterm(tmp_path):
    ports_file = tmp_path / "ports.json"
    proc = subprocess.Popen([*FLEET, "sim-engine", "--replicas", "3", "--ports-file", str(ports_file),
                             "--profile", "h100-llama-8b", "--model-name", "m"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        doc = ports_of(ports_file, proc)
        assert doc["simulator"] is True and len(set(doc["ports"])) == 3
        for url in doc["urls"]:
            assert get(f"{url}/health")[0] == 200
        body = json.dumps({"model": "m", "prompt": "hi hi", "max_tokens": 3}).encode()
        req = urllib.request.Request(f"{doc['urls'][2]}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    assert "SIMULATOR" in out and out.count("(simulator)") == 3


@pytest.mark.parametrize("flags,code,fragment", [
    (["--fail-at-start"], 1, "fail at start"),
    (["--profile", "nope"], 2, "unknown simulator profile 'nope'"),
])  # fmt: skip


def test_python_m_fleet_sim_exit_codes(flags, code, fragment):
    proc = subprocess.run([sys.executable, "-m", "fleet.enginesim", "--port", "0", *flags], cwd=REPO,
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert proc.returncode == code
    assert fragment in proc.stdout + proc.stderr


def test_a_one_replica_process_exits_1_when_it_crashes(tmp_path):
    ports_file = tmp_path / "ports.json"
    proc = subprocess.Popen([sys.executable, "-m", "fleet.enginesim", "--port", "0", "--ports-file", str(ports_file),
                             "--crash-after-requests", "1"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        url = ports_of(ports_file, proc)["urls"][0]
        get(f"{url}/health")
        req = urllib.request.Request(f"{url}/v1/completions", data=b'{"prompt": "x", "max_tokens": 2}',
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        out, _ = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1 and "crash after 1" in out
