"""What an engine pod requests: GPUs or a MIG instance, CPU and memory.

Owns `engine_resources` (the engine container's ``resources``, sized by
`fleet.k8s.pod_settings.EngineResources`; docs/kubernetes.md, "Engine pod resources"),
`gpu_resources` (the extended resources: ``nvidia.com/gpu: <TP>``, ``nvidia.com/mig-<profile>:
1``) and `device_memory_gib` (one device's GiB from its MIG profile or product name). Called by
`fleet.k8s.pods` (`pod_manifest`, `pod_group`). Pure; tests/unit/test_k8s_engine_pods.py calls
them with literals.
"""

from __future__ import annotations

import math
import re

from fleet.controller.backend import ReplicaWant
from fleet.k8s.pod_settings import EnginePodSettings


def engine_resources(want: ReplicaWant, settings: EnginePodSettings, gpus: int | None = None) -> dict[str, dict]:
    """The engine container's ``resources``: GPUs or a MIG instance (`gpu_resources`) plus CPU
    and memory requests sized by `EngineResources` (limits equal to requests when
    ``guaranteed``). ``gpus``: whole GPUs of this pod when it is one member of a gang (default:
    the replica's). Pure."""
    spec = want.deployment.spec
    r = settings.resources
    extended = gpu_resources(want, settings)
    if gpus is not None and extended:
        extended = {"nvidia.com/gpu": str(gpus)}
    if spec.engine.kind == "sim":
        cpu: str = str(spec.resources.cpu_cores) if spec.resources.accelerator == "cpu" else r.simulator_cpu
        memory = r.simulator_memory
    elif spec.resources.accelerator == "cpu":
        kv = _number(spec.engine.env.get("VLLM_CPU_KVCACHE_SPACE"), r.cpu_kv_cache_gib)
        cpu, memory = str(spec.resources.cpu_cores), _gib(r.base_memory_gib + (kv or r.cpu_kv_cache_gib)
                                                          + r.cpu_model_gib)  # fmt: skip
    else:
        n = gpus if gpus is not None else 1 if spec.resources.mig_profile else spec.resources.tensor_parallel_size
        device = device_memory_gib(spec.resources.mig_profile, want.placement.product)
        load = min(r.load_buffer_gib, 0.9 * device) if device else r.load_buffer_gib
        swap = _flag_value(spec.engine.args, "--swap-space", r.swap_space_gib)
        cpu = _cores(r.base_cpu + r.cpu_per_gpu * n)
        memory = _gib(r.base_memory_gib + n * (swap + r.memory_per_gpu_gib + load))
    requests = {**extended, "cpu": cpu, "memory": memory}
    limits = dict(requests) if r.guaranteed else dict(extended)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def device_memory_gib(mig_profile: str | None, product: str | None) -> float | None:
    """GiB of one device: a MIG profile's (``3g.40gb`` -> 40), else the number before ``GB`` in
    the GPU product (``NVIDIA-H100-80GB-HBM3`` -> 80), else None."""
    for text, pattern in ((mig_profile, r"\.(\d+)gb"), (product, r"(\d+)\s*GB")):
        m = re.search(pattern, text or "", re.IGNORECASE)
        if m:
            return float(m.group(1))
    return None


def _number(text: str | None, default: float) -> float:
    try:
        return float(text) if text is not None else default
    except ValueError:
        return default


def _flag_value(args: list[str], flag: str, default: float) -> float:
    """The number after ``flag`` (``--flag N`` or ``--flag=N``) in ``args``, else ``default``."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return _number(args[i + 1], default)
        if arg.startswith(flag + "="):
            return _number(arg.split("=", 1)[1], default)
    return default


def _gib(gib: float) -> str:
    """A memory quantity: whole GiB as ``26Gi``, else MiB rounded up."""
    mib = math.ceil(gib * 1024)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def _cores(cores: float) -> str:
    """A CPU quantity: ``6`` or ``2500m``."""
    milli = math.ceil(cores * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def gpu_resources(want: ReplicaWant, settings: EnginePodSettings) -> dict[str, str]:
    """Extended resources of the replica's container: ``nvidia.com/gpu: TP``,
    ``nvidia.com/mig-<profile>: 1`` (mixed strategy) or ``{}`` for CPU replicas."""
    r = want.deployment.spec.resources
    if r.accelerator == "cpu":
        return {}
    if r.mig_profile:
        key = f"nvidia.com/mig-{r.mig_profile}" if settings.mig_strategy == "mixed" else "nvidia.com/gpu"
        return {key: "1"}
    return {"nvidia.com/gpu": str(r.tensor_parallel_size)}
