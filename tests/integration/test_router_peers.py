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


def peer_routers(ports: list[int], bases: list[str]) -> list[subprocess.Popen]:
    """Two `python -m router` processes on `ports`, each with the other as its `--peers`."""
    return [subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1", "--port", str(ports[i]),
                              "--peers", bases[1 - i], "--router-id", f"r{i}"],
                             env={**os.environ, "FLEET_ROUTER_ADMIN_TOKEN": TOKEN}, cwd=REPO,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
            for i in (0, 1)]


def test_two_routers_exchange_load_reports() -> None:
    silent = socket.socket()   # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    ports = [free_port(), free_port()]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    procs = peer_routers(ports, bases)
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


def test_a_prompt_sent_for_prefill_is_claimed_at_both_routers(tmp_path: Path) -> None:
    """Two `python -m router --peers` processes and a simulated engine publishing its KV events
    (`--kv-events-config`): once the routers' views know the engine's block size, a new prompt
    sent through router 0 is claimed at the engine (`router.kv_index.ExactIndex.expect`) and the
    claim reaches router 1 as a signed datagram (`router.peer_datagram.encode_claim`), which
    takes it into its own view; the engine's stored blocks then show in both views."""
    pub, replay, ports = free_port(), free_port(), [free_port(), free_port()]
    ports_file = tmp_path / "engine.json"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": ""}
    engine = subprocess.Popen([sys.executable, "-m", "fleet.enginesim", "--model", "sim://h100-llama-8b",
                               "--served-model-name", "m", "--port", "0", "--ports-file", str(ports_file),
                               "--kv-events-config", json.dumps(config)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    procs = peer_routers(ports, bases)
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().startswith("fleet router listening")
        deadline = time.monotonic() + 60
        while not (ports_file.exists() and ports_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        engine_url = json.loads(ports_file.read_text())["urls"][0]
        kv = {"publisher": f"tcp://127.0.0.1:{pub}", "replay": f"tcp://127.0.0.1:{replay}"}
        pool = json.dumps({"policy": "kv-aware", "endpoints": [{"id": "e0", "url": engine_url, "kv_events": kv}]})
        for base in bases:
            req = urllib.request.Request(f"{base}/admin/v1/pools/m", data=pool.encode(), method="PUT",
                                         headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
            urllib.request.urlopen(req, timeout=10).close()

        def complete(base: str, ids: list[int]) -> None:
            req = urllib.request.Request(f"{base}/v1/completions", headers={"Content-Type": "application/json"},
                                         data=json.dumps({"model": "m", "prompt": ids, "max_tokens": 1}).encode())
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.status == 200

        def stream_live_and_events(base: str) -> bool:
            return (metric(base, 'fleet_router_kv_stream_live{endpoint="e0",model="m"}') == 1.0
                    and (metric(base, 'fleet_router_kv_events_total{endpoint="e0",model="m"}') or 0) >= 1)

        deadline = time.monotonic() + 60
        while True:   # the engine stores a first prompt: both views learn its block size
            complete(bases[0], list(range(1000, 1064)))
            if all(stream_live_and_events(b) for b in bases) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(stream_live_and_events(b) for b in bases)
        assert metric(bases[1], "fleet_router_peer_claims_received_total") in (None, 0.0)
        complete(bases[0], list(range(5000, 5064)))   # a new prompt: 4 blocks of 16 claimed at e0
        deadline = time.monotonic() + 20
        while (metric(bases[1], "fleet_router_peer_claims_received_total") or 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (metric(bases[0], "fleet_router_peer_claims_sent_total") or 0) >= 1
        assert (metric(bases[1], "fleet_router_peer_claims_received_total") or 0) >= 1
        assert metric(bases[1], 'fleet_router_peer_datagrams_rejected_total{reason="claim"}') == 0.0

        def blocks(base: str) -> float:
            return metric(base, 'fleet_router_kv_index_blocks{endpoint="e0",model="m"}') or 0

        deadline = time.monotonic() + 20
        while min(blocks(b) for b in bases) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [blocks(b) for b in bases] == [8.0, 8.0]   # both prompts' blocks, from the engine's events
    finally:
        for proc in [*procs, engine]:
            proc.terminate()
        for proc in [*procs, engine]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
