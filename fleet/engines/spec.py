"""The ``engine`` section of an `InferenceDeployment`: which engine every replica runs, and how.

Owns `EngineSpec` (engine kind, image and pull policy, extra arguments and environment, start-up
timeout, the CUDA the engine needs) and the engine flags and variables Fleet sets itself, which
the spec refuses from the user. Included by `fleet.spec.DeploymentSpec`; read by the backends
(`EngineSpec.image`, ``args``, ``env``) and by placement (`EngineSpec.cuda`, against each node's
driver: `fleet.placement.compat`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fleet.base.spec import FieldError, SpecModel
from fleet.engines.cuda import CudaVersion, format_cuda, image_cuda, parse_cuda_version
from fleet.engines.kinds import ENGINE_KINDS

# Engine flags Fleet sets itself from the spec and placement; a user value would conflict.
_RESERVED_ENGINE_ARGS = {
    "--host": "is set by Fleet",
    "--port": "is set by Fleet (ports are allocated per replica)",
    "--model": "comes from spec.model.source",
    "--served-model-name": "comes from spec.model.name",
    "--tensor-parallel-size": "comes from spec.resources.tensorParallelSize",
    "-tp": "comes from spec.resources.tensorParallelSize",
}
_RESERVED_ENGINE_ENV = {
    "CUDA_VISIBLE_DEVICES": "set by placement (GPU or MIG UUIDs)",
    "VLLM_CPU_OMP_THREADS_BIND": "set by placement (CPU cores)",
}


class EngineSpec(SpecModel):
    kind: str = Field(
        "vllm",
        description="Engine kind; `vllm` runs vLLM's OpenAI-compatible server, `sim` the engine simulator "
        "(same API and metrics, modelled latencies, no GPU).",
    )
    image: str | None = Field(
        None, description="Container image (Kubernetes backend). The local backend runs the installed engine."
    )
    image_pull_policy: Literal["IfNotPresent", "Always", "Never"] = Field(
        "IfNotPresent",
        description="The engine pods' imagePullPolicy (Kubernetes backend). `IfNotPresent` (default): the "
        "image Fleet pre-pulled onto the node is the one every replica of a revision runs, and a replacement "
        "starts while the registry is down (Kubernetes' own default for `:latest` or no tag is `Always`, which "
        "asks the registry at every pod start and can give replicas of one revision different contents: pin "
        "a digest to change what runs). `Always`: asked at every start (pre-pull still fetches the layers). "
        "`Never`: the image must already be on the node; nothing is pulled.",
    )  # fmt: skip
    args: list[str] = Field(default_factory=list, description=(
        "Extra engine command-line arguments. fleet validate checks them with the installed vLLM's own parser and "
        "config ranges (unknown flags, types, choices, --gpu-memory-utilization in (0, 1]; a note where vLLM is "
        "not installed), --max-model-len against the model's maximum, and sizes memory from --quantization, "
        "--kv-cache-dtype, --max-model-len, --gpu-memory-utilization and the batch limits."))
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the engine.")
    startup_timeout_seconds: float = Field(
        900.0, gt=0,
        description="Seconds from launch until /health must answer before the replica is FAILED. "
        "Large models on GPUs can take ~10 minutes to load (docs/anchors.md).",
    )
    cuda_version: str | None = Field(
        None,
        description="The CUDA version the engine was built with, e.g. \"12.8\" (quote it). Placement skips "
        "nodes whose NVIDIA driver cannot run it (docs/placement.md#driver-and-cuda-compatibility). Unset: "
        "known vLLM images (vllm/vllm-openai:vX.Y.Z, tags ending -cu129 / -cu130, nvidia/cuda:X.Y.Z-...) "
        "give it; otherwise no driver check.",
    )  # fmt: skip
    cuda_compatibility: Literal["minor-version", "backward"] = Field(
        "minor-version",
        description="Which of NVIDIA's CUDA compatibility rules placement counts on. `minor-version` "
        "(default): a driver at or above the minimum of the CUDA major (12.x: 525.60.13, 13.x: 580) runs any "
        "minor of it. `backward`: the driver's own CUDA version must be at least cudaVersion (consumer GPUs, "
        "or drivers off NVIDIA's long-term branches, under the NVIDIA Container Toolkit).",
    )  # fmt: skip

    @field_validator("cuda_version", mode="before")
    @classmethod
    def _cuda_version(cls, v: object) -> str | None:
        if v is None:
            return None
        if isinstance(v, float):   # YAML reads an unquoted 12.8 as a number
            v = repr(v)
        try:
            return format_cuda(parse_cuda_version(v.strip() if isinstance(v, str) else v))
        except ValueError as err:
            raise ValueError(str(err)) from None

    @property
    def cuda(self) -> tuple[CudaVersion, str] | None:
        """The CUDA the engine needs and where that came from: ``engine.cudaVersion``, else the
        image's (`fleet.engines.cuda.image_cuda`); None for the engine simulator, or when unknown."""
        if self.kind == "sim":
            return None
        if self.cuda_version:
            return parse_cuda_version(self.cuda_version), "engine.cudaVersion"
        known = image_cuda(self.image)
        return (known, f"image {self.image}") if known else None

    @field_validator("kind")
    @classmethod
    def _known_kind(cls, v: str) -> str:
        return ENGINE_KINDS.check(v)

    @model_validator(mode="after")
    def _reserved(self) -> EngineSpec:
        for i, arg in enumerate(self.args):
            flag = arg.split("=", 1)[0]
            if flag in _RESERVED_ENGINE_ARGS:
                raise FieldError(f"args[{i}]", f"{flag!r} {_RESERVED_ENGINE_ARGS[flag]}; remove it")
        for key in self.env:
            if key in _RESERVED_ENGINE_ENV:
                raise FieldError(f"env.{key}", f"is {_RESERVED_ENGINE_ENV[key]}; remove it")
        return self
