"""`python -m router --peers-dns NAME:PORT`: routers find each other by name and share the load
they send (router.signals.peer_discovery, router.signals.peer_channel), as the chart's router pods do through a
headless Service, here on loopback with a simulated engine (`python -m fleet.enginesim`).

Two loopback addresses stand for two pods: router A listens on 127.0.0.2:P, router B on
127.0.0.1:P, both with ``--peers-dns localhost:P``. ``localhost`` resolves (through /etc/hosts,
by the system resolver) to 127.0.0.1 only, so A finds B, and B finds only itself, which its
``--pod-ip`` leaves out. Requests sent to A raise the load B sees on the engine
(`GET /admin/v1/peers`) and fall back once they finish.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from tests.support.waits import wait_until

REPO = Path(__file__).resolve().parents[2]
TOKEN = "peers-dns-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _port_free_on_both() -> int:
    """A port free on 127.0.0.1 and on 127.0.0.2 (the two routers' addresses)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.2", port))
            except OSError:
                continue
            return port
    raise AssertionError("no port free on both loopback addresses")


def _loopback_resolves_to_127_0_0_1_only() -> bool:
    try:
        return {i[4][0] for i in socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)} == {"127.0.0.1"}
    except OSError:
        return False


pytestmark = pytest.mark.skipif(not _loopback_resolves_to_127_0_0_1_only(),
                                reason="the test needs `localhost` to resolve to 127.0.0.1 alone")  # fmt: skip


def _call(url: str, method: str = "GET", body: dict | None = None, timeout_s: float = 10) -> object:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={**AUTH, "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        raw = resp.read()
    return json.loads(raw) if raw else None


def test_routers_found_by_name_share_the_load_sent_to_an_engine(tmp_path: Path) -> None:
    port = _port_free_on_both()
    ports_file = tmp_path / "engine.json"
    engine = subprocess.Popen([sys.executable, "-m", "fleet.enginesim", "--model", "sim://h100-llama-8b",
                               "--served-model-name", "m", "--port", "0", "--ports-file", str(ports_file)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    routers: dict[str, subprocess.Popen] = {}
    try:
        for name, host in (("a", "127.0.0.2"), ("b", "127.0.0.1")):
            routers[name] = subprocess.Popen(
                [sys.executable, "-m", "router", "--host", host, "--port", str(port), "--router-id", name,
                 "--peers-dns", f"localhost:{port}", "--pod-ip", host],
                env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": TOKEN}, cwd=REPO, stdout=subprocess.PIPE, text=True)
        for proc in routers.values():
            assert proc.stdout is not None and proc.stdout.readline().startswith("fleet router listening")
        a, b = f"http://127.0.0.2:{port}", f"http://127.0.0.1:{port}"
        engine_url = wait_until(lambda: ports_file.exists() and json.loads(ports_file.read_text())["urls"][0],
                                what="the engine's ports file")  # fmt: skip
        wait_until(lambda: urllib.request.urlopen(f"{engine_url}/health", timeout=5).status == 200,
                   what="engine health", ignoring=(OSError,))
        pool = {"policy": "kv-aware", "endpoints": [{"id": "e0", "url": engine_url}]}
        for base in (a, b):
            _call(f"{base}/admin/v1/pools/m", "PUT", pool)

        assert _call(f"{a}/admin/v1/peers")["targets"] == [b]          # found by name
        assert _call(f"{b}/admin/v1/peers")["targets"] == []           # itself only: left out

        # requests to A, long enough to be in flight while B is asked
        def complete() -> None:
            req = urllib.request.Request(f"{a}/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "m", "prompt": "hello " * 400,
                                                          "max_tokens": 400, "ignore_eos": True}).encode())  # fmt: skip
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200

        clients = [threading.Thread(target=complete) for _ in range(3)]
        for c in clients:
            c.start()
        seen = wait_until(lambda: (_call(f"{b}/admin/v1/peers")["load"].get("m", {}).get("e0") or [0])[0] >= 1 and
                          _call(f"{b}/admin/v1/peers"), 20, what="B to see A's load", ignoring=(OSError,))  # fmt: skip
        assert seen["live"] == ["a"]
        in_flight, _, prefill_tokens = seen["load"]["m"]["e0"]
        assert 1 <= in_flight <= 3 and prefill_tokens >= 0
        for c in clients:
            c.join(60)
        wait_until(lambda: _call(f"{b}/admin/v1/peers")["load"]["m"]["e0"][0] == 0, what="A's load to fall back",
                   ignoring=(OSError,))
        with urllib.request.urlopen(f"{b}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert "fleet_router_peers_live 1.0" in text and "fleet_router_peers_discovered 0.0" in text
        assert 'fleet_router_peer_datagrams_rejected_total{reason="signature"} 0.0' in text
        with urllib.request.urlopen(f"{a}/metrics", timeout=10) as resp:   # A's changes went as datagrams
            sent = re.search(r"^fleet_router_peer_datagrams_sent_total (\S+)$", resp.read().decode(), re.M)
        assert sent is not None and float(sent.group(1)) >= 1
    finally:
        for proc in [*routers.values(), engine]:
            proc.terminate()
        for proc in [*routers.values(), engine]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
