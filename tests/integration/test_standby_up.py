"""Standby replicas through a real `fleet up`: two GPUs (the stand-in NVML "driver" of
fleet/testing/nvml_driver), sim engines (`engine.kind: sim`, started with `--enable-sleep-mode`),
the real router. A deployment serving one replica keeps one more asleep (`spec.standby`); under
an open-loop load, `fleet apply` raises its minimum to 2 (the burst's scale-up): the controller
wakes the standby replica (`POST /wake_up`, ~0.7 s for the h100-llama-8b profile's 16 GB of
weights at llm-d's measured rate), runs the warm-up gate and puts it in the pool, instead of a
cold start; no request of the load fails. The time from the decision (the wake) to READY is
printed and bounded; `fleet down` leaves nothing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
import yaml

from fleet.enginesim.profiles import get_profile
from fleet.enginesim.sleep import wake_time_s
from fleet.testing.fake_nvml import pcie_4gpu
from fleet.testing.nvml_driver import DRIVER_DIR, write_state
from tests.support.fleet_up import REPO, stop_cleanly
from tests.support.load import OpenLoopLoad

PRODUCT = "NVIDIA L40S"
PROFILE = "h100-llama-8b"


def deployment(tmp_path: Path, minimum: int) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": "chat"},
        "spec": {
            "model": {"name": "chat-model", "source": f"sim://{PROFILE}"},
            "engine": {"kind": "sim", "args": ["--seed", "1", "--startup-delay-s", "0.5"], "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "gpu", "gpuProduct": PRODUCT},
            "replicas": {"min": minimum, "max": 2, "initial": minimum},
            "standby": {"maxReplicas": 1},
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 4}],
                       "requestTimeoutSeconds": 60},
        },
    }  # fmt: skip
    f = tmp_path / "chat.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_a_burst_is_served_by_waking_a_standby_replica(sim_fleet_up, tmp_path, monkeypatch):
    two_gpus = {**pcie_4gpu(PRODUCT), "devices": pcie_4gpu(PRODUCT)["devices"][:2]}
    monkeypatch.setenv("PYTHONPATH", f"{DRIVER_DIR}{os.pathsep}{REPO}")
    monkeypatch.setenv("FLEET_FAKE_NVML", str(write_state(tmp_path / "nvml-state.json", two_gpus)))
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    f = deployment(tmp_path, minimum=1)
    fleet = sim_fleet_up([f])

    def asleep() -> bool:
        r = fleet.replicas()
        return (r.get("chat-0", {}).get("status") == "READY" and r.get("chat-1", {}).get("status") == "STANDBY"
                and r["chat-1"].get("sleep_sent_at_s") is not None)

    fleet.wait_for("chat-0 READY and chat-1 asleep in STANDBY", asleep, timeout_s=120)
    assert fleet.replicas()["chat-1"]["standby_refill"] is False     # it slept once warm, never served
    status = fleet.cli("status")
    assert status.returncode == 0 and "STANDBY" in status.stdout and "1/1" in status.stdout, status.stdout

    with OpenLoopLoad(fleet.router_url, "chat-model") as load:
        load.wait_for_more(20, "load on one replica before the burst")
        deployment(tmp_path, minimum=2)
        applied_s = time.monotonic()
        applied = fleet.cli("apply", str(f))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        fleet.wait_for("chat-1 READY again", lambda: fleet.status_of("chat-1") == "READY", timeout_s=60)
        ready_seen_s = time.monotonic()
        load.wait_for_more(20, "load on two replicas after the wake")
    assert load.failed == [], load.failed[:10]

    r = fleet.replicas()["chat-1"]
    decision_to_ready_s = r["warmup_passed_at_s"] - r["woke_at_s"]   # the controller's clock (CLOCK_MONOTONIC)
    print(f"standby wake: decision -> READY {decision_to_ready_s:.2f} s (controller clock); "
          f"fleet apply -> READY seen {ready_seen_s - applied_s:.2f} s (test clock, 0.2 s polling)")
    assert decision_to_ready_s >= wake_time_s(get_profile(PROFILE).weight_bytes_per_gpu)   # the wake itself
    assert decision_to_ready_s < 30.0          # seconds, not a cold start; generous for a loaded 2-core machine
    assert r["assignment"] and r["exit_code"] is None                  # the same engine process, woken
    answer = httpx.post(f"{r['endpoint']}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert answer.status_code == 200, answer.text                     # awake: serves again
    refill = fleet.replicas().get("chat-2")
    assert refill is not None and refill["standby_refill"] and refill["status"] == "PENDING"   # no third GPU
    stop_cleanly(fleet, fleet.state_dir)
