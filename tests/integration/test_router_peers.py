"""`python -m router --peers`: two router processes tell each other the load they sent
(router.peer_channel, router.peer_load), seen in their metrics."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
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


def hang(base: str) -> None:
    """A completion whose endpoint never answers; the client gives up after 5 s."""
    req = urllib.request.Request(f"{base}/v1/completions", method="POST",
                                 data=json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1}).encode(),
                                 headers={"content-type": "application/json"})  # fmt: skip
    with contextlib.suppress(OSError):
        urllib.request.urlopen(req, timeout=5).close()


def peers(base: str) -> dict:
    """The router's `GET /admin/v1/peers`."""
    req = urllib.request.Request(f"{base}/admin/v1/peers", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def others_in_flight(base: str) -> float:
    """Requests the peers say they have in flight on m/e0 (`GET /admin/v1/peers`)."""
    return peers(base)["load"].get("m", {}).get("e0", [0])[0]


def test_two_routers_exchange_load_reports() -> None:
    silent = socket.socket()   # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
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
        # A request through each router to an endpoint that accepts and never answers stays in flight: the
        # proxy says the load changed, the report goes as a signed datagram (router.peer_datagram), and each
        # router sees the other's request on e0.
        silent_pool = json.dumps({"policy": "kv-aware",
                                  "endpoints": [{"id": "e0", "url": f"http://127.0.0.1:{silent.getsockname()[1]}"}]})
        for base in bases:
            req = urllib.request.Request(f"{base}/admin/v1/pools/m", data=silent_pool.encode(), method="PUT",
                                         headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
            urllib.request.urlopen(req, timeout=10).close()
        hanging = [threading.Thread(target=hang, args=(base,), daemon=True) for base in bases]
        for thread in hanging:
            thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(metric(b, "fleet_router_peer_datagrams_sent_total")
                                                      and others_in_flight(b) >= 1 for b in bases):  # fmt: skip
            time.sleep(0.1)
        for base in bases:
            assert (metric(base, "fleet_router_peer_datagrams_sent_total") or 0) >= 1
            assert others_in_flight(base) >= 1
            assert metric(base, 'fleet_router_peer_datagrams_rejected_total{reason="signature"}') == 0.0
        # Each peer's answers count the datagrams it took, so each router's heartbeat has moved to UDP.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(peers(b)["datagrams_confirmed"] for b in bases):
            time.sleep(0.1)
        assert [peers(b)["datagrams_confirmed"] for b in bases] == [[bases[1]], [bases[0]]]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        silent.close()
