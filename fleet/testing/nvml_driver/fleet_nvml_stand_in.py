"""The ONE implementation of Fleet's stand-in NVML, stdlib only, so that a container whose image
carries nothing of Fleet's tests reads it: `FakePynvml` (nvidia-ml-py's `pynvml` module answering
from a snapshot dict), `FileNvml` (the same over a node's JSON state file, ``$FLEET_FAKE_NVML``)
and the state file's writers (`write_state`, `inject_xid`, `update_device`). The state file is a
snapshot plus ``"xid_events": [{"uuid": "GPU-...", "xid": 79, "at_s": 1764000000.0,
"gpu_instance_id": null}]``, rewritten atomically.

Lives in the driver directory (fleet/testing/nvml_driver) beside the `pynvml` module that serves
it (fleet/testing/nvml_driver/pynvml.py), so mounting that one directory into a container is the
whole driver, as the NVIDIA container toolkit mounts the real one. Imported by
fleet/testing/fake_nvml.py (the tests' and benchmarks' name for it, with the synthetic snapshots)
and loaded by its file from pynvml.py.
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: ``value`` is the NVML return code."""

    def __init__(self, message: str = "Unknown Error", value: int = 999) -> None:
        super().__init__(message)
        self.value = value


NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
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
    NVML_ERROR_NOT_FOUND = NVML_ERROR_NOT_FOUND
    NVML_ERROR_TIMEOUT = NVML_ERROR_TIMEOUT
    NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND
    NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST
    nvmlEventTypeXidCriticalError = 0x8
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_P2P_CAPS_INDEX_NVLINK = 2

    def __init__(self, snapshot: dict) -> None:
        self._snap = snapshot
        self.initialized = 0
        self._pristine = copy.deepcopy(snapshot)
        self.events: list[SimpleNamespace] = []
        self.registered: set[int] = set()

    @property
    def snap(self) -> dict:
        """The snapshot NVML answers from (``{"driver_version", "devices": [...]}``)."""
        return self._snap

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

    def nvmlSystemGetCudaDriverVersion(self):
        if "cuda_driver_version" not in self.snap:
            raise FakeNVMLError("Not Supported", 3)
        return self._value(self.snap["cuda_driver_version"])

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
        d = self._dev(h)
        return SimpleNamespace(total=d["memory_total_mib"] * 1024 * 1024,
                               used=d.get("memory_used_mib", 0) * 1024 * 1024)  # fmt: skip

    def nvmlDeviceGetUtilizationRates(self, h):
        """``utilization`` of the snapshot (``{"gpu": %, "memory": %}``, as the H200 reading's ``raw``
        holds it; 0 % when absent)."""
        u = self._value(self._dev(h).get("utilization", {"gpu": 0, "memory": 0}))
        return SimpleNamespace(gpu=u["gpu"], memory=u["memory"])

    def nvmlDeviceGetPowerUsage(self, h):
        """``power_usage_mw`` of the snapshot, in mW as NVML answers (0 when absent)."""
        return self._value(self._dev(h).get("power_usage_mw", 0))

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

    def nvmlEventSetWait(self, event_set, timeout_ms):
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set):
        pass

    def nvmlGpuInstanceGetInfo(self, gi):
        return SimpleNamespace(profileId=0, placement=SimpleNamespace(start=gi["start"], size=0))


# -- the per-node state file (the cluster in a box) ------------------------------------------------

FAKE_NVML_ENV = "FLEET_FAKE_NVML"
"""The environment variable naming a node's state file (read by `FileNvml.nvmlInit`)."""
_NO_INSTANCE = 0xFFFFFFFF


class FileNvml(FakePynvml):
    """`FakePynvml` answering from the JSON state file named by ``$FLEET_FAKE_NVML``, as the
    process of a container on that node would see NVML:

    - ``nvmlInit`` reads the file (no variable, or no file: NVMLError "NVML Shared Library Not
      Found", as on a machine without the driver) and picks the devices ``$NVIDIA_VISIBLE_DEVICES``
      names, as the NVIDIA container toolkit does: ``all``; a comma list of host indices, GPU
      UUIDs, or MIG UUIDs (the parent GPU is visible with those instances only); ``none``,
      ``void`` or empty: no device. Unset: all (a stand-in convenience: a box process without GPU
      access never has this module on its path). Visible GPUs are numbered 0.. in host order, as
      NVML inside a container numbers them; an unknown device raises NVMLError (NotFound).
    - every later call answers from the file as it is now (re-read when its inode, size or
      mtime changed: a test rewrites it atomically with `write_state` / `inject_xid`); a visible
      GPU that is gone from the file, or marked ``"lost": true``, answers GPU_IS_LOST.
    - ``xid_events`` entries are delivered by ``nvmlEventSetWait(_v2)`` once per process, for
      registered GPUs, in file order; entries already in the file when a GPU is registered are
      history (real NVML delivers only events that happen after ``nvmlDeviceRegisterEvents``),
      so a restarted agent does not see an old Xid again. ``timeout_ms`` > 0 waits, polling the file.
    """

    def __init__(self, environ: dict[str, str] | None = None, poll_s: float = 0.02) -> None:
        super().__init__({"driver_version": "", "devices": []})
        self._environ = os.environ if environ is None else environ
        self._poll_s = poll_s
        self._path: Path | None = None
        self._stamp: tuple[int, int, int] | None = None
        self._doc: dict = {"driver_version": "", "devices": []}
        self._visible: list[tuple[str, frozenset[str] | None]] = []   # (GPU uuid, MIG uuids or None: all)
        self._view: dict | None = None
        self._delivered: set[tuple[str, int]] = set()

    # -- the file ----------------------------------------------------------------------------------
    def _reload(self) -> None:
        assert self._path is not None
        try:
            st = self._path.stat()
        except FileNotFoundError:
            return   # mid-rename on some file systems: keep the last document
        stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp != self._stamp:
            self._doc = json.loads(self._path.read_text())
            self._stamp = stamp
            self._view = None

    @property
    def snap(self) -> dict:
        if self._path is None:
            return self._snap
        self._reload()
        if self._view is None:
            by_uuid = {d["uuid"]: d for d in self._doc.get("devices", [])}
            devices = []
            for i, (uuid, migs) in enumerate(self._visible):
                d = copy.deepcopy(by_uuid.get(uuid) or {"uuid": uuid, "lost": True})
                d["index"] = i
                if migs is not None and d.get("mig_instances") is not None:
                    d["mig_instances"] = [m for m in d["mig_instances"] if m.get("uuid") in migs]
                devices.append(d)
            self._view = {"driver_version": self._doc.get("driver_version", ""), "devices": devices}
            if "cuda_driver_version" in self._doc:
                self._view["cuda_driver_version"] = self._doc["cuda_driver_version"]
        return self._view

    def _select(self, value: str | None) -> list[tuple[str, frozenset[str] | None]]:
        devices = sorted(self._doc.get("devices", []), key=lambda d: int(d["index"]))
        if value is None or value.strip() == "all":
            return [(d["uuid"], None) for d in devices]
        if value.strip() in ("", "none", "void"):
            return []
        gpus: dict[str, set[str] | None] = {}
        for item in (x.strip() for x in value.split(",") if x.strip()):
            if item.isdigit():
                found = next((d for d in devices if int(d["index"]) == int(item)), None)
                if found is None:
                    raise FakeNVMLError(f"Not Found: no GPU {item}", NVML_ERROR_NOT_FOUND)
                gpus[found["uuid"]] = None
            elif item.startswith("MIG-"):
                parent = next((d for d in devices for m in d.get("mig_instances") or [] if m.get("uuid") == item), None)
                if parent is None:
                    raise FakeNVMLError(f"Not Found: no MIG device {item}", NVML_ERROR_NOT_FOUND)
                if parent["uuid"] not in gpus or gpus[parent["uuid"]] is not None:
                    gpus.setdefault(parent["uuid"], set()).add(item)   # type: ignore[union-attr]
            elif any(d["uuid"] == item for d in devices):
                gpus[item] = None
            else:
                raise FakeNVMLError(f"Not Found: no GPU {item}", NVML_ERROR_NOT_FOUND)
        order = [d["uuid"] for d in devices]
        return [(u, None if gpus[u] is None else frozenset(gpus[u])) for u in sorted(gpus, key=order.index)]

    # -- the library ---------------------------------------------------------------------------------
    def nvmlInit(self):
        path = self._environ.get(FAKE_NVML_ENV)
        if not path or not Path(path).is_file():
            raise FakeNVMLError("NVML Shared Library Not Found", NVML_ERROR_LIBRARY_NOT_FOUND)
        self._path, self._stamp, self._view = Path(path), None, None
        self._reload()
        self._visible = self._select(self._environ.get("NVIDIA_VISIBLE_DEVICES"))
        self._view = None
        self.initialized += 1

    def _events(self) -> list[tuple[tuple[str, int], dict]]:
        seen: dict[str, int] = {}
        out = []
        for e in self._doc.get("xid_events", []):
            key = json.dumps(e, sort_keys=True)
            seen[key] = seen.get(key, 0) + 1
            out.append(((key, seen[key]), e))
        return out

    def nvmlDeviceRegisterEvents(self, h, types, event_set):
        super().nvmlDeviceRegisterEvents(h, types, event_set)
        uuid = self.snap["devices"][h]["uuid"]
        self._delivered.update(k for k, e in self._events() if e.get("uuid") == uuid)   # history

    def _next_event(self) -> SimpleNamespace | None:
        self._reload()
        index = {uuid: i for i, (uuid, _) in enumerate(self._visible)}
        for key, e in self._events():
            h = index.get(e.get("uuid"))
            if key in self._delivered or h is None or h not in self.registered:
                continue
            self._delivered.add(key)
            gi = e.get("gpu_instance_id")
            return SimpleNamespace(device=h, eventType=self.nvmlEventTypeXidCriticalError, eventData=int(e["xid"]),
                                   gpuInstanceId=_NO_INSTANCE if gi is None else int(gi),
                                   computeInstanceId=_NO_INSTANCE)
        return None

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):
        deadline = time.monotonic() + max(0, timeout_ms) / 1000
        while True:
            event = self._next_event()
            if event is not None:
                return event
            left = deadline - time.monotonic()
            if left <= 0:
                raise FakeNVMLError("Timeout", NVML_ERROR_TIMEOUT)
            time.sleep(min(self._poll_s, left))


def _write_atomically(path: Path, doc: dict) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.chmod(tmp, 0o644)   # readable by a box process running as another user
    os.replace(tmp, path)


def write_state(path: Path, snapshot: dict) -> Path:
    """Write a node's state file for `FileNvml`: ``snapshot`` (``{"driver_version", "devices"}``,
    e.g. `nvswitch_8gpu()`) with its ``xid_events`` (none if it has none), atomically. Returns
    ``path``."""
    _write_atomically(Path(path), {**snapshot, "xid_events": list(snapshot.get("xid_events", []))})
    return Path(path)


def inject_xid(path: Path, uuid: str, xid: int, gpu_instance_id: int | None = None,
               at_s: float | None = None) -> dict:
    """Append an Xid event on GPU ``uuid`` (on MIG instance ``gpu_instance_id``) to the state
    file, atomically: every process on that node with the GPU registered receives it once.
    ``at_s``: when it happened (default: now, wall clock). Returns the entry."""
    doc = json.loads(Path(path).read_text())
    entry = {"uuid": uuid, "xid": int(xid), "at_s": time.time() if at_s is None else at_s,
             "gpu_instance_id": gpu_instance_id}
    doc.setdefault("xid_events", []).append(entry)
    _write_atomically(Path(path), doc)
    return entry


def update_device(path: Path, uuid: str, **readings) -> None:
    """Overwrite readings of GPU ``uuid`` in the state file, atomically, e.g.
    ``update_device(p, uuid, ecc_volatile_uncorrected=2)`` or ``lost=True``."""
    doc = json.loads(Path(path).read_text())
    [d] = [d for d in doc["devices"] if d["uuid"] == uuid]
    d.update(readings)
    _write_atomically(Path(path), doc)
