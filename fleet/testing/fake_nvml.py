"""A STAND-IN for NVML (the NVIDIA driver's management library, through nvidia-ml-py's `pynvml`):
snapshots of nodes and a stand-in `pynvml`, for the tests, the benchmarks and the cluster in a box.

- `real_h100_snapshot()`: the real readings of one H100 80GB HBM3 (fleet/testing/data, recorded on
  a real machine), the reference every synthetic device below imitates.
- Synthetic nodes: `nvswitch_8gpu` (HGX: every GPU linked to the NVSwitches), `partial_nvlink_8gpu`
  (two islands of four GPUs with direct links), `nvlink_pairs_4gpu` (two NVLink pairs joined by
  PCIe), `pcie_4gpu` (no NVLink), `mig_h100`, and health variants.
- `FakeNvml`: the `NvmlReader` wrapper faked (what discovery tests use).
- Re-exported from the driver directory, where their one implementation lives (stdlib only, so a
  container reads it whatever its image carries: fleet/testing/nvml_driver/fleet_nvml_stand_in.py):
  `FakePynvml`, a stand-in for the `pynvml` module itself, built from a snapshot, so the real
  `PynvmlReader` and `NvmlHealthReader` run without a GPU (every name it defines must exist in
  nvidia-ml-py: tests/unit/test_inventory_nvml.py checks); `FileNvml`, `FakePynvml` over a node's
  JSON state file, what fleet/testing/nvml_driver/pynvml.py (the per-node "driver") serves as the
  module; the file's writers `write_state`, `inject_xid` and `update_device`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from fleet.testing.nvml_driver.fleet_nvml_stand_in import (  # noqa: F401 - re-exported
    FAKE_NVML_ENV, NVML_ERROR_GPU_IS_LOST, NVML_ERROR_LIBRARY_NOT_FOUND, NVML_ERROR_NOT_FOUND, NVML_ERROR_TIMEOUT,
    FakeNVMLError, FakePynvml, FileNvml, inject_xid, update_device, write_state,
)

DATA = Path(__file__).resolve().parent / "data"
H100 = "NVIDIA H100 80GB HBM3"
A100_80 = "NVIDIA A100-SXM4-80GB"


def real_h100_snapshot() -> dict:
    return json.loads((DATA / "h100-80gb-hbm3.json").read_text())


def real_h200_snapshot() -> dict:
    """NVML as read on a real NVIDIA H200 (fleet/testing/data/h200.json; see its ``_about``)."""
    return json.loads((DATA / "h200.json").read_text())


def device(index: int, name: str = H100, memory_mib: int = 81559, nvlinks=None, mig_instances=None,
           uuid: str | None = None, **overrides) -> dict:
    """One device dict shaped like the real H100 reading (same keys and healthy values)."""
    real = real_h100_snapshot()["devices"][0]
    d = copy.deepcopy(real)
    d.update(
        index=index, name=name, uuid=uuid or f"GPU-{index:08d}-0000-0000-0000-000000000000",
        pci_bus_id=f"00000000:{0x10 + index:02x}:00.0", memory_total_mib=memory_mib,
        nvlinks=nvlinks if nvlinks is not None else {"error": "Not Supported"},
        fabric={"error": "Not Supported"},
    )
    if mig_instances is not None:
        d["mig_mode"] = {"current": 1, "pending": 1}
        d["mig_instances"] = mig_instances
    d.update(overrides)
    return d


def _bus(i: int) -> str:
    return f"00000000:{0x10 + i:02x}:00.0"


def nvswitch_8gpu(name: str = H100, memory_mib: int = 81559) -> dict:
    switches = [f"00000000:{0xa0 + s:02x}:00.0" for s in range(4)]
    return {"driver_version": "580.159.04", "cuda_driver_version": 13000, "devices": [
        device(i, name, memory_mib, nvlinks=[
            {"link": link, "remote_type": "switch", "remote_pci_bus_id": switches[link % 4]} for link in range(18)])
        for i in range(8)
    ]}


def partial_nvlink_8gpu(name: str = A100_80, memory_mib: int = 81920) -> dict:
    """Two NVLink islands, GPUs 0-3 and 4-7, each GPU linked directly to the three others."""
    devices = []
    for i in range(8):
        island = range(0, 4) if i < 4 else range(4, 8)
        peers = [p for p in island if p != i]
        devices.append(device(i, name, memory_mib, nvlinks=[
            {"link": n, "remote_type": "gpu", "remote_pci_bus_id": _bus(p)} for n, p in enumerate(peers)]))
    return {"driver_version": "580.159.04", "cuda_driver_version": 13000, "devices": devices}


def pcie_4gpu(name: str = "NVIDIA L40S", memory_mib: int = 46068) -> dict:
    return {"driver_version": "580.159.04", "cuda_driver_version": 13000,
            "devices": [device(i, name, memory_mib) for i in range(4)]}


def nvlink_pairs_4gpu(name: str = H100, memory_mib: int = 81559) -> dict:
    """Four GPUs as two NVLink pairs, 0-1 and 2-3 (NVLink bridges), the pairs joined only by
    PCIe: a TP=2 replica fits a pair, never across it."""
    pairs = {0: 1, 1: 0, 2: 3, 3: 2}
    return {"driver_version": "580.159.04", "cuda_driver_version": 13000, "devices": [
        device(i, name, memory_mib, nvlinks=[
            {"link": n, "remote_type": "gpu", "remote_pci_bus_id": _bus(pairs[i])} for n in range(4)])
        for i in range(4)
    ]}


def mig_h100(geometries: list[list[tuple[str, int]]]) -> dict:
    """H100s in MIG mode, one per geometry: [(profile, start), ...]."""
    devices = []
    for i, geometry in enumerate(geometries):
        devices.append(device(i, mig_instances=[
            {"uuid": f"MIG-{i}-{j}", "name": f"{H100} MIG {profile}", "gi_id": j + 1, "start": start}
            for j, (profile, start) in enumerate(geometry)
        ]))
    return {"driver_version": "580.159.04", "cuda_driver_version": 13000, "devices": devices}


class FakeNvml:
    """The `NvmlReader` wrapper, faked: returns a copy of a snapshot, or fails like a machine
    without a driver."""

    def __init__(self, snapshot: dict | None) -> None:
        self._snapshot = snapshot
        self.calls = 0

    def snapshot(self) -> dict:
        self.calls += 1
        if self._snapshot is None:
            raise RuntimeError("NVML unavailable: NVML Shared Library Not Found")
        return copy.deepcopy(self._snapshot)
