"""`fleet up` autoscaling end to end over simulated engines (`engine.kind: sim`, the engine
SIMULATOR: real processes serving vLLM's API and `vllm:` metrics with modelled latencies, no
model): a burst of clients pushes the router's queue time over its target, the autoscaler adds
replicas, they start, warm and join the pool; when the burst ends the deployment comes back to
one replica, each surplus replica drained before it stops; every request answers 200.

Real here: `fleet up`, the controller, the router (admission queue, per-endpoint limit), the
autoscaler loop and Fleet's policy, the warm-up gate, process start and stop. Windows are
seconds instead of minutes so the test takes about a minute; what it asserts is the sequence,
never a timing, so a slow machine only makes it slower.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

from tests.support.fleet_up import FleetUp

MODEL = "llama-8b-sim"
PER_ENDPOINT = 2          # router admission limit per replica: the rest wait in the router
MAX_REPLICAS = 3
BURST_CLIENTS = 10
SCALE_TIMEOUT_S = 240.0   # generous: start-ups and decisions on a loaded 2-core CI machine


def deployment(tmp_path: Path) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "burst"},
        "spec": {
            "model": {"name": MODEL, "source": "sim://h100-llama-8b"},
            "engine": {"kind": "sim", "args": ["--seed", "3", "--startup-delay-s", "0.5"],
                       "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "cpu", "cpuCores": 1},
            "replicas": {"min": 1, "max": MAX_REPLICAS},
            "routing": {"policy": "latency-aware", "maxConcurrencyPerEndpoint": PER_ENDPOINT,
                        "queueTimeoutSeconds": 120},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 4}]},
            "autoscaling": {
                "policy": "fleet", "queueTimeTargetSeconds": 0.3, "ttftP99TargetSeconds": 5.0,
                "windowSeconds": 4, "intervalSeconds": 1, "scaleDownStabilizationSeconds": 6,
                "warmStartupSeconds": 2,
            },
        },
    }
    path = tmp_path / "burst.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class Clients:
    """Closed-loop clients: each sends a 64-token completion, waits for the answer (and its
    think time), repeats, until told to stop. Every status code (or exception name) is counted."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._threads: list[tuple[threading.Thread, threading.Event]] = []

    def add(self, n: int, think_s: float = 0.0) -> None:
        for _ in range(n):
            stop = threading.Event()
            t = threading.Thread(target=self._loop, args=(stop, think_s), daemon=True)
            t.start()
            self._threads.append((t, stop))

    def remove(self, n: int) -> None:
        """Stop the newest ``n`` clients after their request in flight, and wait for them."""
        leaving, self._threads = self._threads[-n:], self._threads[:-n]
        for _, stop in leaving:
            stop.set()
        for t, _ in leaving:
            t.join(timeout=180)

    def _loop(self, stop: threading.Event, think_s: float) -> None:
        body = {"model": MODEL, "prompt": "tell me a long story " * 8, "max_tokens": 64, "ignore_eos": True}
        with httpx.Client(timeout=180) as client:
            while not stop.is_set():
                try:
                    outcome = str(client.post(f"{self.url}/v1/completions", json=body).status_code)
                except httpx.HTTPError as err:
                    outcome = type(err).__name__
                with self._lock:
                    self.outcomes[outcome] += 1
                stop.wait(think_s)


def test_a_burst_scales_up_and_the_quiet_after_it_scales_back_down(sim_fleet_up, tmp_path: Path) -> None:
    fleet: FleetUp = sim_fleet_up([deployment(tmp_path)])
    clients = Clients(fleet.router_url)
    try:
        def ready() -> list[str]:
            return sorted(k for k, v in fleet.replicas().items() if v["status"] == "READY")

        def desired() -> int:
            return fleet.state().get("deployments", {}).get("burst", {}).get("desired", 0)

        fleet.wait_for("the first replica READY", lambda: len(ready()) == 1, SCALE_TIMEOUT_S)
        first = ready()[0]

        # One client: the single replica keeps up (2 slots), nothing scales. It thinks a second
        # between requests, so that after the burst (it stays) it clearly sends less than the
        # rate per replica the burst overloaded at: with no think time its rate sat at the
        # policy's probe margin (80% of that rate), and on a fast machine the probe that scales
        # 2 -> 1 was barred ("load 1.0 needs 2 replica(s)", no probe: autoscaler/policy.py).
        clients.add(1, think_s=1.0)
        time.sleep(6)   # an observation window, not a wait: nothing may scale while this one client runs
        assert desired() == 1, fleet.state()["deployments"]["burst"]

        # The burst: ten clients on 2 slots; the rest wait in the router's admission queue.
        clients.add(BURST_CLIENTS - 1)
        fleet.wait_for("a scale-up decision", lambda: desired() > 1, SCALE_TIMEOUT_S)
        up = fleet.state()["deployments"]["burst"]
        assert up["desired_reason"] in ("autoscaler: queue_time_above_target", "autoscaler: queue_time_projected",
                                        "autoscaler: ttft_p99_above_target", "autoscaler: ttft_p99_projected"), up
        fleet.wait_for("the added replicas READY", lambda: len(ready()) >= 2, SCALE_TIMEOUT_S)
        added = [r for r in ready() if r != first]
        served_before = sum(clients.outcomes.values())
        fleet.wait_for("requests answered with the new replicas in the pool",
                       lambda: sum(clients.outcomes.values()) >= served_before + 2 * BURST_CLIENTS,
                       SCALE_TIMEOUT_S)
        # The new replicas took traffic: the router's per-endpoint request counter moved.
        metrics = httpx.get(f"{fleet.router_url}/metrics", timeout=10).text
        for replica_id in added:
            line = next((ln for ln in metrics.splitlines()
                         if ln.startswith("fleet_router_requests_total{") and f'endpoint="{replica_id}"' in ln), None)
            assert line is not None and float(line.rsplit(" ", 1)[1]) > 0, (replica_id, line)

        # The burst ends; one client stays, so draining replicas have requests in flight.
        clients.remove(BURST_CLIENTS - 1)
        fleet.wait_for("a scale-down back to one replica",
                       lambda: desired() == 1 and len(ready()) == 1, SCALE_TIMEOUT_S,
                       explain=lambda: fleet.state()["deployments"]["burst"].get("last_scaling"))
        down = fleet.state()["deployments"]["burst"]
        assert down["desired_reason"] == "autoscaler: underloaded", down
        fleet.wait_for("the surplus replicas stopped", lambda: all(
            v["status"] == "TERMINATED" for k, v in fleet.replicas().items() if k not in ready()), SCALE_TIMEOUT_S)
        drained = [k for k, v in fleet.replicas().items() if v["status"] == "TERMINATED"]
        assert drained and not any(v["status"] == "FAILED" for v in fleet.replicas().values())
        clients.remove(1)

        assert set(clients.outcomes) == {"200"}, clients.outcomes
        assert clients.outcomes["200"] > 3 * BURST_CLIENTS
        assert fleet.interrupt() == 0
        assert fleet.leftover_pids() == []
    finally:
        clients.remove(len(clients._threads))
