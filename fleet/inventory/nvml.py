"""Discovery of this machine's GPUs through NVML (`nvidia-ml-py`).

Owns `PynvmlReader`, the only class that calls the NVML library, and `node_from_nvml`, the pure
function that turns what it read into a `NodeInventory`: GPUs (product, memory, UUID, PCIe
link), MIG mode and instances (with their placement), NVLink domains (built from each link's
remote end), multi-node NVLink fabric membership, and health (uncorrected ECC, row remapping,
clock event reasons, temperature). Called by `fleet up` (through `discover_local`) and by
`fleet inventory --discover`.

The reader returns an *NVML snapshot*: plain JSON-ready dicts in the format of the readings in
fleet/testing/data/h100-80gb-hbm3.json (one real H100), extended with ``nvlinks``, ``mig_instances`` and
``fabric``. A reading NVML answered with an error is ``{"error": "<NVML error>"}``. Unit tests
fake the reader with such snapshots (tests/support/fake_nvml.py).
"""

from __future__ import annotations

import os
import re
from typing import Any, Protocol

from fleet.engines.cuda import parse_cuda_version
from fleet.inventory.model import Gpu, GpuHealth, MigInstance, NodeInventory

Snapshot = dict[str, Any]


class NvmlReader(Protocol):
    """Reads everything discovery needs from NVML in one call."""

    def snapshot(self) -> Snapshot:
        """``{"driver_version": str, "cuda_driver_version": int, "devices": [device dict, ...]}``.

        Raises RuntimeError when NVML is unavailable (no driver, no GPU, library missing).
        """
        ...


class PynvmlReader:
    """NVML through nvidia-ml-py. Every call into the library is in this class.

    ``pynvml`` may be injected (tests pass a stand-in module); by default the installed one is
    imported on first use. Each reading is guarded on its own: a GPU or driver that does not
    support one (NVLink on a single-GPU VM, fabric info before Hopper) yields
    ``{"error": ...}`` for that reading only.
    """

    def __init__(self, pynvml: Any = None) -> None:
        self._nvml = pynvml

    def _lib(self) -> Any:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as err:  # nvidia-ml-py is a dependency; a broken install lands here
                raise RuntimeError(f"nvidia-ml-py not importable: {err}") from err
            self._nvml = pynvml
        return self._nvml

    def snapshot(self) -> Snapshot:
        nv = self._lib()
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            raise RuntimeError(f"NVML unavailable: {err}") from err
        try:
            return {
                "driver_version": self._read(nv.nvmlSystemGetDriverVersion),
                "cuda_driver_version": self._read(nv.nvmlSystemGetCudaDriverVersion),   # 13000: CUDA 13.0
                "devices": [self._device(nv, i) for i in range(nv.nvmlDeviceGetCount())],
            }
        finally:
            nv.nvmlShutdown()

    def _read(self, fn, *args) -> Any:
        nv = self._lib()
        try:
            value = fn(*args)
        except nv.NVMLError as err:
            return {"error": str(err)}
        return value.decode() if isinstance(value, bytes) else value

    def _device(self, nv: Any, index: int) -> dict:
        h = nv.nvmlDeviceGetHandleByIndex(index)
        read = self._read
        mem = read(nv.nvmlDeviceGetMemoryInfo, h)
        pci = read(nv.nvmlDeviceGetPciInfo, h)
        mig = read(nv.nvmlDeviceGetMigMode, h)
        rows = read(nv.nvmlDeviceGetRemappedRows, h)
        events = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        dev = {
            "index": index,
            "name": read(nv.nvmlDeviceGetName, h),
            "uuid": read(nv.nvmlDeviceGetUUID, h),
            "pci_bus_id": _bus_id(pci.busId) if not _err(pci) else pci,
            "memory_total_mib": mem.total // (1024 * 1024) if not _err(mem) else mem,
            "mig_mode": {"current": mig[0], "pending": mig[1]} if not _err(mig) else mig,
            "pcie": {
                "gen_current": read(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "gen_max": read(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "width_current": read(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                "width_max": read(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            },
            "temperature_c": read(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
            "temperature_slowdown_c": read(
                nv.nvmlDeviceGetTemperatureThreshold, h, nv.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
            "clocks_event_reasons": read(events, h),
            "ecc_volatile_uncorrected": read(
                nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            "remapped_rows": (
                {"correctable": rows[0], "uncorrectable": rows[1], "pending": rows[2], "failure": rows[3]}
                if not _err(rows) else rows
            ),
            "nvlinks": self._nvlinks(nv, h),
            "fabric": self._fabric(nv, h),
        }
        if not _err(mig) and mig[0] == nv.NVML_DEVICE_MIG_ENABLE:
            dev["mig_instances"] = self._mig_instances(nv, h)
        return dev

    def _nvlinks(self, nv: Any, h: Any) -> list[dict] | dict:
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
            except nv.NVMLError as err:
                if link == 0:
                    return {"error": str(err)}   # no NVLink on this GPU at all
                break                            # past the last link this GPU has
            kind = self._read(nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            remote = self._read(nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link)
            links.append({
                "link": link,
                "remote_type": {nv.NVML_NVLINK_DEVICE_TYPE_GPU: "gpu", nv.NVML_NVLINK_DEVICE_TYPE_SWITCH: "switch"}.get(
                    kind, "unknown") if not _err(kind) else "unknown",
                "remote_pci_bus_id": _bus_id(remote.busId) if not _err(remote) else None,
            })
        return links

    def _fabric(self, nv: Any, h: Any) -> dict:
        try:   # multi-node NVLink (GB200 NVL72 and the like); Hopper and later
            info = nv.c_nvmlGpuFabricInfoV_t()
            nv.nvmlDeviceGetGpuFabricInfoV(h, nv.byref(info))
        except (nv.NVMLError, AttributeError) as err:
            return {"error": str(err)}
        return {
            "cluster_uuid": bytes(info.clusterUuid).hex(),
            "clique_id": int(info.cliqueId),
            "completed": int(info.state) == nv.NVML_GPU_FABRIC_STATE_COMPLETED,
        }

    def _mig_instances(self, nv: Any, h: Any) -> list[dict]:
        out = []
        for j in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
            except nv.NVMLError:
                continue   # unused MIG device slot
            inst = {"uuid": self._read(nv.nvmlDeviceGetUUID, m), "name": self._read(nv.nvmlDeviceGetName, m)}
            try:
                gi_id = nv.nvmlDeviceGetGpuInstanceId(m)
                info = nv.nvmlGpuInstanceGetInfo(nv.nvmlDeviceGetGpuInstanceById(h, gi_id))
                inst.update(gi_id=gi_id, profile_id=int(info.profileId),
                            start=int(info.placement.start), size=int(info.placement.size))
            except nv.NVMLError:
                pass   # placement needs privileges on some drivers; the profile name is enough to place
            out.append(inst)
        return out


def _err(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value


def _bus_id(raw: Any) -> str:
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.lower()


def _int(value: Any, default: int | None = None) -> int | None:
    return default if value is None or _err(value) else int(value)


# MIG device names carry the profile: "NVIDIA H100 80GB HBM3 MIG 3g.40gb".
_MIG_NAME = re.compile(r"MIG\s+([1-7]g\.[0-9]+gb(?:\+me)?)")


def _mig_profile(name: str) -> str | None:
    match = _MIG_NAME.search(name)
    return match.group(1) if match else None


def node_from_nvml(snapshot: Snapshot, node_name: str, cpu_cores: tuple[int, ...] = (),
                   labels: dict[str, str] | None = None) -> NodeInventory:
    """Build a node's inventory from an NVML snapshot. Pure.

    NVLink domains are the connected components of the NVLink graph: a link whose remote end is
    a GPU of this node joins the two; every GPU with a link to an NVSwitch joins the node's
    switch fabric (HGX boards wire every GPU to every switch). Only domains of two or more GPUs
    are listed; a GPU with no active link is alone (and the topology is known: ``()`` when no
    GPU has NVLink). The multi-node fabric (``nvlink_fabric``) is ``<clusterUuid>.<cliqueId>`` when NVML
    reports a completed fabric registration with a non-zero cluster UUID, as GFD's
    ``nvidia.com/gpu.clique`` label does. The driver (``driver_version``) and the newest CUDA it
    supports (``cuda_driver_version``, 13000 -> (13, 0)) are left None when NVML did not answer.
    """
    devices = snapshot.get("devices", [])
    gpus: list[Gpu] = []
    for d in devices:
        pcie = d.get("pcie") if isinstance(d.get("pcie"), dict) else {}
        rows = d.get("remapped_rows") if not _err(d.get("remapped_rows")) else {}
        mig_mode = d.get("mig_mode") if not _err(d.get("mig_mode")) else {}
        mig_enabled = bool((mig_mode or {}).get("current"))
        migs = []
        for m in d.get("mig_instances", []) if mig_enabled else []:
            profile = m.get("profile") or _mig_profile(str(m.get("name", "")))
            if profile and not _err(m.get("uuid")):
                migs.append(MigInstance(uuid=m["uuid"], profile=profile, parent_uuid=d["uuid"], start=m.get("start")))
        gpus.append(Gpu(
            index=int(d["index"]),
            uuid=d["uuid"],
            product=d["name"],
            memory_mib=int(d["memory_total_mib"]),
            mig_enabled=mig_enabled,
            mig_instances=tuple(migs),
            health=GpuHealth(
                ecc_uncorrected=_int(d.get("ecc_volatile_uncorrected"), 0),
                row_remap_pending=bool((rows or {}).get("pending")),
                row_remap_failure=bool((rows or {}).get("failure")),
                clock_event_reasons=_int(d.get("clocks_event_reasons"), 0),
                temperature_c=_int(d.get("temperature_c")),
                slowdown_temperature_c=_int(d.get("temperature_slowdown_c")),
            ),
            pci_bus_id=d.get("pci_bus_id") if isinstance(d.get("pci_bus_id"), str) else None,
            pcie_gen=_int(pcie.get("gen_current")),
            pcie_width=_int(pcie.get("width_current")),
        ))
    return NodeInventory(
        name=node_name,
        gpus=tuple(gpus),
        cpu_cores=cpu_cores,
        labels=dict(labels or {}),
        nvlink_domains=_nvlink_domains(devices),
        nvlink_fabric=_fabric_id(devices),
        driver_version=driver if isinstance(driver := snapshot.get("driver_version"), str) and driver else None,
        cuda_driver_version=_cuda(snapshot.get("cuda_driver_version")),
    )


def _cuda(value: Any) -> tuple[int, int] | None:
    """NVML's CUDA driver version (1000 x major + 10 x minor) as (major, minor); None for an error."""
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    try:
        return parse_cuda_version(value)
    except ValueError:
        return None


def _nvlink_domains(devices: list[dict]) -> tuple[tuple[int, ...], ...]:
    parent = {int(d["index"]): int(d["index"]) for d in devices}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(a: int, b: int) -> None:
        parent[find(a)] = find(b)

    by_bus = {str(d.get("pci_bus_id", "")).lower(): int(d["index"]) for d in devices}
    on_switch = []
    for d in devices:
        links = d.get("nvlinks")
        if not isinstance(links, list):
            continue
        for link in links:
            if link.get("remote_type") == "switch":
                on_switch.append(int(d["index"]))
            elif link.get("remote_type") == "gpu":
                peer = by_bus.get(str(link.get("remote_pci_bus_id", "")).lower())
                if peer is not None:
                    union(int(d["index"]), peer)
    for i in on_switch[1:]:
        union(on_switch[0], i)
    groups: dict[int, list[int]] = {}
    for i in parent:
        groups.setdefault(find(i), []).append(i)
    return tuple(sorted(tuple(sorted(g)) for g in groups.values() if len(g) > 1))


def _fabric_id(devices: list[dict]) -> str | None:
    for d in devices:
        f = d.get("fabric")
        if isinstance(f, dict) and f.get("completed") and f.get("cluster_uuid", "").strip("0"):
            return f"{f['cluster_uuid']}.{f['clique_id']}"
    return None


def discover_local(nvml: NvmlReader | None = None, node_name: str = "local") -> NodeInventory:
    """Inventory of this machine: GPUs through NVML, CPU cores from this process's affinity.

    A machine without NVML (no driver, no GPU) has no GPUs.
    """
    try:
        snap = (nvml or PynvmlReader()).snapshot()
    except RuntimeError:
        snap = {"devices": []}
    cores = tuple(sorted(os.sched_getaffinity(0)))
    return node_from_nvml(snap, node_name, cpu_cores=cores)
