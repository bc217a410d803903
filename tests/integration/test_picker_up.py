"""`fleet up --picker-port`: the endpoint picker as one more supervised process. The router asks
it for every pick; its /metrics is a `fleet-picker` target of the Prometheus file_sd file; a picker
killed with SIGKILL under load costs no request (the router picks alone), is restarted by the
supervisor, and the router returns to it; an orderly stop leaves no picker behind
(fleet/local/routerproc.py `PickerProcess`, router/picker)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx
import psutil
import yaml

from tests.support.fleet_up import FleetUp, all_ready, free_port, stop_cleanly
from tests.support.waits import wait_until

MODEL = "sim-picker"


def write_fleet(tmp_path: Path) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "sim-picker"},
        "spec": {
            "model": {"name": MODEL, "source": "sim://h100-llama-8b"},
            "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "cpu"},
            "replicas": {"min": 2, "max": 2},
            "routing": {"policy": "kv-aware"},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 4}],
                       "requestTimeoutSeconds": 60},
        },
    }  # fmt: skip
    f = tmp_path / "sim-picker.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def picks(base_url: str, outcome: str, prefix: str = "fleet_router_picker") -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.search(rf'^{prefix}_picks_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
    return float(found.group(1)) if found else 0.0


def picker_pid(state_dir: Path) -> int | None:
    try:
        pid = json.loads((state_dir / "picker.json").read_text())["process"]["pid"]
    except (OSError, ValueError, KeyError):
        return None
    return pid if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE else None


def complete(router_url: str, i: int) -> int:
    body = {"model": MODEL, "prompt": list(range(i, i + 200)), "max_tokens": 4}
    return httpx.post(f"{router_url}/v1/completions", json=body, timeout=60).status_code


def test_fleet_up_runs_the_picker_and_survives_its_sigkill(tmp_path: Path) -> None:
    state_dir = tmp_path / "state"
    metrics_port = free_port()
    fleet = FleetUp([write_fleet(tmp_path)], state_dir,
                    extra_args=("--picker-port", str(free_port()), "--picker-metrics-port", str(metrics_port)))
    try:
        fleet.wait_for("2 replicas READY", lambda: all_ready(fleet, 2), timeout_s=180)
        url = fleet.router_url
        assert [complete(url, i) for i in range(5)] == [200] * 5
        wait_until(lambda: picks(url, "answered") >= 1, 30, what="the router's picks answered by the picker")
        picker_url = f"http://127.0.0.1:{metrics_port}"
        assert picks(picker_url, "answered", prefix="fleet_picker") >= 1
        targets = json.loads((state_dir / "prometheus-targets.json").read_text())
        assert {"targets": [f"127.0.0.1:{metrics_port}"], "labels": {"job": "fleet-picker"}} in targets
        first = picker_pid(state_dir)
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert [complete(url, i) for i in range(5, 15)] == [200] * 10   # the router picks alone meanwhile
        wait_until(lambda: picker_pid(state_dir) not in (None, first), 60, what="the supervisor restarted the picker")
        answered = picks(url, "answered")
        wait_until(lambda: complete(url, 99) == 200 and picks(url, "answered") > answered, 60,
                   what="the router asking the restarted picker again")
        assert "endpoint picker restarted" in fleet.output()
        last = picker_pid(state_dir)
        stop_cleanly(fleet, state_dir)
        assert last is not None and not psutil.pid_exists(last) and not (state_dir / "picker.json").exists()
    finally:
        if fleet.proc.poll() is None or fleet.leftover_pids():
            fleet.kill_everything()
