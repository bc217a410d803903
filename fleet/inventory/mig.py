"""MIG geometry: which GPU instance profiles a GPU model offers and where they may be placed.

Owns the profile tables of the GPU models Fleet knows (H100 80GB, A100 40GB, A100 80GB), the
rules a set of GPU instances must follow to coexist on one GPU, and small exact searches over
them (`fit_geometry`, `max_instances`). Used by the inventory file (to reject impossible
declared geometries), by GFD label parsing (to spread MIG devices over GPUs) and by placement's
repartition advisor (`fleet.placement.mig_advice`).

The rules, from the NVIDIA Multi-Instance GPU User Guide ("Supported MIG Profiles" and
"Placement of GPU Instances"), and `nvidia-smi mig -lgipp` on these GPUs:

- A GPU has 8 memory slices and 7 compute slices. A GPU instance of profile ``Ng.Mgb`` takes N
  compute slices and a fixed run of memory slices that must start at one of the profile's
  allowed start slots (``{0,4}:4`` for 3g.40gb on H100 80GB: start 0 or 4, 4 slices wide).
- Instances may not overlap in memory slices and their compute slices add up to at most 7.
- At most one instance may hold the media extensions (``+me`` profiles).

The H100 80GB table matches the real profile list read from an H100 80GB HBM3 with NVML
(fleet/testing/data/h100-80gb-hbm3.json: names, slice counts, instance counts, memory).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

MEMORY_SLICES = 8
COMPUTE_SLICES = 7


@dataclass(frozen=True)
class MigProfile:
    name: str                   # "3g.40gb"
    profile_id: int             # GPU instance profile ID (`nvidia-smi mig -lgip` "ID" column)
    compute_slices: int         # the N of "Ng"
    memory_slices: int          # width of its placement, in eighths of the GPU memory
    starts: tuple[int, ...]     # allowed first memory slice (`nvidia-smi mig -lgipp`)
    memory_mib: int | None = None   # as NVML reports it, where measured

    @property
    def media_extensions(self) -> bool:
        return self.name.endswith("+me")

    @property
    def max_instances(self) -> int:
        return len(self.starts) if not self.media_extensions else 1


@dataclass(frozen=True)
class MigModel:
    """The MIG profile table of one GPU model."""

    key: str                    # "h100-80gb"
    title: str                  # "NVIDIA H100 80GB"
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile | None:
        return next((p for p in self.profiles if p.name == name), None)

    def profile_names(self) -> list[str]:
        return [p.name for p in self.profiles]


@dataclass(frozen=True)
class MigSlot:
    """One GPU instance of a geometry: its profile and first memory slice."""

    profile: str
    start: int

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


_ONE = tuple(range(7))          # {0,1,2,3,4,5,6}:1 - slice 7 takes no 1-slice instance
_TWO = (0, 2, 4, 6)             # {0,2,4,6}:2
_TWO_G = (0, 2, 4)              # {0,2,4}:2   (2g profiles)
_FOUR = (0, 4)                  # {0,4}:4     (3g profiles)


def _table(key: str, title: str, one: str, one_wide: str, two: str, three: str, four: str, seven: str,
           memory: dict[str, int] | None = None) -> MigModel:
    memory = memory or {}
    rows = [
        (one, 19, 1, 1, _ONE), (one + "+me", 20, 1, 1, _ONE), (one_wide, 15, 1, 2, _TWO),
        (two, 14, 2, 2, _TWO_G), (three, 9, 3, 4, _FOUR), (four, 5, 4, 4, (0,)), (seven, 0, 7, 8, (0,)),
    ]
    return MigModel(key, title, tuple(
        MigProfile(name, pid, g, m, starts, memory.get(name)) for name, pid, g, m, starts in rows
    ))


MIG_MODELS: dict[str, MigModel] = {
    m.key: m for m in (
        _table("h100-80gb", "NVIDIA H100 80GB", "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
               memory={"1g.10gb": 9984, "1g.10gb+me": 9984, "1g.20gb": 20096, "2g.20gb": 20096,
                       "3g.40gb": 40448, "4g.40gb": 40448, "7g.80gb": 81152}),
        _table("a100-80gb", "NVIDIA A100 80GB", "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"),
        _table("a100-40gb", "NVIDIA A100 40GB", "1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"),
    )
}


def mig_model_for(product: str, memory_mib: int | None = None) -> MigModel | None:
    """The MIG table of a GPU product, or None for a product Fleet has no table for.

    H100 80GB covers the SXM5 (``NVIDIA H100 80GB HBM3``) and PCIe (``NVIDIA H100 PCIe``) parts;
    the H100 NVL (94 GB) has other profiles and is not covered. A100 40GB / 80GB cover SXM4 and
    PCIe parts. ``memory_mib`` disambiguates names that do not carry the size.
    """
    name = product.upper()
    if re.search(r"\bH100\b", name) and "NVL" not in name:
        if memory_mib is not None:
            return MIG_MODELS["h100-80gb"] if 79_000 <= memory_mib <= 82_500 else None
        return MIG_MODELS["h100-80gb"] if ("80GB" in name or "PCIE" in name) else None
    if re.search(r"\bA100\b", name):
        if "80GB" in name or (memory_mib is not None and memory_mib > 60_000):
            return MIG_MODELS["a100-80gb"]
        if "40GB" in name or (memory_mib is not None and 39_000 <= memory_mib <= 41_000):
            return MIG_MODELS["a100-40gb"]
    return None


_G_COUNT = re.compile(r"(\d+)g\.")


def mig_gpu_fraction(profile: str) -> float:
    """The share of its GPU that one MIG instance of ``profile`` is, for GPU-hours and cost:
    its compute slices over the GPU's 7 (``3g.40gb`` -> 3/7, ``7g.80gb`` -> 1, ``1g.10gb+me`` ->
    1/7). Source: NVIDIA Multi-Instance GPU User Guide, "Supported MIG Profiles": an A100 or H100
    (and H200) has 7 compute slices and a ``<N>g.<M>gb`` profile takes N of them. Compute, not
    memory (8 slices), is what a price per GPU-hour buys; the A30 (4 compute slices) has no
    table here and would need its own divisor. Raises ValueError for a name without ``<N>g.``."""
    match = _G_COUNT.match(profile)
    if match is None or not 1 <= int(match.group(1)) <= COMPUTE_SLICES:
        raise ValueError(f"{profile!r} is not a MIG profile name such as 1g.10gb or 3g.40gb")
    return int(match.group(1)) / COMPUTE_SLICES


def check_geometry(model: MigModel, slots: Sequence[MigSlot]) -> str | None:
    """Why these GPU instances cannot coexist on one GPU of ``model``, or None when they can."""
    used = [False] * MEMORY_SLICES
    compute = 0
    media = 0
    for slot in slots:
        p = model.profile(slot.profile)
        if p is None:
            return f"{slot.profile} is not a MIG profile of {model.title} (profiles: {', '.join(model.profile_names())})"
        if slot.start not in p.starts:
            return f"{slot.profile} cannot start at memory slice {slot.start} (allowed: {', '.join(map(str, p.starts))})"
        for s in range(slot.start, slot.start + p.memory_slices):
            if used[s]:
                return f"{slot} overlaps another instance at memory slice {s}"
            used[s] = True
        compute += p.compute_slices
        media += p.media_extensions
    if compute > COMPUTE_SLICES:
        return f"instances need {compute} compute slices, the GPU has {COMPUTE_SLICES}"
    if media > 1:
        return "more than one instance with media extensions (+me)"
    return None


def fit_geometry(model: MigModel, profiles: Sequence[str], fixed: Sequence[MigSlot] = ()) -> tuple[MigSlot, ...] | None:
    """Start slots for ``profiles`` beside the ``fixed`` instances, or None when they cannot fit.

    Exact (backtracking over at most 7 instances and their few start slots); largest profiles
    are tried first. Returns only the new slots, in the order of ``profiles`` sorted largest first.
    """
    if check_geometry(model, fixed) is not None:
        return None
    todo = []
    for name in profiles:
        p = model.profile(name)
        if p is None:
            return None
        todo.append(p)
    todo.sort(key=lambda p: (-p.memory_slices, -p.compute_slices, p.name))
    placed: list[MigSlot] = []

    def search(i: int) -> bool:
        if i == len(todo):
            return True
        for start in todo[i].starts:
            slot = MigSlot(todo[i].name, start)
            if check_geometry(model, [*fixed, *placed, slot]) is None:
                placed.append(slot)
                if search(i + 1):
                    return True
                placed.pop()
        return False

    return tuple(placed) if search(0) else None


def max_instances(model: MigModel, profile: str, fixed: Sequence[MigSlot] = ()) -> tuple[MigSlot, ...]:
    """As many instances of ``profile`` as fit beside ``fixed``, lowest start slots first.

    All starts of one profile are aligned runs of equal width, so taking the lowest free start
    each time is optimal (interval scheduling); the compute-slice and +me limits are checked too.
    """
    p = model.profile(profile)
    if p is None or check_geometry(model, fixed) is not None:
        return ()
    out: list[MigSlot] = []
    for start in p.starts:
        slot = MigSlot(profile, start)
        if check_geometry(model, [*fixed, *out, slot]) is None:
            out.append(slot)
    return tuple(out)
