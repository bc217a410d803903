"""`python -m router`: token from the environment, one line once listening (router.__main__)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "cli-admin-token"


def test_command_line_needs_token_and_prints_listening_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "FLEET_ROUTER_ADMIN_TOKEN"}
    missing = subprocess.run([sys.executable, "-m", "router", "--port", "0"], env=env, cwd=REPO,
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert missing.returncode == 2
    assert "FLEET_ROUTER_ADMIN_TOKEN" in missing.stderr

    proc = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", "0"],
                            env={**env, "FLEET_ROUTER_ADMIN_TOKEN": TOKEN}, cwd=REPO, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the router listens (or exits: empty line)
        assert line.startswith("fleet router listening on http://127.0.0.1:"), line
        with urllib.request.urlopen(f"{line.split()[-1]}/health", timeout=10) as resp:
            assert resp.status == 200
    finally:
        proc.terminate()
        # uvicorn shuts down gracefully on SIGTERM, then re-raises it so supervisors see it.
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)



def test_idle_client_connection_outlives_uvicorns_default_keepalive() -> None:
    """A pooled client connection idle for 6 s (uvicorn closes after 5 s by default) still
    serves the next request, so bursty clients do not lose requests to a close race."""
    import http.client
    import time

    proc = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", "0"],
                            env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": TOKEN}, cwd=REPO, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline().rsplit(":", 1)[1])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().read() == b'{"status":"ok"}'
        sock = conn.sock
        time.sleep(6.0)                           # the idle time is the case under test, not a wait
        conn.request("GET", "/health")            # http.client reconnects silently if closed...
        assert conn.getresponse().status == 200
        assert conn.sock is sock                  # ...so check it reused the very same socket
    finally:
        proc.terminate()
        proc.wait(timeout=30)
