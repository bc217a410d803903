"""The node agent's per-GPU usage series under DCGM exporter's names (fleet/agent/runner.py,
fleet/agent/nvml_health.py ``_usage``), read through the stand-in NVML with the figures of a real
H200 reading (fleet/testing/data/h200.json ``raw``), and the GPU -> replica labels `fleet up` gives
them (fleet/local/backend.py ``gpu_replicas``)."""

from __future__ import annotations

import json
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from fleet.agent.health import GpuHealthChecker
from fleet.agent.nvml_health import NvmlHealthReader
from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy
from fleet.agent.runner import NodeAgent
from tests.support.fake_nvml import FakePynvml, nvswitch_8gpu

H200_RAW = json.loads((Path(__file__).parents[2] / "fleet/testing/data/h200.json").read_text())["raw"]["devices"][0]


def _series(registry: CollectorRegistry, name: str) -> dict[str, float]:
    out = {}
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(name + "{"):
            labels, value = line.rsplit(" ", 1)
            out[labels[len(name):]] = float(value)
    return out


def test_usage_is_exported_under_dcgm_names_with_the_replica_each_gpu_serves() -> None:
    clock = lambda: 1000.0   # noqa: E731
    fake = FakePynvml(nvswitch_8gpu())
    # GPU 0 as the H200 read on the lent device: idle, 615 MiB used, 82,890 mW.
    fake.inject(0, utilization=H200_RAW["utilization"], memory_used_mib=H200_RAW["memory_used_mib"],
                power_usage_mw=H200_RAW["power_usage_mw"])  # fmt: skip
    fake.inject(1, utilization={"gpu": 87, "memory": 41}, memory_used_mib=72_000, power_usage_mw=612_345)
    fake.inject(2, power_usage_mw={"error": "Not Supported"})
    uuids = [d["uuid"] for d in fake.snap["devices"]]
    registry = CollectorRegistry()
    agent = NodeAgent("node-a", GpuHealthChecker(NvmlHealthReader(fake), clock),
                      QuarantinePolicy(QuarantineConfig(), clock), clock, registry=registry,
                      serving=lambda: {uuids[1]: ("llama-8b", "llama-8b-3")})  # fmt: skip
    agent.step()
    name = fake.snap["devices"][1]["name"]
    util = _series(registry, "DCGM_FI_DEV_GPU_UTIL")
    assert len(util) == 8
    assert util[f'{{Hostname="node-a",UUID="{uuids[1]}",deployment="llama-8b",gpu="1",modelName="{name}",'
                f'replica="llama-8b-3"}}'] == 87.0
    assert util[f'{{Hostname="node-a",UUID="{uuids[0]}",deployment="",gpu="0",modelName="{name}",replica=""}}'] == 0.0
    power = {k.split('UUID="')[1].split('"')[0]: v for k, v in _series(registry, "DCGM_FI_DEV_POWER_USAGE").items()}
    assert power[uuids[0]] == 82.89 and power[uuids[1]] == 612.345
    assert uuids[2] not in power and len(power) == 7   # NVML did not answer: no series, not a zero
    fb = {k.split('UUID="')[1].split('"')[0]: v for k, v in _series(registry, "DCGM_FI_DEV_FB_USED").items()}
    assert fb[uuids[0]] == 615.0 and fb[uuids[1]] == 72_000.0

    agent.serving = lambda: {}                       # the replica stopped: its labels go with it
    fake.inject(2, lost=True)
    agent.step()
    util = _series(registry, "DCGM_FI_DEV_GPU_UTIL")
    assert len(util) == 7 and all('replica=""' in k for k in util)   # a lost GPU has no usage


def test_a_failing_serving_lookup_is_counted_and_the_step_goes_on() -> None:
    clock = lambda: 1000.0   # noqa: E731

    def broken() -> dict[str, tuple[str, str]]:
        raise RuntimeError("records moved")

    registry = CollectorRegistry()
    agent = NodeAgent("node-a", GpuHealthChecker(NvmlHealthReader(FakePynvml(nvswitch_8gpu())), clock),
                      QuarantinePolicy(QuarantineConfig(), clock), clock, registry=registry, serving=broken)
    agent.step()
    assert agent.last_error == "usage: RuntimeError: records moved"
    assert _series(registry, "fleet_node_agent_check_errors_total") == {'{node="node-a"}': 1.0}
    assert _series(registry, "fleet_gpu_quarantined")   # the health part still ran


def test_fleet_up_labels_each_gpu_with_the_live_replicas_placed_on_it(tmp_path: Path) -> None:
    from fleet.inventory.nvml import node_from_nvml
    from fleet.local.backend import LocalBackend, _Record
    from tests.support.fake_nvml import mig_h100

    node = node_from_nvml(mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)], []]), "n")
    mig_gpu = next(g for g in node.gpus if g.mig_instances)
    whole = next(g for g in node.gpus if not g.mig_instances)
    a, b = mig_gpu.mig_instances[:2]
    backend = LocalBackend(tmp_path / "state", "fleet-u", node)

    def record(rid: str, deployment: str, devices: list[str], exited: bool = False) -> _Record:
        return _Record(rid, deployment, "h", "n", "127.0.0.1", 1, None, exited=exited,
                       placement={"product": None, "members": [{"node": "n", "devices": devices}]})

    for rec in (record("chat-0", "chat", [whole.uuid]), record("small-0", "small", [a.uuid]),
                record("tiny-0", "tiny", [b.uuid]), record("chat-1", "chat", ["GPU-gone"], exited=True)):
        backend._records[rec.replica_id] = rec
    got = backend.gpu_replicas()
    assert got[whole.uuid] == ("chat", "chat-0")
    assert got[a.uuid] == ("small", "small-0") and got[b.uuid] == ("tiny", "tiny-0")
    assert got[mig_gpu.uuid] == ("small,tiny", "small-0,tiny-0")   # the GPU its MIG instances share
    assert "GPU-gone" not in got                                    # an exited replica serves nothing
