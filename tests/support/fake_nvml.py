"""Fake NVML for discovery tests: snapshots and a stand-in `pynvml` module.

- `real_h100_snapshot()`: the real readings of one H100 80GB HBM3 (tests/data, copied as is from
  shared/hardware/), the reference every synthetic device below imitates.
- Synthetic nodes: `nvswitch_8gpu` (HGX: every GPU linked to the NVSwitches), `partial_nvlink_8gpu`
  (two islands of four GPUs with direct links), `pcie_4gpu` (no NVLink), and MIG / health variants.
- `FakeNvml`: the `NvmlReader` wrapper faked (what discovery tests use).
- `FakePynvml`: a stand-in for the `pynvml` module itself, built from a snapshot, so the real
  `PynvmlReader` can be run without a GPU; every name it defines must exist in nvidia-ml-py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

DATA = Path(__file__).resolve().parents[1] / "data"
H100 = "NVIDIA H100 80GB HBM3"
A100_80 = "NVIDIA A100-SXM4-80GB"


def real_h100_snapshot() -> dict:
    return json.loads((DATA / "h100-80gb-hbm3.json").read_text())


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
    return {"driver_version": "580.159.04", "devices": [
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
    return {"driver_version": "580.159.04", "devices": devices}


def pcie_4gpu(name: str = "NVIDIA L40S", memory_mib: int = 46068) -> dict:
    return {"driver_version": "580.159.04", "devices": [device(i, name, memory_mib) for i in range(4)]}


def mig_h100(geometries: list[list[tuple[str, int]]]) -> dict:
    """H100s in MIG mode, one per geometry: [(profile, start), ...]."""
    devices = []
    for i, geometry in enumerate(geometries):
        devices.append(device(i, mig_instances=[
            {"uuid": f"MIG-{i}-{j}", "name": f"{H100} MIG {profile}", "gi_id": j + 1, "start": start}
            for j, (profile, start) in enumerate(geometry)
        ]))
    return {"driver_version": "580.159.04", "devices": devices}


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


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: ``value`` is the NVML return code."""

    def __init__(self, message: str = "Unknown Error", value: int = 999) -> None:
        super().__init__(message)
        self.value = value


NVML_ERROR_TIMEOUT = 10
NVML_ERROR_GPU_IS_LOST = 15


class FakePynvml:
    """Enough of nvidia-ml-py's `pynvml` module, answering from a snapshot.

    Readings that are ``{"error": ...}`` in the snapshot raise NVMLError, like NVML's
    NotSupported answers on the real machine.
    """

    NVMLError = FakeNVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2
    NVML_GPU_FABRIC_STATE_COMPLETED = 3
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    nvmlEventTypeXidCriticalError = 0x8
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_P2P_CAPS_INDEX_NVLINK = 2

    def __init__(self, snapshot: dict) -> None:
        self.snap = snapshot
        self.initialized = 0
        self._pristine = copy.deepcopy(snapshot)
        self.events: list[SimpleNamespace] = []
        self.registered: set[int] = set()

    # -- fault injection (health tests) -----------------------------------------------------------
    def inject(self, index: int, **readings) -> None:
        """Overwrite readings of GPU ``index``, e.g. ``inject(1, ecc_volatile_uncorrected=2)``,
        ``inject(0, pcie={...})``, ``inject(2, lost=True)``, ``inject(3, nvlink_errors={"0": {...}})``."""
        self.snap["devices"][index].update(readings)

    def heal(self, index: int) -> None:
        """GPU ``index`` back to its readings at construction (a reset, a replaced part)."""
        self.snap["devices"][index] = copy.deepcopy(self._pristine["devices"][index])

    def inject_xid(self, index: int, xid: int, gpu_instance_id: int | None = None) -> None:
        """Queue an Xid event as NVML's event set delivers it (only for registered GPUs)."""
        if index in self.registered:
            self.events.append(SimpleNamespace(
                device=index, eventType=self.nvmlEventTypeXidCriticalError, eventData=xid,
                gpuInstanceId=0xFFFFFFFF if gpu_instance_id is None else gpu_instance_id, computeInstanceId=0))

    # -- helpers ---------------------------------------------------------------------------------
    def _dev(self, h):
        d = self.snap["devices"][h] if isinstance(h, int) else h["mig"]
        if d.get("lost"):
            raise FakeNVMLError("GPU is lost", NVML_ERROR_GPU_IS_LOST)
        return d

    def _value(self, value):
        if isinstance(value, dict) and "error" in value:
            raise FakeNVMLError(value["error"])
        return value

    # -- the library -----------------------------------------------------------------------------
    def nvmlInit(self):
        self.initialized += 1

    def nvmlShutdown(self):
        self.initialized -= 1

    def nvmlSystemGetDriverVersion(self):
        return self.snap["driver_version"]

    def nvmlDeviceGetCount(self):
        return len(self.snap["devices"])

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self._dev(h)["name"]

    def nvmlDeviceGetUUID(self, h):
        return self._dev(h)["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self._dev(h)["pci_bus_id"].encode())

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=self._dev(h)["memory_total_mib"] * 1024 * 1024)

    def nvmlDeviceGetMigMode(self, h):
        m = self._value(self._dev(h)["mig_mode"])
        return [m["current"], m["pending"]]

    def nvmlDeviceGetRemappedRows(self, h):
        r = self._value(self._dev(h)["remapped_rows"])
        return (r["correctable"], r["uncorrectable"], r["pending"], r["failure"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        return self._value(self._dev(h)["clocks_event_reasons"])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._dev(h)["pcie"]["gen_current"]

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._dev(h)["pcie"]["gen_max"]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._dev(h)["pcie"]["width_current"]

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._dev(h)["pcie"]["width_max"]

    def nvmlDeviceGetTemperature(self, h, sensor):
        return self._value(self._dev(h)["temperature_c"])

    def nvmlDeviceGetTemperatureThreshold(self, h, threshold):
        return self._value(self._dev(h).get("temperature_slowdown_c", {"error": "Not Supported"}))

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):
        return self._value(self._dev(h)["ecc_volatile_uncorrected"])

    def _links(self, h):
        d = self._dev(h)
        # The real H100 reading recorded only link 0's answer (NotSupported).
        return self._value(d["nvlinks"] if "nvlinks" in d else d.get("nvlink_state_link0", []))

    def nvmlDeviceGetNvLinkState(self, h, link):
        links = self._links(h)
        if link >= len(links):
            raise FakeNVMLError("Invalid Argument")
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h, link):
        return {"gpu": 0, "switch": 2}[self._links(h)[link]["remote_type"]]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return SimpleNamespace(busId=self._links(h)[link]["remote_pci_bus_id"].encode())

    def c_nvmlGpuFabricInfoV_t(self):
        return SimpleNamespace(clusterUuid=bytes(16), cliqueId=0, state=0)

    def byref(self, obj):
        return obj

    def nvmlDeviceGetGpuFabricInfoV(self, h, info):
        f = self._value(self._dev(h).get("fabric", {"error": "Not Supported"}))
        info.clusterUuid = bytes.fromhex(f["cluster_uuid"])
        info.cliqueId = f["clique_id"]
        info.state = 3 if f["completed"] else 1

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7 if self._dev(h).get("mig_instances") is not None else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        instances = self._dev(h).get("mig_instances", [])
        if j >= len(instances):
            raise FakeNVMLError("Not Found")
        return {"mig": instances[j], "parent": h}

    def nvmlDeviceGetGpuInstanceId(self, m):
        return m["mig"]["gi_id"]

    def nvmlDeviceGetGpuInstanceById(self, h, gi_id):
        return next(m for m in self._dev(h)["mig_instances"] if m["gi_id"] == gi_id)

    # -- health readings and events ---------------------------------------------------------------
    def nvmlDeviceGetRetiredPages(self, h, cause):
        return list(self._value(self._dev(h).get("retired_pages_dbe", {"error": "Not Supported"})))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        return self._value(self._dev(h).get("retired_pages_pending", {"error": "Not Supported"}))

    def nvmlDeviceGetNvLinkErrorCounter(self, h, link, counter):
        names = {0: "replay", 1: "recovery", 2: "crc_flit", 3: "crc_data"}
        return self._dev(h).get("nvlink_errors", {}).get(str(link), {}).get(names[counter], 0)

    def nvmlDeviceGetP2PStatus(self, h1, h2, cap):
        return self._dev(h1).get("p2p_nvlink", {}).get(str(h2), 0)

    def nvmlDeviceGetCpuAffinity(self, h, words):
        cores = self._dev(h).get("cpu_affinity", list(range(16)))   # the real H100: "CPU affinity 0-15"
        mask = [0] * words
        for c in cores:
            mask[c // 64] |= 1 << (c % 64)
        return mask

    def nvmlEventSetCreate(self):
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h, types, event_set):
        self._dev(h)
        self.registered.add(h)

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        if not self.events:
            raise FakeNVMLError("Timeout", NVML_ERROR_TIMEOUT)
        return self.events.pop(0)

    def nvmlEventSetFree(self, event_set):
        pass

    def nvmlGpuInstanceGetInfo(self, gi):
        return SimpleNamespace(profileId=0, placement=SimpleNamespace(start=gi["start"], size=0))
