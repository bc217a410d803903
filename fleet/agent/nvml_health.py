"""NVML readings for GPU health: the only module that calls NVML for the node agent.

Owns `NvmlHealthReader`: opens NVML once, registers every GPU for Xid events
(``nvmlDeviceRegisterEvents(nvmlEventTypeXidCriticalError)``), and answers ``read()`` (a
JSON-ready reading of each GPU: volatile uncorrected ECC, row remapping, retired pages, PCIe link
generation and width against their maximum, clock event reasons, NVLink error counters, P2P
status inside NVLink domains, CPU affinity, MIG instances; a GPU that answers
``NVML_ERROR_GPU_IS_LOST`` is ``{"lost": true}``) and ``xid_events()`` (the Xid events queued
since the last call, drained with a zero timeout). Pure interpretation lives in
`fleet.agent.health`. Tests inject fleet/testing/fake_nvml.py's `FakePynvml` as ``pynvml``.

A reading NVML answered with an error is ``{"error": "<NVML error>"}`` (NotSupported on a GPU
without that feature), as in `fleet.inventory.nvml`.
"""

from __future__ import annotations

import os
from typing import Any

Reading = dict[str, Any]

# NVML_NVLINK_ERROR_DL_* counters read per active link.
NVLINK_COUNTERS = {"replay": 0, "recovery": 1, "crc_flit": 2, "crc_data": 3}
_INVALID_INSTANCE = 0xFFFFFFFF


def cores_from_mask(words: Any) -> tuple[int, ...]:
    """CPU cores set in an NVML CPU-affinity bitmask (64-bit words, lowest first). Pure."""
    out = []
    for w, word in enumerate(words):
        word = int(word)
        for bit in range(64):
            if word >> bit & 1:
                out.append(w * 64 + bit)
    return tuple(out)


class NvmlHealthReader:
    """GPU health through nvidia-ml-py. ``pynvml``: the module (tests pass a stand-in).

    ``nvlink_domains``: tuples of GPU indices sharing NVLink (`fleet.inventory.nvml.node_from_nvml`
    computes them); P2P status is read between the GPUs of each.
    """

    def __init__(self, pynvml: Any = None, nvlink_domains: tuple[tuple[int, ...], ...] = ()) -> None:
        self._nv = pynvml
        self.nvlink_domains = nvlink_domains
        self._events: Any = None
        self._handles: list[Any] = []
        self._uuids: dict[int, str] = {}
        self.event_errors: dict[int, str] = {}
        self.opened = False
        self.driver_version: str | None = None                 # "580.159.04", read at open
        self.cuda_driver_version: tuple[int, int] | None = None   # (13, 0): nvmlSystemGetCudaDriverVersion 13000

    def _lib(self) -> Any:
        if self._nv is None:
            try:
                import pynvml
            except ImportError as err:
                raise RuntimeError(f"nvidia-ml-py not importable: {err}") from err
            self._nv = pynvml
        return self._nv

    def open(self) -> None:
        """Initialise NVML and register for Xid events. Raises RuntimeError when NVML is
        unavailable (no driver, no GPU)."""
        nv = self._lib()
        try:
            nv.nvmlInit()
        except nv.NVMLError as err:
            raise RuntimeError(f"NVML unavailable: {err}") from err
        self.opened = True
        # The driver and the CUDA it supports do not change while NVML is open (an upgrade
        # unloads the kernel module): read once, published by the node agent (fleet.k8s.node_facts).
        driver = self._read(nv.nvmlSystemGetDriverVersion)
        self.driver_version = driver if isinstance(driver, str) and driver else None
        cuda = self._read(nv.nvmlSystemGetCudaDriverVersion)
        if isinstance(cuda, int) and not isinstance(cuda, bool) and cuda >= 1000:
            self.cuda_driver_version = (cuda // 1000, cuda % 1000 // 10)
        self._handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        for i, h in enumerate(self._handles):   # remembered: a lost GPU cannot say its UUID any more
            try:
                uuid = self._read(nv.nvmlDeviceGetUUID, h)
            except _GpuLost:
                uuid = None
            if isinstance(uuid, str):
                self._uuids[i] = uuid
        try:
            self._events = nv.nvmlEventSetCreate()
        except nv.NVMLError as err:
            self.event_errors = {i: str(err) for i in range(len(self._handles))}
            return
        for i, h in enumerate(self._handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, self._events)
            except nv.NVMLError as err:   # NotSupported (some vGPU), or lost
                self.event_errors[i] = str(err)

    def close(self) -> None:
        if not self.opened:
            return
        nv = self._lib()
        if self._events is not None:
            try:
                nv.nvmlEventSetFree(self._events)
            except nv.NVMLError:
                pass
            self._events = None
        nv.nvmlShutdown()
        self.opened = False

    def _lost(self, err: Exception) -> bool:
        return getattr(err, "value", None) == self._lib().NVML_ERROR_GPU_IS_LOST

    def _read(self, fn, *args) -> Any:
        nv = self._lib()
        try:
            value = fn(*args)
        except nv.NVMLError as err:
            if self._lost(err):
                raise _GpuLost(str(err)) from None
            return {"error": str(err)}
        return value.decode() if isinstance(value, bytes) else value

    def read(self) -> Reading:
        """``{"devices": [device reading, ...]}`` (see the module docstring)."""
        devices = []
        for i, h in enumerate(self._handles):
            try:
                devices.append(self._device(i, h))
            except _GpuLost as err:
                devices.append({"index": i, "uuid": self._uuids.get(i, f"gpu-index-{i}"), "lost": True,
                                "error": str(err)})
        by_index = {d["index"]: d for d in devices}
        for domain in self.nvlink_domains:
            for a in domain:
                if by_index.get(a, {}).get("lost"):
                    continue
                by_index[a]["p2p_nvlink"] = {
                    str(b): self._p2p(a, b) for b in domain if b != a and not by_index.get(b, {}).get("lost")}
        return {"devices": devices}

    def _p2p(self, a: int, b: int) -> Any:
        nv = self._lib()
        try:
            return self._read(nv.nvmlDeviceGetP2PStatus, self._handles[a], self._handles[b], nv.NVML_P2P_CAPS_INDEX_NVLINK)
        except _GpuLost as err:
            return {"error": str(err)}

    def _device(self, index: int, h: Any) -> Reading:
        nv, read = self._lib(), self._read
        rows = read(nv.nvmlDeviceGetRemappedRows, h)
        events = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        retired = read(nv.nvmlDeviceGetRetiredPages, h, nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)
        words = max(1, ((os.cpu_count() or 1) + 63) // 64)
        affinity = read(nv.nvmlDeviceGetCpuAffinity, h, words)
        dev: Reading = {
            "index": index,
            "uuid": read(nv.nvmlDeviceGetUUID, h),
            "name": read(nv.nvmlDeviceGetName, h),
            "ecc_volatile_uncorrected": read(
                nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC),
            "remapped_rows": (
                {"correctable": rows[0], "uncorrectable": rows[1], "pending": rows[2], "failure": rows[3]}
                if not _err(rows) else rows),
            "retired_pages_dbe": len(retired) if not _err(retired) else retired,
            "retired_pages_pending": read(nv.nvmlDeviceGetRetiredPagesPendingStatus, h),
            "pcie": {
                "gen_current": read(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "gen_max": read(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "width_current": read(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                "width_max": read(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            },
            "clocks_event_reasons": read(events, h),
            "nvlink_errors": self._nvlink_errors(h),
            "cpu_affinity": list(cores_from_mask(affinity)) if not _err(affinity) else affinity,
            "mig_instances": self._mig(h),
            **self._usage(h),
        }
        return dev

    def _usage(self, h: Any) -> Reading:
        """What the GPU is doing: ``utilization_gpu_percent`` (nvmlDeviceGetUtilizationRates
        ``.gpu``: % of the last sample period with a kernel running), ``memory_used_mib``
        (nvmlDeviceGetMemoryInfo ``.used``, MiB) and ``power_usage_w`` (nvmlDeviceGetPowerUsage,
        mW -> W). Each is ``{"error": ...}`` where NVML does not answer it. The node agent exports
        them under DCGM exporter's names (fleet/agent/runner.py)."""
        nv, read = self._lib(), self._read
        util = read(nv.nvmlDeviceGetUtilizationRates, h)
        memory = read(nv.nvmlDeviceGetMemoryInfo, h)
        power = read(nv.nvmlDeviceGetPowerUsage, h)
        return {
            "utilization_gpu_percent": util if _err(util) else int(util.gpu),
            "memory_used_mib": memory if _err(memory) else int(memory.used) // (1024 * 1024),
            "power_usage_w": power if _err(power) else int(power) / 1000.0,
        }

    def _nvlink_errors(self, h: Any) -> dict[str, dict[str, Any]] | dict:
        nv = self._lib()
        out: dict[str, dict[str, Any]] = {}
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                if nv.nvmlDeviceGetNvLinkState(h, link) != nv.NVML_FEATURE_ENABLED:
                    continue
            except nv.NVMLError as err:
                if self._lost(err):
                    raise _GpuLost(str(err)) from None
                if link == 0:
                    return {"error": str(err)}
                break
            out[str(link)] = {name: self._read(nv.nvmlDeviceGetNvLinkErrorCounter, h, link, counter)
                              for name, counter in NVLINK_COUNTERS.items()}
        return out

    def _mig(self, h: Any) -> list[Reading]:
        nv = self._lib()
        try:
            current, _ = nv.nvmlDeviceGetMigMode(h)
        except nv.NVMLError as err:
            if self._lost(err):
                raise _GpuLost(str(err)) from None
            return []
        if current != nv.NVML_DEVICE_MIG_ENABLE:
            return []
        out = []
        for j in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                m = nv.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                out.append({"uuid": self._read(nv.nvmlDeviceGetUUID, m), "name": self._read(nv.nvmlDeviceGetName, m),
                            "gpu_instance_id": nv.nvmlDeviceGetGpuInstanceId(m)})
            except nv.NVMLError:
                continue
        return out

    def xid_events(self) -> list[Reading]:
        """Xid events queued since the last call: ``[{"index", "uuid", "xid",
        "gpu_instance_id" (None outside MIG)}]``. Never blocks."""
        if self._events is None:
            return []
        nv = self._lib()
        out = []
        while True:
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError as err:
                if getattr(err, "value", None) != nv.NVML_ERROR_TIMEOUT:
                    out.append({"index": None, "uuid": None, "xid": None, "error": str(err)})
                break
            if not int(data.eventType) & nv.nvmlEventTypeXidCriticalError:
                continue
            try:
                uuid = self._read(nv.nvmlDeviceGetUUID, data.device)
            except _GpuLost:
                uuid = None
            index = next((i for i, h in enumerate(self._handles) if _same(h, data.device)), None)
            gi = int(getattr(data, "gpuInstanceId", _INVALID_INSTANCE))
            out.append({"index": index, "uuid": uuid if isinstance(uuid, str) else None, "xid": int(data.eventData),
                        "gpu_instance_id": None if gi == _INVALID_INSTANCE else gi})
        return out


class _GpuLost(Exception):
    pass


def _err(value: Any) -> bool:
    return isinstance(value, dict) and "error" in value


def _same(a: Any, b: Any) -> bool:
    if a is b or a == b:
        return True
    try:   # real NVML handles are ctypes pointers: compare the addresses
        import ctypes

        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return False
