"""The cluster-wide settings of engine pods: the chart's ``engine:`` values.

Owns `EnginePodSettings` (runtime class, tolerations, /dev/shm, extra env, MIG strategy, image
pre-pull, the node weight cache, KV event ports; parsed from FLEET_ENGINE_POD_JSON),
`EngineResources` (how CPU and memory requests are sized, the chart's ``engine.resources``) and
`ENGINE_PORT` (the engine container's HTTP port, which the KV event ports must differ from).
Called by the operator (`fleet.k8s.operator`, `fleet operator`), `fleet.cli.k8s`, and read by
the pod builders (`fleet.k8s.pods`, `fleet.k8s.pod_resources`, `fleet.k8s.pod_weights`) and
`fleet.k8s.prepull`. Pure; tests/unit/test_k8s_engine_pods.py parses it from literals.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ENGINE_PORT = 8000


@dataclass(frozen=True)
class EngineResources:
    """How engine pods' CPU and memory requests are sized (the chart's ``engine.resources``;
    docs/kubernetes.md, "Engine pod resources"). `engine_resources` applies it.

    GPU replica of G devices (TP GPUs, or 1 for a MIG slice) of D GiB each:
    ``cpu = base_cpu + cpu_per_gpu x G``;
    ``memory = base_memory_gib + G x (swap + memory_per_gpu_gib + min(load_buffer_gib, 0.9 x D))``.
    Sources: ``swap`` is vLLM's CPU swap space per GPU (``--swap-space``, default 4 GiB,
    vllm/engine/arg_utils.py; read from ``spec.engine.args`` when given); each GPU's worker
    process (PyTorch, the CUDA runtime's host side, NCCL) takes ~2 GiB; weights are read through
    host memory (safetensors mmapped through the page cache, charged to the pod's cgroup) a shard
    at a time: Hugging Face's ``save_pretrained`` cuts shards at 5 GB (``max_shard_size``), and a
    device holds at most 0.9 x D of them (vLLM ``--gpu-memory-utilization`` 0.9); ``base`` is the
    API server process (tokenizer, detokenizer). CPU cores: ``cpu_per_gpu`` covers the busy
    worker loop and tokenization per GPU; GPU nodes carry 24-28 cores per GPU (p5.48xlarge
    192/8, DGX H100 224/8). CPU replica (vLLM CPU build): ``cpu = spec.resources.cpuCores``,
    ``memory = base_memory_gib + KV cache (VLLM_CPU_KVCACHE_SPACE in spec.engine.env, else
    cpu_kv_cache_gib) + cpu_model_gib`` (a tiny-model CPU replica is 2.9 GiB resident,
    docs/vllm-on-cpu.md). The simulator (``engine.kind: sim``) loads no weights:
    ``simulator_cpu`` / ``simulator_memory`` (``cpuCores`` for a CPU replica).

    Requests only (QoS Burstable) unless ``guaranteed``: then every container's limits equal its
    requests (QoS Guaranteed). ``weights_cpu`` / ``weights_memory``: the ``weights`` init container.
    """

    base_cpu: float = 2.0
    cpu_per_gpu: float = 2.0
    base_memory_gib: float = 4.0
    memory_per_gpu_gib: float = 2.0
    swap_space_gib: float = 4.0
    load_buffer_gib: float = 5.0
    cpu_kv_cache_gib: float = 4.0
    cpu_model_gib: float = 4.0
    guaranteed: bool = False
    weights_cpu: str = "1"
    weights_memory: str = "1Gi"
    simulator_cpu: str = "250m"
    simulator_memory: str = "256Mi"

    _NUMBERS = {"baseCpu": "base_cpu", "cpuPerGpu": "cpu_per_gpu", "baseMemoryGiB": "base_memory_gib",
                "memoryPerGpuGiB": "memory_per_gpu_gib", "swapSpaceGiB": "swap_space_gib",
                "loadBufferGiB": "load_buffer_gib", "cpuKvCacheGiB": "cpu_kv_cache_gib",
                "cpuModelGiB": "cpu_model_gib"}  # fmt: skip
    _QUANTITIES = {"weightsCpu": "weights_cpu", "weightsMemory": "weights_memory",
                   "simulatorCpu": "simulator_cpu", "simulatorMemory": "simulator_memory"}  # fmt: skip

    @classmethod
    def from_dict(cls, d: Any) -> EngineResources:
        """The chart's ``engine.resources`` (camelCase). Raises ValueError naming the key."""
        if not isinstance(d, dict):
            raise ValueError("FLEET_ENGINE_POD_JSON resources: must be an object")
        out: dict[str, Any] = {}
        for key, value in d.items():
            if key in cls._NUMBERS:
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                    raise ValueError(f"FLEET_ENGINE_POD_JSON resources.{key}: {value!r} is not a number >= 0")
                out[cls._NUMBERS[key]] = float(value)
            elif key in cls._QUANTITIES:
                if not isinstance(value, (str, int, float)) or isinstance(value, bool) or not str(value).strip():
                    raise ValueError(f"FLEET_ENGINE_POD_JSON resources.{key}: {value!r} is not a quantity")
                out[cls._QUANTITIES[key]] = str(value)
            elif key == "guaranteed":
                out["guaranteed"] = bool(value)
            else:
                raise ValueError(f"FLEET_ENGINE_POD_JSON resources.{key}: unknown key")
        return cls(**out)


@dataclass(frozen=True)
class EnginePodSettings:
    """Pod settings for every replica (the chart's ``engine:`` values, FLEET_ENGINE_POD_JSON)."""

    default_image: str = ""
    runtime_class_name: str = ""
    priority_class_name: str = ""
    service_account_name: str = ""
    tolerations: list[dict] = field(default_factory=list)
    node_selector: dict[str, str] = field(default_factory=dict)
    shm_size: str = ""
    extra_env: list[dict] = field(default_factory=list)
    pod_annotations: dict[str, str] = field(default_factory=dict)
    pod_labels: dict[str, str] = field(default_factory=dict)
    mig_strategy: str = "mixed"
    gangs: str = "auto"
    termination_grace_period_s: int = 120
    image_pull_secrets: list[dict] = field(default_factory=list)
    gang_service: str = "fleet-gangs"   # headless Service over gang leaders: their DNS names
    # Image pre-pull (fleet.k8s.prepull): before a replica's pod is created on a node lacking the
    # engine image; a pull without a result for this long fails; failed pulls back off
    # exponentially from the initial to the max wait; after this many failures the waiting
    # replicas fail.
    pre_pull: bool = True
    pre_pull_timeout_s: float = 1800.0
    pre_pull_backoff_s: float = 10.0
    pre_pull_max_backoff_s: float = 600.0
    pre_pull_attempts: int = 3
    # The node weight cache (``weightCache.hostPath``: the node agent's cache directory on every
    # node; "" for none) and Fleet's image, which the ``weights`` init container runs.
    weight_cache_path: str = ""
    fleet_image: str = ""
    resources: EngineResources = field(default_factory=EngineResources)
    # KV cache events (``engine.kvEvents``): every engine publishes on these container ports.
    kv_events: bool = True
    kv_events_port: int = 5557
    kv_replay_port: int = 5558

    @classmethod
    def from_json(cls, text: str, default_image: str = "") -> EnginePodSettings:
        """The chart's JSON (camelCase keys, FLEET_ENGINE_POD_JSON). Raises ValueError naming
        the key on a bad value."""
        d = json.loads(text) if text.strip() else {}
        if not isinstance(d, dict):
            raise ValueError("FLEET_ENGINE_POD_JSON: must be a JSON object")
        strategy = d.get("migStrategy", "mixed")
        if strategy not in ("mixed", "single"):
            raise ValueError(f"FLEET_ENGINE_POD_JSON migStrategy: {strategy!r} is not mixed or single")
        pull = d.get("prePull") or {}
        if not isinstance(pull, dict):
            raise ValueError("FLEET_ENGINE_POD_JSON prePull: must be an object")
        numbers = {}
        for key, default, low in (("timeoutSeconds", 1800.0, 1.0), ("initialBackoffSeconds", 10.0, 0.0),
                                  ("maxBackoffSeconds", 600.0, 0.0), ("attempts", 3, 1)):  # fmt: skip
            value = pull.get(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < low:
                raise ValueError(f"FLEET_ENGINE_POD_JSON prePull.{key}: {value!r} is not a number >= {low:g}")
            numbers[key] = value
        cache = d.get("weightCache") or {}
        if not isinstance(cache, dict):
            raise ValueError("FLEET_ENGINE_POD_JSON weightCache: must be an object")
        kv = d.get("kvEvents")
        kv = {} if kv is None else kv
        if not isinstance(kv, dict):
            raise ValueError("FLEET_ENGINE_POD_JSON kvEvents: must be an object")
        kv_ports = {}
        for key, default in (("port", 5557), ("replayPort", 5558)):
            value = kv.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536 or value == ENGINE_PORT:
                raise ValueError(f"FLEET_ENGINE_POD_JSON kvEvents.{key}: {value!r} is not a free port 1-65535")
            kv_ports[key] = value
        if kv_ports["port"] == kv_ports["replayPort"]:
            raise ValueError("FLEET_ENGINE_POD_JSON kvEvents: port and replayPort must differ")
        host_path = str(cache.get("hostPath") or "")
        if host_path and not host_path.startswith("/"):
            raise ValueError(f"FLEET_ENGINE_POD_JSON weightCache.hostPath: {host_path!r} is not an absolute path")
        return cls(
            weight_cache_path=host_path.rstrip("/") or ("/" if host_path else ""),
            fleet_image=str(d.get("fleetImage") or ""),
            resources=EngineResources.from_dict(d.get("resources") or {}),
            pre_pull=bool(pull.get("enabled", True)), pre_pull_timeout_s=float(numbers["timeoutSeconds"]),
            pre_pull_backoff_s=float(numbers["initialBackoffSeconds"]),
            pre_pull_max_backoff_s=float(numbers["maxBackoffSeconds"]), pre_pull_attempts=int(numbers["attempts"]),
            default_image=default_image, runtime_class_name=d.get("runtimeClassName") or "",
            priority_class_name=d.get("priorityClassName") or "",
            service_account_name=d.get("serviceAccountName") or "", tolerations=list(d.get("tolerations") or []),
            node_selector=dict(d.get("nodeSelector") or {}), shm_size=str(d.get("shmSize") or ""),
            extra_env=list(d.get("extraEnv") or []), pod_annotations=dict(d.get("podAnnotations") or {}),
            pod_labels=dict(d.get("podLabels") or {}), mig_strategy=strategy, gangs=d.get("gangs") or "auto",
            termination_grace_period_s=int(d.get("terminationGracePeriodSeconds", 120)),
            image_pull_secrets=list(d.get("imagePullSecrets") or []),
            gang_service=d.get("gangService") or "fleet-gangs", kv_events=bool(kv.get("enabled", True)),
            kv_events_port=kv_ports["port"], kv_replay_port=kv_ports["replayPort"],
        )  # fmt: skip
