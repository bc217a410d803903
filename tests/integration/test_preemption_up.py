"""Priorities and preemption through a real `fleet up`: two GPUs (the stand-in NVML "driver" of
fleet/testing/nvml_driver, first on PYTHONPATH, `$FLEET_FAKE_NVML` naming a two-GPU state file), sim
engines (`engine.kind: sim`), the real router. A low-priority deployment holds both GPUs and serves
an open-loop load; `fleet apply` raises a high-priority deployment's minimum to 1: one low-priority
replica is preempted, drained through the router first (no request of the load fails), and stops;
the high-priority replica starts on the GPU it freed and serves; the low-priority replacement waits,
held off that GPU; `fleet status` lists the preemption with its reason; `fleet down` leaves nothing."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import yaml

from fleet.testing.fake_nvml import pcie_4gpu
from fleet.testing.nvml_driver import DRIVER_DIR, write_state
from tests.support.fleet_up import REPO, all_ready, stop_cleanly
from tests.support.load import OpenLoopLoad

PRODUCT = "NVIDIA L40S"


def deployment(tmp_path: Path, name: str, priority: int, minimum: int, initial: int) -> Path:
    doc = {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": f"{name}-model", "source": "sim://h100-llama-8b"},
            "engine": {"kind": "sim", "args": ["--seed", "1", "--startup-delay-s", "0.5"], "startupTimeoutSeconds": 120},
            "resources": {"accelerator": "gpu", "gpuProduct": PRODUCT},
            "replicas": {"min": minimum, "max": 2, "initial": initial},
            "priority": priority,
            "warmup": {"requests": [{"kind": "completion", "prompt": "warm", "maxTokens": 4}],
                       "requestTimeoutSeconds": 60},
        },
    }  # fmt: skip
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def test_a_higher_priority_minimum_preempts_a_replica_drained_through_the_router_first(sim_fleet_up, tmp_path,
                                                                                      monkeypatch):  # fmt: skip
    two_gpus = {**pcie_4gpu(PRODUCT), "devices": pcie_4gpu(PRODUCT)["devices"][:2]}
    monkeypatch.setenv("PYTHONPATH", f"{DRIVER_DIR}{os.pathsep}{REPO}")       # `fleet up` sees two GPUs
    monkeypatch.setenv("FLEET_FAKE_NVML", str(write_state(tmp_path / "nvml-state.json", two_gpus)))
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "all")
    batch = deployment(tmp_path, "batch", priority=0, minimum=1, initial=2)
    chat = deployment(tmp_path, "chat", priority=100, minimum=0, initial=0)
    fleet = sim_fleet_up([batch, chat])
    fleet.wait_for("both batch replicas READY on the two GPUs", lambda: all_ready(fleet, 2), timeout_s=120)
    gpus = {r["id"]: r["assignment"] for r in fleet.replicas().values()}
    assert sorted(gpus) == ["batch-0", "batch-1"] and len(set(gpus.values())) == 2, gpus

    with OpenLoopLoad(fleet.router_url, "batch-model") as load:
        load.wait_for_more(20, "load on batch before the preemption")
        deployment(tmp_path, "chat", priority=100, minimum=1, initial=1)
        applied = fleet.cli("apply", str(chat))
        assert applied.returncode == 0, applied.stdout + applied.stderr
        fleet.wait_for("chat-0 READY", lambda: fleet.status_of("chat-0") == "READY", timeout_s=120)
        load.wait_for_more(20, "load on batch after the preemption")
    assert load.failed == [], load.failed[:10]                      # drained through the router first

    replicas = fleet.replicas()
    victim = replicas["batch-1"]                                    # the newest of equals
    assert victim["status"] == "TERMINATED" and victim["preempted_for"] == "chat"
    assert victim["drain_reason"].startswith("preempted for chat (priority 100 > 0)")
    assert replicas["chat-0"]["assignment"] == gpus["batch-1"]      # the GPU it freed
    assert replicas["batch-0"]["status"] == "READY"                # batch keeps its minimum
    waiting = replicas["batch-2"]
    assert waiting["status"] == "PENDING" and "freed for higher-priority chat are held off" in waiting["waiting_reason"]
    assert "DRAINING" in fleet.output() and "preempted for chat" in fleet.output()   # the event, as printed
    answer = httpx.post(f"{fleet.router_url}/v1/completions", json={"model": "chat-model", "prompt": "hi",
                                                                     "max_tokens": 4}, timeout=30)  # fmt: skip
    assert answer.status_code == 200, answer.text
    status = fleet.cli("status")
    assert status.returncode == 0 and "Preemptions (latest)" in status.stdout, status.stdout
    assert "preempted for chat" in status.stdout
    stop_cleanly(fleet, fleet.state_dir)
