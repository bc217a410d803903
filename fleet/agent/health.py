"""GPU health checks: NVML readings and Xid events turned into findings.

Owns `Finding` (what was seen, on which GPU or MIG instance, how serious), `HealthConfig`, the
pure `classify` and `GpuHealthChecker` (reads through `fleet.agent.nvml_health.NvmlHealthReader`,
keeps the previous reading for counter deltas, stamps findings with the injected clock). Called by
`fleet.agent.runner.NodeAgent`; the decision to quarantine is `fleet.agent.quarantine`'s.

Checks, per GPU (target: the GPU's UUID) unless said otherwise:

| check | severity | evidence |
|---|---|---|
| ``gpu_lost`` | fault | NVML answers ``NVML_ERROR_GPU_IS_LOST`` |
| ``ecc_uncorrected`` | fault | volatile double-bit (uncorrected) ECC count > 0 (since the last reset) |
| ``row_remap_failure`` / ``row_remap_pending`` | fault | row remapping failed / waits for a GPU reset |
| ``retired_pages_pending`` | fault | a retired page waits for a reset (GPUs before Ampere) |
| ``pcie_link`` | degraded | width below the maximum; generation below it while the GPU is busy (idle links drop speed to save power) |
| ``throttle`` | degraded | clock event reasons: HW slowdown, HW / SW thermal slowdown, HW power brake |
| ``nvlink_errors`` | degraded | a link's recovery or CRC-data counter grew, or replay / CRC-flit grew by more than ``nvlink_noise_per_check`` |
| ``p2p`` | degraded | NVLink P2P status between GPUs of one NVLink domain is not OK |
| ``xid`` | by class (`fleet.agent.xid`) | an Xid event; target: the MIG instance NVML attributes it to, else the GPU |
| ``nvml`` | fault, node-wide | NVML itself failed (target ``node``) |

A finding is *certain* (`Finding.certain`) when it is evidence of a hardware fault of that GPU:
``gpu_lost``, ``ecc_uncorrected``, the row-remap and retired-page checks, and the Xids
`fleet.agent.xid.XidInfo.certain` marks (48, 63, 64, 79, 94, 95, 140). A certain fault is never
withheld by the quarantine cap (`fleet.agent.quarantine`).

Sources: NVML API reference (nvmlDeviceGetTotalEccErrors, nvmlDeviceGetRemappedRows,
nvmlDeviceGetCurrentClocksEventReasons, nvmlDeviceGetNvLinkErrorCounter, nvmlDeviceGetP2PStatus,
nvmlEventSetWait_v2), NVIDIA's Xid catalogue (fleet/agent/xid.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable

from fleet.agent.nvml_health import NVLINK_COUNTERS, NvmlHealthReader, Reading
from fleet.agent.xid import XidClass, classify_xid

NODE_TARGET = "node"

# NVML clock event reason bits (nvml.h nvmlClocksEventReason*).
_THROTTLE_BITS = {
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}
_GPU_IDLE = 0x1
_P2P_OK = 0
_FEATURE_ENABLED = 1


class Severity(str, enum.Enum):
    FAULT = "fault"              # quarantine now
    DEGRADED = "degraded"        # quarantine when it persists (QuarantineConfig.degraded_after_s)
    SUSPECT = "suspect"          # an unclassified Xid: quarantine when it repeats
    APPLICATION = "application"  # the application's fault: reported, never quarantines
    INFO = "info"                # reported only

    def quarantines(self) -> bool:
        return self in (Severity.FAULT, Severity.DEGRADED, Severity.SUSPECT)


@dataclass(frozen=True)
class Finding:
    """One thing seen at ``observed_s`` (clock seconds) on ``target`` (a GPU UUID, a MIG UUID,
    or ``"node"``). ``event``: an Xid (happened once) rather than a condition (true while read).
    ``gpu``: the UUID of the GPU it concerns (the parent of a MIG instance)."""

    target: str
    gpu: str
    check: str
    severity: Severity
    detail: str
    observed_s: float
    event: bool = False
    xid: int | None = None
    certain: bool = False
    """A hardware fault of this GPU (see the module docstring): the quarantine cap never withholds it."""

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.target, "gpu": self.gpu, "check": self.check, "severity": self.severity.value,
                "detail": self.detail, "observed_s": self.observed_s, "event": self.event, "xid": self.xid,
                "certain": self.certain}


@dataclass(frozen=True)
class HealthConfig:
    nvlink_noise_per_check: int = 100
    """Replay / CRC-flit errors one link may add between two checks before it is a finding
    (links correct these by retransmission; a steady trickle is normal)."""


def _int(v: Any) -> int | None:
    return None if v is None or (isinstance(v, dict) and "error" in v) else int(v)


def classify(reading: Reading, events: list[Reading], previous: Reading | None, now_s: float,
             config: HealthConfig = HealthConfig()) -> list[Finding]:
    """Findings of one reading (`NvmlHealthReader.read`) and the Xid events since the last.
    ``previous``: the last reading (counter deltas); None at the first check. Pure."""
    out: list[Finding] = []
    prev_by_index = {d["index"]: d for d in (previous or {}).get("devices", [])}
    uuids = {}
    for d in reading.get("devices", []):
        uuid = d.get("uuid") if isinstance(d.get("uuid"), str) else f"gpu-index-{d['index']}"
        uuids[d["index"]] = uuid

        def add(check: str, severity: Severity, detail: str, target: str = uuid, certain: bool = False) -> None:
            out.append(Finding(target, uuid, check, severity, detail, now_s, certain=certain))

        if d.get("lost"):
            add("gpu_lost", Severity.FAULT, f"GPU {d['index']} is lost: {d.get('error', 'GPU is lost')}", certain=True)
            continue
        ecc = _int(d.get("ecc_volatile_uncorrected"))
        if ecc:
            add("ecc_uncorrected", Severity.FAULT, f"{ecc} uncorrected (double-bit) ECC error(s) since the last reset",
                certain=True)
        rows = d.get("remapped_rows") if isinstance(d.get("remapped_rows"), dict) else {}
        if rows.get("failure"):
            add("row_remap_failure", Severity.FAULT, "row remapping failed: the memory cannot be repaired", certain=True)
        elif rows.get("pending"):
            add("row_remap_pending", Severity.FAULT, "a row remapping is pending: the GPU needs a reset", certain=True)
        if _int(d.get("retired_pages_pending")) == _FEATURE_ENABLED:
            add("retired_pages_pending", Severity.FAULT, "a retired page is pending: the GPU needs a reset",
                certain=True)
        reasons = _int(d.get("clocks_event_reasons")) or 0
        pcie = d.get("pcie") or {}
        width, width_max = _int(pcie.get("width_current")), _int(pcie.get("width_max"))
        gen, gen_max = _int(pcie.get("gen_current")), _int(pcie.get("gen_max"))
        slow = []
        if width and width_max and width < width_max:
            slow.append(f"x{width} of x{width_max}")
        if gen and gen_max and gen < gen_max and not reasons & _GPU_IDLE:
            slow.append(f"Gen{gen} of Gen{gen_max}")
        if slow:
            add("pcie_link", Severity.DEGRADED, "PCIe link at " + ", ".join(slow))
        throttled = [name for bit, name in _THROTTLE_BITS.items() if reasons & bit]
        if throttled:
            add("throttle", Severity.DEGRADED, "clocks held down: " + ", ".join(throttled))
        out.extend(_nvlink_findings(d, prev_by_index.get(d["index"]), uuid, now_s, config))
        for peer, status in sorted((d.get("p2p_nvlink") or {}).items()):
            st = _int(status)
            if st is not None and st != _P2P_OK:
                add("p2p", Severity.DEGRADED, f"NVLink P2P to GPU {peer} not available (status {st})")
    mig_by_gi = {
        (d["index"], m.get("gpu_instance_id")): m["uuid"]
        for d in reading.get("devices", []) for m in d.get("mig_instances") or [] if isinstance(m.get("uuid"), str)
    }
    for ev in events:
        if ev.get("xid") is None:
            out.append(Finding(NODE_TARGET, NODE_TARGET, "nvml", Severity.INFO,
                               f"Xid event wait failed: {ev.get('error')}", now_s, event=True))
            continue
        info = classify_xid(ev["xid"])
        gpu = ev.get("uuid") or uuids.get(ev.get("index"), f"gpu-index-{ev.get('index')}")
        target = mig_by_gi.get((ev.get("index"), ev.get("gpu_instance_id")), gpu)
        severity = {
            XidClass.GPU_FAULT: Severity.FAULT, XidClass.GPU_LOST: Severity.FAULT,
            XidClass.APPLICATION: Severity.APPLICATION, XidClass.IGNORE: Severity.INFO,
            XidClass.UNKNOWN: Severity.SUSPECT,
        }[info.cls]
        out.append(Finding(target, gpu, "xid", severity, f"Xid {info.xid}: {info.name} ({info.cls.value})",
                           ev.get("observed_s", now_s), event=True, xid=info.xid, certain=info.certain))
    return out


def _nvlink_findings(d: Reading, prev: Reading | None, uuid: str, now_s: float,
                     config: HealthConfig) -> list[Finding]:
    links = d.get("nvlink_errors")
    prev_links = (prev or {}).get("nvlink_errors")
    if not isinstance(links, dict) or "error" in links or not isinstance(prev_links, dict):
        return []
    grew = []
    for link, counters in sorted(links.items(), key=lambda kv: int(kv[0])):
        before = prev_links.get(link) or {}
        for name in NVLINK_COUNTERS:
            now_v, then_v = _int(counters.get(name)), _int(before.get(name))
            if now_v is None or then_v is None or now_v <= then_v:
                continue
            delta = now_v - then_v
            if name in ("recovery", "crc_data") or delta > config.nvlink_noise_per_check:
                grew.append(f"link {link} {name} +{delta}")
    if not grew:
        return []
    return [Finding(uuid, uuid, "nvlink_errors", Severity.DEGRADED, "NVLink errors: " + ", ".join(grew), now_s)]


class GpuHealthChecker:
    """Runs the checks: ``check()`` reads NVML (``reader``), drains Xid events and returns the
    findings, stamped with ``clock()`` seconds. A reader that fails altogether (driver gone)
    yields one node-wide ``nvml`` fault."""

    def __init__(self, reader: NvmlHealthReader, clock: Callable[[], float],
                 config: HealthConfig = HealthConfig()) -> None:
        self.reader = reader
        self.clock = clock
        self.config = config
        self.previous: Reading | None = None
        self.last_reading: Reading | None = None
        self.pending_events: list[Reading] = []

    def poll_events(self) -> int:
        """Drain NVML's Xid event queue now, stamping each event with the clock; they join the
        next ``check``. Called between checks (every second by `NodeAgent.run`) so that a burst
        neither waits a whole period nor overflows the driver's queue. Returns how many."""
        if not self.reader.opened:
            return 0
        try:
            events = self.reader.xid_events()
        except Exception:   # reported by the next check, which reads NVML again
            return 0
        now = self.clock()
        self.pending_events.extend({**e, "observed_s": now} for e in events)
        return len(events)

    def fault_pending(self) -> bool:
        """Whether an Xid drained since the last ``check`` is a certain hardware fault of its GPU
        (`fleet.agent.xid.XidInfo.certain`: 48, 63, 64, 79, 94, 95, 140), which
        `NodeAgent.run` checks at once instead of a period later. Pure over the pending events."""
        return any(isinstance(e.get("xid"), int) and classify_xid(e["xid"]).certain for e in self.pending_events)

    def check(self) -> list[Finding]:
        now = self.clock()
        try:
            if not self.reader.opened:
                self.reader.open()
            reading = self.reader.read()
            events = self.pending_events + self.reader.xid_events()
            self.pending_events = []
        except Exception as err:   # NVML gone mid-run: one node-wide finding, the loop goes on
            return [Finding(NODE_TARGET, NODE_TARGET, "nvml", Severity.FAULT, f"NVML failed: {err}", now)]
        findings = classify(reading, events, self.previous, now, self.config)
        self.previous = reading
        self.last_reading = reading
        return findings

    def targets(self) -> dict[str, tuple[str, float]]:
        """Every GPU and MIG instance of the last reading: ``{target: (gpu uuid, weight)}``, where
        weight is the share of a GPU the target stands for (1 for a GPU, 1/n for one of n MIG
        instances; the GPU of MIG instances weighs 1 too, covering them all)."""
        out: dict[str, tuple[str, float]] = {}
        for d in (self.last_reading or {}).get("devices", []):
            uuid = d.get("uuid") if isinstance(d.get("uuid"), str) else f"gpu-index-{d['index']}"
            out[uuid] = (uuid, 1.0)
            migs = [m for m in d.get("mig_instances") or [] if isinstance(m.get("uuid"), str)]
            for m in migs:
                out[m["uuid"]] = (uuid, 1.0 / len(migs))
        return out

    def cpu_affinity(self) -> dict[str, tuple[int, ...]]:
        """CPU cores local to each GPU (NVML's CPU affinity), by GPU UUID; last reading."""
        out = {}
        for d in (self.last_reading or {}).get("devices", []):
            if isinstance(d.get("uuid"), str) and isinstance(d.get("cpu_affinity"), list):
                out[d["uuid"]] = tuple(d["cpu_affinity"])
        return out


def local_cores(affinity: dict[str, tuple[int, ...]], gpus: list[str]) -> tuple[int, ...]:
    """Cores to pin a replica on ``gpus`` to: those local to all of them, or (GPUs on different
    NUMA nodes) local to any; ``()`` when NVML gave no affinity. Pure."""
    sets = [set(affinity[g]) for g in gpus if affinity.get(g)]
    if not sets:
        return ()
    common = set.intersection(*sets)
    return tuple(sorted(common or set.union(*sets)))
