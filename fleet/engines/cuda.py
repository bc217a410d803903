"""The CUDA version an engine needs: parsing CUDA versions, and known engine images' CUDA.

Owns `CudaVersion` (major, minor), `parse_cuda_version` (``"12.8"``, ``12080`` as
``cudaDriverGetVersion`` / ``nvmlSystemGetCudaDriverVersion`` return it, ``(12, 8)``) and
`image_cuda`, the CUDA toolkit an engine container image was built with, or None when Fleet
does not know it. Called by the spec (`fleet.engines.spec.EngineSpec.cuda`), the inventory sources
(`fleet.inventory.nvml`, `fleet.inventory.gfd`, `fleet.inventory.file`) and placement
(`fleet.placement.compat`). Pure.

How an image's CUDA is known, first match wins:

1. a ``-cuNNN`` tag suffix, the convention of vLLM's release images (``vllm/vllm-openai:v0.20.2-cu129``,
   ``:latest-cu130``) and PyTorch's wheels: ``cu129`` is CUDA 12.9, ``cu130`` 13.0, ``cu118`` 11.8;
2. NVIDIA's CUDA base images, ``nvidia/cuda:12.4.1-runtime-ubuntu22.04``: the tag's version;
3. ``vllm/vllm-openai:vX.Y.Z`` (unsuffixed release tags): the CUDA of vLLM's Dockerfile default at
   that release, `VLLM_IMAGE_CUDA`.

A tag that moves (``latest``, ``nightly``), a digest, or any other image gives None: the spec's
``engine.cudaVersion`` says it then (and overrides all of the above).
"""

from __future__ import annotations

import re
from bisect import bisect_right

CudaVersion = tuple[int, int]
"""(major, minor), e.g. (12, 8)."""

VLLM_IMAGE_CUDA: tuple[tuple[tuple[int, int, int], CudaVersion], ...] = (
    ((0, 4, 0), (12, 1)),    # images built FROM nvidia/cuda:12.1.0 (vllm-project/vllm#2393, Jan 2024)
    ((0, 4, 3), (12, 4)),    # from v0.4.3 the image requires cuda>=12.4 (vllm-project/vllm#5635)
    ((0, 9, 0), (12, 8)),    # v0.9.0: torch 2.7.0+cu128, docker/Dockerfile ARG CUDA_VERSION=12.8.1 (vllm#18841)
    ((0, 11, 1), (12, 9)),   # torch 2.9 on CUDA 12.9.1; v0.16.0 wheels and containers on 12.9 (vllm#34867)
    ((0, 20, 0), (13, 0)),   # default switched 12.9 -> 13.0, 12.9 became the -cu129 variant (vllm#39878)
)
"""Unsuffixed ``vllm/vllm-openai:vX.Y.Z`` tags: from which release on each CUDA is the image's
(the floor of the release's version). Releases before v0.4.0 are not mapped."""

_VLLM_REPOS = frozenset({"vllm/vllm-openai", "docker.io/vllm/vllm-openai", "index.docker.io/vllm/vllm-openai"})
_CUDA_REPOS = frozenset({"nvidia/cuda", "docker.io/nvidia/cuda", "nvcr.io/nvidia/cuda"})
_CU_SUFFIX = re.compile(r"(?:^|[-_.])cu(\d{2})(\d)(?=$|[-_.])")   # cu129, cu130, cu118 (minor is one digit)
_VERSION_TAG = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?$")
_CUDA_TAG = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)?(?:-|$)")
_VERSION_TEXT = re.compile(r"^(\d+)\.(\d+)$")


def parse_cuda_version(value: object) -> CudaVersion:
    """``"12.8"``, ``12080`` (1000 x major + 10 x minor, as ``cudaDriverGetVersion`` and
    ``nvmlSystemGetCudaDriverVersion`` return it) or ``(12, 8)`` -> ``(12, 8)``.

    Raises ValueError saying why on anything else (a bool, ``"12"``, ``"12.8.1"``, a negative).
    """
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a CUDA version such as \"12.8\"")
    if isinstance(value, int):
        if value < 1000:
            raise ValueError(f"{value} is not a CUDA version (1000 x major + 10 x minor, e.g. 12080)")
        return value // 1000, (value % 1000) // 10
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) and v >= 0 for v in value):
        return value[0], value[1]
    if isinstance(value, str) and (m := _VERSION_TEXT.match(value.strip())):
        return int(m.group(1)), int(m.group(2))
    raise ValueError(f"{value!r} is not a CUDA version such as \"12.8\"")


def format_cuda(version: CudaVersion) -> str:
    """``(12, 8)`` -> ``12.8``."""
    return f"{version[0]}.{version[1]}"


def _split_image(image: str) -> tuple[str, str | None]:
    """``repo[:tag][@digest]`` -> (repository, tag or None). A digest-only reference has no tag."""
    ref = image.strip().split("@", 1)[0]
    slash = ref.rfind("/")
    colon = ref.rfind(":")
    if colon > slash:
        return ref[:colon], ref[colon + 1:]
    return ref, None


def image_cuda(image: str | None) -> CudaVersion | None:
    """The CUDA toolkit ``image`` was built with, when Fleet knows it (see the module docstring);
    None otherwise (no image, a moving tag, a digest, an unknown image)."""
    if not image:
        return None
    repo, tag = _split_image(image)
    if not tag:
        return None
    if m := _CU_SUFFIX.search(tag):
        return int(m.group(1)), int(m.group(2))
    if repo in _CUDA_REPOS and (m := _CUDA_TAG.match(tag)):
        return int(m.group(1)), int(m.group(2))
    if repo in _VLLM_REPOS and (m := _VERSION_TAG.match(tag)):
        release = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        floors = [r for r, _ in VLLM_IMAGE_CUDA]
        i = bisect_right(floors, release)
        return VLLM_IMAGE_CUDA[i - 1][1] if i else None
    return None
