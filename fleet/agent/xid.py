"""Xid classification: whose fault an Xid is, and what it asks of Fleet. Pure data.

Owns `XID_CATALOGUE` and `classify_xid`. Called by `fleet.agent.health` (findings) and
`fleet.agent.quarantine` (through the finding's severity).

Sources: NVIDIA's Xid catalogue for Ampere and later, "Resolution Bucket (Immediate Action)"
column (https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html: RESTART_APP,
RESET_GPU, RESTART_BM, IGNORE, ...), and the application-error Xids NVIDIA's Kubernetes device
plugin skips by default (13, 31, 43, 45, 68, 109: the application's fault, not the GPU's;
docs/anchors.md). Only Xids whose meaning is clear from those sources are listed; an Xid
not listed is ``UNKNOWN``: reported, and quarantining only when it repeats (see
`fleet.agent.quarantine.QuarantineConfig.unknown_xid_repeats`), so one noisy Xid never takes GPUs
away (the NVSentinel report of 77 nodes flagged for one job's Xid 45 burst).

`XidInfo.certain`: the Xid is evidence of a fault of *this* GPU's hardware that NVIDIA answers
with a GPU reset or node reboot (Immediate Action RESET_GPU / RESTART_BM in the catalogue): an
uncorrectable memory error (48 double-bit ECC, 94 contained and 95 uncontained ECC, 140
unrecovered ECC), a row remapping or page retirement that waits for a reset (63) or failed (64),
the GPU fallen off the bus (79). A certain fault quarantines even when the quarantine cap is
reached (`fleet.agent.quarantine`): the cap guards against noise, and these are not noise. Xids
that need a reset but may come from firmware or software across many nodes at once (GSP 119/120,
micro-controller 61/62, NVLink 74, whose fault may be the link's other end) stay under the cap.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class XidClass(str, enum.Enum):
    APPLICATION = "application"   # the process's fault (bad kernel, illegal address, killed): no quarantine
    IGNORE = "ignore"             # informational (a correction recorded, a channel torn down)
    GPU_FAULT = "gpu_fault"       # the GPU needs a reset (ECC, GSP, NVLink): quarantine now
    GPU_LOST = "gpu_lost"         # the GPU is off the bus: quarantine; NVIDIA asks for a node reboot
    UNKNOWN = "unknown"           # not in the table: quarantine only when it repeats


@dataclass(frozen=True)
class XidInfo:
    xid: int
    name: str
    cls: XidClass
    certain: bool = False
    """A hardware fault of this GPU (see the module docstring): quarantined past the cap."""


CERTAIN_XIDS = frozenset({48, 63, 64, 79, 94, 95, 140})
"""Xids that are certain hardware faults of the GPU they name (see the module docstring)."""


def _table(*rows: tuple[int, str, XidClass]) -> dict[int, XidInfo]:
    return {xid: XidInfo(xid, name, cls, xid in CERTAIN_XIDS) for xid, name, cls in rows}


A, IG, F, L = XidClass.APPLICATION, XidClass.IGNORE, XidClass.GPU_FAULT, XidClass.GPU_LOST
XID_CATALOGUE: dict[int, XidInfo] = _table(
    (8, "GPU stopped processing (channel idle timeout)", A),
    (11, "Invalid or corrupted push buffer stream", A),
    (13, "Graphics engine exception", A),
    (31, "GPU memory page fault (illegal address)", A),
    (43, "GPU stopped processing (channel reset)", A),
    (45, "Preemptive cleanup, due to previous errors (process exit or kill)", A),
    (48, "Double bit ECC error", F),
    (61, "Internal micro-controller breakpoint/warning", F),
    (62, "Internal micro-controller halt", F),
    (63, "ECC page retirement or row remapping recorded; a GPU reset activates it", F),
    (64, "ECC page retirement or row remapping recording failure", F),
    (68, "Video processor (NVDEC) exception", A),
    (69, "Graphics engine class error", A),
    (74, "NVLink error", F),
    (79, "GPU has fallen off the bus", L),
    (92, "High single-bit ECC error rate", IG),
    (94, "Contained ECC error", F),
    (95, "Uncontained ECC error", F),
    (109, "Context switch timeout", A),
    (119, "GSP RPC timeout", F),
    (120, "GSP error", F),
    (121, "C2C link corrected error", IG),
    (140, "Unrecovered ECC error", F),
)
del A, IG, F, L


def classify_xid(xid: int) -> XidInfo:
    """The catalogue row of ``xid``; an unlisted Xid is ``UNKNOWN``. Pure."""
    return XID_CATALOGUE.get(xid) or XidInfo(xid, f"Xid {xid} (not in Fleet's table)", XidClass.UNKNOWN)
