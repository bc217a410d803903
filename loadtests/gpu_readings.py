"""NVML discovery and the node agent's GPU health checks on a real GPU, timed, without a Fleet install.

Runs `fleet.inventory.nvml.PynvmlReader` discovery, then `fleet.agent.health.GpuHealthChecker`
over `fleet.agent.nvml_health.NvmlHealthReader` three times a second apart; prints the snapshot,
the findings and the time of each step as JSON, and writes it to ``$OUT/health.json``. Needs only
the standard library and nvidia-ml-py, so it runs on a bare GPU machine:

    pip install --target .devicelib nvidia-ml-py    # on a machine with the package index
    python3 loadtests/gpu_readings.py                # on the GPU machine, from the repository root

What it printed on an NVIDIA H200 is kept in fleet/testing/data/h200-health.json and
docs/node-agent.md ("Tests and the real GPU").
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.getcwd(), ".devicelib"))   # nvidia-ml-py installed with --target
sys.path.insert(1, os.getcwd())

from fleet.agent.health import GpuHealthChecker  # noqa: E402
from fleet.agent.nvml_health import NvmlHealthReader  # noqa: E402
from fleet.inventory.nvml import PynvmlReader, node_from_nvml  # noqa: E402


def main() -> None:
    out: dict = {}
    t0 = time.perf_counter()
    snap = PynvmlReader().snapshot()
    out["discovery_s"] = round(time.perf_counter() - t0, 4)
    out["snapshot"] = snap
    node = node_from_nvml(snap, "gpu-node")
    out["node"] = node.describe()
    checker = GpuHealthChecker(NvmlHealthReader(), time.time)
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        findings = checker.check()
        events = checker.poll_events()
        runs.append({"check_s": round(time.perf_counter() - t0, 4), "xid_events": events,
                     "findings": [f.as_dict() for f in findings]})
        time.sleep(1)
    out["checks"] = runs
    out["last_reading"] = checker.last_reading
    print(json.dumps(out, indent=1, default=str))
    folder = os.environ.get("OUT", ".")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "health.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
