"""`python -m router --peers`: two router processes tell each other the load they sent
(router.peer_channel, router.peer_load), seen in their metrics."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TOKEN = "peers-admin-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric(base: str, name: str) -> float | None:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as resp:
        m = re.search(rf"^{re.escape(name)} (\S+)$", resp.read().decode(), re.M)
    return float(m.group(1)) if m else None


def test_two_routers_exchange_load_reports() -> None:
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(ports[i]),
                               "--peers", bases[1 - i], "--router-id", f"r{i}"],
                              env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": TOKEN}, cwd=REPO,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
             for i in (0, 1)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().startswith("fleet router listening")
        pool = json.dumps({"policy": "kv-aware", "endpoints": [{"id": "e0", "url": "http://127.0.0.1:9"}]}).encode()
        for base in bases:
            req = urllib.request.Request(f"{base}/admin/v1/pools/m", data=pool, method="PUT",
                                         headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
            urllib.request.urlopen(req, timeout=10).close()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if all(metric(b, "fleet_router_peers_live") == 1.0 for b in bases):
                break
            time.sleep(0.2)
        for base in bases:
            assert metric(base, "fleet_router_peers_live") == 1.0
            assert (metric(base, "fleet_router_peer_reports_received_total") or 0) >= 1
            assert (metric(base, "fleet_router_peer_reports_sent_total") or 0) >= 1
        # Each pool PUT changed a router's load: that report went as a signed datagram (router.peer_datagram).
        while time.monotonic() < deadline and not all(metric(b, "fleet_router_peer_datagrams_sent_total") for b in bases):
            time.sleep(0.2)
        for base in bases:
            assert (metric(base, "fleet_router_peer_datagrams_sent_total") or 0) >= 1
            assert metric(base, 'fleet_router_peer_datagrams_rejected_total{reason="signature"}') == 0.0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
