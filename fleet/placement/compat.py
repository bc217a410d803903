"""Driver/CUDA compatibility: may a node's NVIDIA driver run an engine built with a given CUDA?

Owns `CudaNeed` (what a replica's engine needs: a CUDA version, where that came from, and
whether NVIDIA's minor version compatibility may be counted on), `driver_cuda` (the newest CUDA
a driver supports), `node_reason` (why a node's driver cannot run the engine, or None) and the
tables behind them. Called by placement (`fleet.placement.strategies` skips such nodes,
`fleet.placement.explain` groups them by this reason) and so by the controller, `fleet up`'s
preflight and `fleet plan`. Pure: no I/O.

The rules, from NVIDIA's "CUDA Compatibility" guide (docs.nvidia.com/deploy/cuda-compatibility)
and the CUDA Toolkit release notes (docs.nvidia.com/cuda/cuda-toolkit-release-notes, "CUDA
Driver" tables):

- **Backward compatibility**: a driver runs applications built with any CUDA up to the one it
  supports (``nvmlSystemGetCudaDriverVersion``: 13000 is CUDA 13.0 for driver 580.159.04).
- **Minor version compatibility** (CUDA 11 and later): an application built with CUDA X.y runs,
  with a limited feature set, on any driver at or above the minimum of its major release X:
  `MINOR_VERSION_MIN_DRIVER`, ">= 450.80.02" for 11.x, ">= 525.60.13" for 12.x, ">= 580" for
  13.x. A new major always needs a driver of its own major's branch. Features that need a newer
  driver, and PTX that the older driver must JIT-compile, fail at run time.
- **Containers**: NVIDIA's CUDA base images (which vLLM's images are built on) set
  ``NVIDIA_REQUIRE_CUDA=cuda>=X.Y brand=tesla,driver>=535,driver<536 ...``; the NVIDIA Container
  Toolkit refuses to start such a container on a driver whose CUDA is older (``requirement
  error: unsatisfied condition: cuda>=12.4``, vllm-project/vllm#5635) unless the GPU brand and
  driver branch match one of the listed alternatives, which the image's forward compatibility
  package (``/usr/local/cuda/compat``) serves on data-center GPUs. A fleet of data-center GPUs on
  NVIDIA's long-term branches is covered by minor version compatibility (the default); where it
  is not, ``engine.cudaCompatibility: backward`` holds the engine to backward compatibility
  alone (``CudaNeed.minor_version_ok`` False).

A node whose driver is unknown (no NVML, no GFD labels, an inventory file without
``driverVersion``) is not skipped: placement cannot judge it, and says nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fleet.engines.cuda import CudaVersion, format_cuda
from fleet.inventory.model import NodeInventory

DriverVersion = tuple[int, ...]
"""``580.159.04`` -> (580, 159, 4)."""

MINOR_VERSION_MIN_DRIVER: dict[int, DriverVersion] = {
    11: (450, 80, 2),
    12: (525, 60, 13),
    13: (580, 65, 6),   # ">= 580" in the guide; 580.65.06 is the CUDA 13.0 GA driver, the first R580 release
}
"""CUDA major -> the oldest Linux driver that runs every minor of it (minor version compatibility:
"CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version Compatibility")."""

TOOLKIT_DRIVER: tuple[tuple[CudaVersion, DriverVersion], ...] = (
    ((11, 0), (450, 51, 5)), ((11, 1), (455, 23)), ((11, 2), (460, 27, 3)), ((11, 3), (465, 19, 1)),
    ((11, 4), (470, 42, 1)), ((11, 5), (495, 29, 5)), ((11, 6), (510, 39, 1)), ((11, 7), (515, 43, 4)),
    ((11, 8), (520, 61, 5)), ((12, 0), (525, 60, 13)), ((12, 1), (530, 30, 2)), ((12, 2), (535, 54, 3)),
    ((12, 3), (545, 23, 6)), ((12, 4), (550, 54, 14)), ((12, 5), (555, 42, 2)), ((12, 6), (560, 28, 3)),
    ((12, 8), (570, 26)), ((12, 9), (575, 51, 3)), ((13, 0), (580, 65, 6)),
)
"""CUDA release (GA) -> the Linux x86_64 driver it shipped with ("CUDA Toolkit and Corresponding
Driver Versions"): the newest CUDA a driver supports when only its version is known."""

_DRIVER = re.compile(r"^\d+(\.\d+){0,2}$")


def parse_driver_version(text: str) -> DriverVersion:
    """``580.159.04`` -> (580, 159, 4); ``570.26`` -> (570, 26). Raises ValueError otherwise."""
    text = text.strip()
    if not _DRIVER.match(text):
        raise ValueError(f"{text!r} is not an NVIDIA driver version such as 580.159.04")
    return tuple(int(p) for p in text.split("."))


def _driver_text(version: DriverVersion) -> str:
    return ".".join([str(version[0])] + [f"{p:02d}" for p in version[1:]])


def driver_cuda(driver_version: str | None, cuda_driver_version: CudaVersion | None) -> CudaVersion | None:
    """The newest CUDA the driver supports: as NVML / GFD report it, else derived from the driver
    version with `TOOLKIT_DRIVER`; None when neither is known (or the driver predates CUDA 11)."""
    if cuda_driver_version is not None:
        return cuda_driver_version
    if not driver_version:
        return None
    try:
        driver = parse_driver_version(driver_version)
    except ValueError:
        return None
    supported = [cuda for cuda, minimum in TOOLKIT_DRIVER if driver >= minimum]
    return supported[-1] if supported else None


@dataclass(frozen=True)
class CudaNeed:
    """What a replica's engine needs of a node's driver.

    ``version``: the CUDA the engine was built with; ``source``: where that came from, for
    explanations (``engine.cudaVersion``, ``image vllm/vllm-openai:v0.11.0``);
    ``minor_version_ok``: whether NVIDIA's minor version compatibility may be counted on
    (``engine.cudaCompatibility``: ``minor-version``, the default, or ``backward``; see the
    module docstring).
    """

    version: CudaVersion
    source: str = ""
    minor_version_ok: bool = True

    def describe(self) -> str:
        """``CUDA 12.8 (image vllm/vllm-openai:v0.11.0)``."""
        return f"CUDA {format_cuda(self.version)}" + (f" ({self.source})" if self.source else "")


def incompatibility(need: CudaNeed, driver_version: str | None,
                    cuda_driver_version: CudaVersion | None) -> str | None:
    """Why a driver cannot run ``need``, or None when it can or when the driver is unknown.

    The reason names no node (explanations group nodes by it), e.g. ``driver 535.104.05 supports
    CUDA up to 12.2, the engine needs CUDA 12.8 (image vllm/vllm-openai:v0.11.0)``.
    """
    supported = driver_cuda(driver_version, cuda_driver_version)
    if supported is None:
        return None
    if supported >= need.version:
        return None   # backward compatibility
    driver = None
    if driver_version:
        try:
            driver = parse_driver_version(driver_version)
        except ValueError:
            driver = None
    minimum = MINOR_VERSION_MIN_DRIVER.get(need.version[0])
    if need.minor_version_ok and driver is not None and minimum is not None and driver >= minimum:
        return None   # minor version compatibility within the major
    who = f"driver {driver_version}" if driver_version else "the driver"
    why = f"{who} supports CUDA up to {format_cuda(supported)}, the engine needs {need.describe()}"
    if need.version[0] > supported[0] and minimum is not None:
        return why + f": CUDA {need.version[0]}.x needs driver >= {_driver_text(minimum)}"
    if need.minor_version_ok or minimum is None:
        return why
    return why + " (engine.cudaCompatibility: backward)"


def node_reason(node: NodeInventory, need: CudaNeed | None) -> str | None:
    """Why ``node``'s driver cannot run ``need`` (`incompatibility`); None when it can, when the
    node has no GPU (other reasons cover it), when its driver is unknown, or when nothing is needed."""
    if need is None or not node.gpus:
        return None
    return incompatibility(need, node.driver_version, node.cuda_driver_version)
