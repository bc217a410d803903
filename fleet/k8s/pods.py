"""What a replica's pod looks like: the pure mapping from a `ReplicaWant` to a Pod manifest,
and from a Pod object back to `ReplicaFacts`.

Owns `EnginePodSettings` (cluster-wide pod settings from the chart's ``engine:`` values:
runtime class, tolerations, /dev/shm, extra env, MIG strategy, the node weight cache, the
resource sizing `EngineResources`), `model_argument` (where a pod's weights come from),
`engine_resources` (CPU and memory requests sized from the replica), `pod_manifest`,
`pod_group` and `pod_facts`, and the label and annotation keys Fleet puts on pods. No API calls: `fleet.k8s.backend` sends
what this builds. Pure functions; tests/unit/test_k8s_backend.py calls them with literals.

A replica is one Pod: ``restartPolicy: Never`` (replacing a failed replica is the controller's
decision, with its backoff, as with the local backend), bound to the node Fleet's placement
chose with ``spec.nodeName`` (the scheduler is bypassed; the kubelet still admits the pod
against its device plugins, node selector and taints), GPUs requested as
``nvidia.com/gpu: <TP>``, a MIG instance as ``nvidia.com/mig-<profile>: 1`` (device plugin's
``mixed`` strategy; ``single``: ``nvidia.com/gpu: 1``), ``/health`` as readiness, liveness and
startup probe (the startup probe allows ``spec.engine.startupTimeoutSeconds``). Which GPU of the
node the pod gets is the device plugin's choice: placement decides the node and how many.

Weights from the node's cache (``weightCache.hostPath`` set, the chart's default with the node
agent): for an ``hf://``, ``http(s)://`` (or, once the cache reads it, ``s3://``) source the pod
has an init container ``weights`` (Fleet's image, UID 10001) that runs ``fleet cache pull SOURCE
--root HOSTPATH --link /fleet/model/current --holder $(POD_UID)``: one download per node (the
cache's per-model file lock makes pods on one node wait for one fetch), the entry pinned for the
pod, and a symlink to its directory in the pod's emptyDir ``model``. The engine mounts the cache
read-only at the same path (the entry's files are relative symlinks into ``../../blobs``, so
only the whole cache root keeps them valid) and serves ``/fleet/model/current`` under
``--served-model-name spec.model.name``. Without a cache an ``hf://org/name@rev`` source is
``org/name --revision rev`` (vLLM downloads it itself).

KV cache events (the chart's ``engine.kvEvents``, on by default): the engine (vLLM or the
simulator) starts with ``--kv-events-config`` binding its PUB socket on ``tcp://*:5557`` and its
replay socket on ``tcp://*:5558`` (vLLM binds PUB only for a wildcard address,
vllm/distributed/kv_events.py), both declared as container ports ``kv-events`` and
``kv-replay``; `pod_facts` gives routers ``tcp://<pod IP>:<port>`` from those declared ports,
so an adopted pod keeps its addresses. A deployment whose ``engine.args`` carry their own
``--kv-events-config`` keeps it, and its pods publish no addresses.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from fleet.controller.backend import LaunchError, ReplicaFacts, ReplicaWant, engine_model
from fleet.engines.kinds import KvEventsBind, fleet_kv_events, get_engine
from fleet.inventory.gfd import GFD_PRODUCT

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "fleet-operator"
LABEL_FLEET = "fleet.inference.dev/fleet"
LABEL_DEPLOYMENT = "fleet.inference.dev/deployment"
LABEL_REPLICA = "fleet.inference.dev/replica"
LABEL_REVISION = "fleet.inference.dev/revision"
LABEL_SPEC_HASH = "fleet.inference.dev/spec-hash"
LABEL_GANG_ROLE = "fleet.inference.dev/gang-role"      # leader | worker (multi-node replicas only)
LABEL_GANG_INDEX = "fleet.inference.dev/gang-index"    # 0 (leader) .. size-1
LABEL_GANG_SIZE = "fleet.inference.dev/gang-size"
RAY_PORT = 6379
ANNOTATION_PLACEMENT = "fleet.inference.dev/placement"
ANNOTATION_MODEL = "fleet.inference.dev/model"          # spec.model.name (the router pool it serves)
ANNOTATION_READY_AT = "fleet.inference.dev/ready-at"    # Unix seconds its warm-up passed (operator writes it)
ANNOTATION_REVISION = "fleet.inference.dev/revision"    # spec.model.revision as written (the label is sanitised)
ENGINE_PORT = 8000
KV_EVENTS_PORT_NAME = "kv-events"          # container port of the engine's KV event PUB socket
KV_REPLAY_PORT_NAME = "kv-replay"          # ... and of its replay ROUTER socket
ENGINE_CONTAINER = "engine"
WEIGHTS_CONTAINER = "weights"              # init container filling the node cache (weightCache set)
MODEL_DIR = "/fleet/model"                 # emptyDir of the pod: the link to the cache entry
MODEL_LINK = f"{MODEL_DIR}/current"        # what the engine is given as its model
FLEET_UID = 10001                          # the user of Fleet's image (charts/fleet/Dockerfile)
_CACHED_SCHEMES = ("hf://", "s3://", "http://", "https://")

# How each engine kind starts inside its image (the local backend runs `EngineKind.entry` with
# this interpreter; a pod runs the image's own entry point).
POD_ENTRY = {
    "vllm": lambda model: ["vllm", "serve", model],
    "sim": lambda model: ["python", "-m", "fleet.enginesim", "--model", model],
}
_NOT_IN_PODS = ("CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")   # the device plugin / kubelet pin devices
_IMAGE_PROBLEMS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                   "CreateContainerConfigError", "CreateContainerError", "RunContainerError")  # fmt: skip
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(text: str) -> str:
    """A string as a label value (<= 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-_.") or "none"


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


@dataclass(frozen=True)
class ModelFiles:
    """How a pod reaches its weights: the engine's model argument (``model``), flags that go
    with it (``--revision``), the pod's volumes, the engine container's mounts and the init
    containers that fill them."""

    model: str
    extra_args: tuple[str, ...] = ()
    volumes: tuple[dict, ...] = ()
    mounts: tuple[dict, ...] = ()
    init_containers: tuple[dict, ...] = ()


def model_argument(want: ReplicaWant, settings: EnginePodSettings = EnginePodSettings()) -> ModelFiles:
    """Where the replica's weights come from in a pod (see the module docstring).

    ``sim://`` -> the simulator profile; an absolute path or ``file://`` -> that path on the
    node, mounted read-only; ``hf://``, ``http(s)://``, ``s3://`` with a weight cache -> the
    ``weights`` init container and ``/fleet/model/current``; ``hf://org/name@rev`` without one ->
    ``org/name`` and ``--revision rev`` (vLLM downloads it; the simulator gets the source as
    written). Raises LaunchError naming spec.model.source for relative paths (relative to what,
    in a pod?), a remote source the cache cannot read, http(s):// or s3:// without a cache, and
    a cache without Fleet's image (``fleetImage``)."""
    from fleet.sources import SourceError, parse_source

    dep = want.deployment
    source = dep.spec.model.source
    sim = dep.spec.engine.kind == "sim"
    if source.startswith(_CACHED_SCHEMES) and settings.weight_cache_path:
        try:
            parse_source(source)
        except SourceError as err:
            raise LaunchError(f"weights not present: spec.model.source {source!r}: the node weight cache cannot "
                              f"read it: {err}") from None  # fmt: skip
        if not settings.fleet_image:
            raise LaunchError("weights not present: the operator has no Fleet image for the weights init container "
                              "(FLEET_ENGINE_POD_JSON fleetImage)")  # fmt: skip
        return ModelFiles(MODEL_LINK, (), *_cache_volumes(want, settings))
    if sim:
        return ModelFiles(engine_model(want))
    if source.startswith("hf://"):
        repo, _, revision = source[len("hf://"):].partition("@")
        return ModelFiles(repo, ("--revision", revision) if revision else ())
    if source.startswith(("s3://", "http://", "https://")):
        raise LaunchError(f"weights not present: spec.model.source {source!r} needs the node weight cache on "
                          "Kubernetes (the chart's agent.enabled sets weightCache.hostPath); use hf:// or a path "
                          "on the nodes")  # fmt: skip
    path = source[len("file://"):] if source.startswith("file://") else source
    if not path.startswith("/"):
        raise LaunchError(f"spec.model.source {source!r}: a relative path means nothing in a pod; "
                          "use an absolute path on the nodes, file:// or hf://")  # fmt: skip
    return ModelFiles(path, (), ({"name": "weights", "hostPath": {"path": path, "type": "Directory"}},),
                      ({"name": "weights", "mountPath": path, "readOnly": True},))


def _cache_volumes(want: ReplicaWant, settings: EnginePodSettings) -> tuple[tuple, tuple, tuple]:
    """(volumes, engine mounts, init containers) of a pod whose weights come from the node cache."""
    spec = want.deployment.spec
    root = settings.weight_cache_path
    volumes = ({"name": "weight-cache", "hostPath": {"path": root, "type": "Directory"}},
               {"name": "model", "emptyDir": {"sizeLimit": "1Mi"}})  # fmt: skip
    mounts = ({"name": "weight-cache", "mountPath": root, "readOnly": True},
              {"name": "model", "mountPath": MODEL_DIR, "readOnly": True})  # fmt: skip
    env = [{"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
           {"name": "HF_HOME", "value": f"{MODEL_DIR}/.hf"},   # huggingface_hub's files: a writable place
           *({"name": k, "value": v} for k, v in sorted(spec.engine.env.items())), *settings.extra_env]  # fmt: skip
    resources = {"requests": {"cpu": settings.resources.weights_cpu, "memory": settings.resources.weights_memory}}
    if settings.resources.guaranteed:
        resources["limits"] = dict(resources["requests"])
    init = {
        "name": WEIGHTS_CONTAINER,
        "image": settings.fleet_image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["fleet", "cache", "pull", spec.model.source, "--root", root, "--link", MODEL_LINK,
                    "--holder", "$(POD_UID)"],
        "env": env,
        "resources": resources,
        "terminationMessagePolicy": "FallbackToLogsOnError",   # the pull's error becomes the pod's reason
        "volumeMounts": [{"name": "weight-cache", "mountPath": root}, {"name": "model", "mountPath": MODEL_DIR}],
        "securityContext": {"runAsUser": FLEET_UID, "runAsGroup": FLEET_UID, "runAsNonRoot": True,
                            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }  # fmt: skip
    return volumes, mounts, (init,)


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


def pod_manifest(want: ReplicaWant, *, fleet_id: str, owner: dict | None,
                 settings: EnginePodSettings) -> dict[str, Any]:  # fmt: skip
    """The Pod of one replica (single-node placements). Raises LaunchError when it cannot be
    built: no image, weights the pod cannot reach, a multi-node placement."""
    dep = want.deployment
    spec = dep.spec
    if len(want.placement.members) != 1:
        raise LaunchError(f"placement {want.placement.label} is a multi-node gang: use pod_group")
    image = spec.engine.image or settings.default_image
    if not image:
        raise LaunchError("engine image not present: spec.engine.image is unset and the operator has no "
                          "default engine image (FLEET_ENGINE_IMAGE)")  # fmt: skip
    files = model_argument(want, settings)
    model = files.model
    engine = get_engine(spec.engine.kind)
    launch = dep.engine_launch(want.base_dir)
    kv = settings.kv_events and fleet_kv_events(spec.engine.args)
    bind = KvEventsBind(f"tcp://*:{settings.kv_events_port}", f"tcp://*:{settings.kv_replay_port}") if kv else None
    argv = engine.command(launch, model, "0.0.0.0", ENGINE_PORT, bind)
    flags = argv[len(engine.entry(model)):]
    command = [*POD_ENTRY[spec.engine.kind](model), *files.extra_args, *flags]
    env = {**engine.env(launch), **spec.engine.env, **{k: v for k, v in want.placement.env.items() if k not in _NOT_IN_PODS}}
    env_list = [{"name": k, "value": v} for k, v in sorted(env.items())]
    env_list += [{"name": "FLEET_REPLICA_ID", "value": want.replica_id},
                 {"name": "FLEET_DEPLOYMENT", "value": dep.name}, *settings.extra_env]  # fmt: skip
    startup_s = spec.engine.startup_timeout_seconds
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 2}
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command,
        "env": env_list,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
                  *([{"name": KV_EVENTS_PORT_NAME, "containerPort": settings.kv_events_port, "protocol": "TCP"},
                     {"name": KV_REPLAY_PORT_NAME, "containerPort": settings.kv_replay_port, "protocol": "TCP"}]
                    if kv else [])],
        "resources": engine_resources(want, settings),
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": max(1, int(startup_s // 5) + 1)},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [],
    }
    volumes = []
    if settings.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    volumes.extend(files.volumes)
    container["volumeMounts"].extend(files.mounts)
    if not container["volumeMounts"]:
        del container["volumeMounts"]
    labels = {
        **settings.pod_labels,
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_FLEET: label_value(fleet_id),
        LABEL_DEPLOYMENT: dep.name,
        LABEL_REPLICA: want.replica_id,
        LABEL_REVISION: label_value(spec.model.revision),
        LABEL_SPEC_HASH: want.spec_hash,
    }
    metadata: dict[str, Any] = {
        "name": want.replica_id,
        "labels": labels,
        "annotations": {**settings.pod_annotations,
                        ANNOTATION_PLACEMENT: json.dumps(want.placement.to_dict(), sort_keys=True),
                        ANNOTATION_MODEL: spec.model.name, ANNOTATION_REVISION: spec.model.revision},
    }  # fmt: skip
    if owner is not None:
        metadata["ownerReferences"] = [{
            "apiVersion": owner.get("apiVersion", ""), "kind": owner.get("kind", ""),
            "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
            "controller": True, "blockOwnerDeletion": True,
        }]  # fmt: skip
    pod_spec: dict[str, Any] = {
        "nodeName": want.placement.nodes[0],
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": settings.termination_grace_period_s,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [container],
    }
    if files.init_containers:
        pod_spec["initContainers"] = list(files.init_containers)
    if volumes:
        pod_spec["volumes"] = volumes
    selector = dict(settings.node_selector)
    if (product := product_selector(want)) is not None:
        selector.setdefault(GFD_PRODUCT, product)
    for key, value in (("runtimeClassName", settings.runtime_class_name),
                       ("priorityClassName", settings.priority_class_name),
                       ("serviceAccountName", settings.service_account_name),
                       ("tolerations", settings.tolerations), ("nodeSelector", selector),
                       ("imagePullSecrets", settings.image_pull_secrets)):  # fmt: skip
        if value:
            pod_spec[key] = value
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def product_selector(want: ReplicaWant) -> str | None:
    """The ``nvidia.com/gpu.product`` value a whole-GPU replica's pod selects: the product
    placement chose for its revision (`fleet.placement.shapes.ReplicaPlacement.product`, spelled
    as the node's GPU Feature Discovery label spells it, since the Kubernetes inventory is read
    from that label). Every replica of a revision runs on one product (``gpuProduct`` may list
    several); the pod is bound by ``nodeName``, and the kubelet refuses it if the node's label no
    longer names that product. None for MIG and CPU replicas (GFD's ``single`` MIG strategy
    relabels the product) and for a product that is no label value."""
    product = want.placement.product
    resources = want.deployment.spec.resources
    if not product or resources.accelerator != "gpu" or resources.mig_profile:
        return None
    return product if label_value(product) == product else None


def pod_facts(pod: dict) -> ReplicaFacts:
    """What a Pod object says about its replica (see `fleet.controller.backend.ReplicaFacts`)."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    node = (pod.get("spec") or {}).get("nodeName", "")
    statuses = [c for c in status.get("containerStatuses") or [] if c.get("name") == ENGINE_CONTAINER]
    cs = statuses[0] if statuses else {}
    state = cs.get("state") or {}
    ip = status.get("podIP")
    detail = {"pod": meta["name"], "node": node or "-", "phase": phase}
    if ip:
        detail["ip"] = ip
    running = "running" in state and phase == "Running"
    image_present = bool(cs.get("imageID")) or "running" in state or "terminated" in state
    exited, code, reason, problem = False, None, None, None
    if phase in ("Succeeded", "Failed") or "terminated" in state:
        exited = True
        term = state.get("terminated") or {}
        code = term.get("exitCode")
        why = status.get("reason") or term.get("reason") or phase
        message = status.get("message") or term.get("message") or ""
        reason = f"pod {phase.lower()}: {why}" + (f": {message}" if message else "")
        if code is not None:
            reason += f" (exit code {code})"
    weights_present = image_present
    inits = [c for c in status.get("initContainerStatuses") or [] if c.get("name") == WEIGHTS_CONTAINER]
    if inits or any(c.get("name") == WEIGHTS_CONTAINER for c in (pod.get("spec") or {}).get("initContainers") or []):
        init_state = (inits[0].get("state") or {}) if inits else {}
        done = init_state.get("terminated") or {}
        weights_present = done.get("exitCode") == 0 or "running" in state or "terminated" in state
        if "running" in init_state:
            detail["cache"] = "fetching the weights into the node cache (init container weights)"
        if done and done.get("exitCode") not in (None, 0):
            why = f"the weights init container exited {done.get('exitCode')}: {done.get('reason') or 'Error'}"
            message = (done.get("message") or "").strip()
            exited, code, reason = True, done.get("exitCode"), why + (f": {message}" if message else "")
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in _IMAGE_PROBLEMS:
        problem = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
        if waiting["reason"] != "ErrImagePull":   # the first pull error may be transient; back-off is not
            exited, reason = True, f"container cannot start: {problem}"
    endpoint = f"http://{ip}:{ENGINE_PORT}" if ip and (running or exited) else None
    return ReplicaFacts(
        replica_id=labels.get(LABEL_REPLICA, meta["name"]), deployment=labels.get(LABEL_DEPLOYMENT, "?"),
        spec_hash=labels.get(LABEL_SPEC_HASH, ""), node=node, endpoint=endpoint,
        image_present=image_present, weights_present=weights_present, running=running and not exited,
        exited=exited, exit_code=code, exit_reason=reason, problem=problem, detail=detail,
        kv_events=pod_kv_events(pod, ip) if endpoint is not None else None,
    )  # fmt: skip


def pod_kv_events(pod: dict, ip: str | None) -> dict[str, str | None] | None:
    """Where routers subscribe to the pod's KV cache events: ``tcp://<pod IP>:<port>`` of the
    engine container's declared ``kv-events`` (and ``kv-replay``) ports; None when it declares
    none (events off, or a pod made before they were)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    engine = next((c for c in containers if c.get("name") == ENGINE_CONTAINER), None)
    ports = {p.get("name"): p.get("containerPort") for p in (engine or {}).get("ports") or []}
    if not ip or not isinstance(ports.get(KV_EVENTS_PORT_NAME), int):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    replay = ports.get(KV_REPLAY_PORT_NAME)
    return {"publisher": f"tcp://{host}:{ports[KV_EVENTS_PORT_NAME]}",
            "replay": f"tcp://{host}:{replay}" if isinstance(replay, int) else None, "topic": ""}


def member_name(replica_id: str, index: int) -> str:
    """Pod name of gang member ``index`` (0 is the leader and carries the replica id itself)."""
    return replica_id if index == 0 else f"{replica_id}-w{index}"


def pod_group(want: ReplicaWant, *, fleet_id: str, owner: dict | None,
              settings: EnginePodSettings) -> list[dict[str, Any]]:  # fmt: skip
    """The pods of one replica: one pod, or for a multi-node placement (a gang) one pod per
    member, created all or nothing, members[0] the leader.

    A gang runs vLLM over Ray, as vLLM documents multi-node serving (docs.vllm.ai, "Parallelism
    and Scaling"; examples/online_serving/multi-node-serving.sh): the leader starts the Ray head,
    waits until every member has joined, then runs ``vllm serve`` with tensor parallelism over
    the GPUs of one node and pipeline parallelism over the nodes; each worker joins the head at
    the leader's DNS name (``<replica>.<gang service>``: the pod's hostname and subdomain under
    the chart's headless Service) and blocks. Only the leader serves, is probed and is the
    endpoint. Raises LaunchError for an engine without a multi-node mode (the simulator)."""
    if len(want.placement.members) == 1:
        return [pod_manifest(want, fleet_id=fleet_id, owner=owner, settings=settings)]
    dep = want.deployment
    if dep.spec.engine.kind != "vllm":
        raise LaunchError(f"spec.engine.kind {dep.spec.engine.kind!r} has no multi-node mode; a replica wider than "
                          f"a node ({want.placement.label}) needs vllm")  # fmt: skip
    members = want.placement.members
    size = len(members)
    per_node = len(members[0].devices)
    leader_want = ReplicaWant(want.replica_id, dep, type(want.placement)((members[0],), want.placement.product),
                              want.spec_hash, want.base_dir)  # fmt: skip
    leader = pod_manifest(leader_want, fleet_id=fleet_id, owner=owner, settings=settings)
    c = leader["spec"]["containers"][0]
    serve = list(c["command"])
    i = serve.index("--tensor-parallel-size")
    serve[i + 1: i + 2] = [str(per_node), "--pipeline-parallel-size", str(size),
                           "--distributed-executor-backend", "ray"]  # fmt: skip
    wait = ("import ray, sys, time\n"
            "ray.init(address='auto', logging_level=40)\n"
            f"while sum(n['Alive'] for n in ray.nodes()) < {size}: time.sleep(2)\n")  # fmt: skip
    c["command"] = ["bash", "-c", f"ray start --head --port={RAY_PORT} && python3 -c \"$FLEET_RAY_WAIT\" && exec "
                    + " ".join(_sh(a) for a in serve)]  # fmt: skip
    c["env"].append({"name": "FLEET_RAY_WAIT", "value": wait})
    c["resources"] = engine_resources(want, settings, gpus=per_node)
    c["ports"].append({"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"})
    leader["spec"]["hostname"] = want.replica_id
    leader["spec"]["subdomain"] = settings.gang_service
    pods = [leader]
    leader_dns = f"{want.replica_id}.{settings.gang_service}"
    for index, member in enumerate(members[1:], start=1):
        worker = json.loads(json.dumps(leader))
        worker["metadata"]["name"] = member_name(want.replica_id, index)
        worker["spec"]["nodeName"] = member.node
        worker["spec"].pop("hostname")
        worker["spec"].pop("subdomain")
        wc = worker["spec"]["containers"][0]
        wc["command"] = ["bash", "-c", f"until ray start --address={leader_dns}:{RAY_PORT} --block; do sleep 5; done"]
        wc["env"] = [e for e in wc["env"] if e["name"] != "FLEET_RAY_WAIT"]
        wc["resources"] = engine_resources(want, settings, gpus=len(member.devices))
        wc["ports"] = [{"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"}]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            wc.pop(probe, None)
        pods.append(worker)
    for index, pod in enumerate(pods):
        pod["metadata"]["labels"].update({LABEL_GANG_ROLE: "leader" if index == 0 else "worker",
                                          LABEL_GANG_INDEX: str(index), LABEL_GANG_SIZE: str(size)})  # fmt: skip
    return pods


def _sh(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def group_facts(pods: list[dict]) -> ReplicaFacts:
    """One replica's facts from all its pods (one, or a gang's members): the leader's endpoint;
    running while every member runs; exited when any member exited or one is missing."""
    by_index = {int((p["metadata"].get("labels") or {}).get(LABEL_GANG_INDEX, "0")): p for p in pods}
    leader = by_index.get(0)
    size = int(((leader or pods[0])["metadata"].get("labels") or {}).get(LABEL_GANG_SIZE, "1"))
    facts = pod_facts(leader or pods[0])
    if size == 1:
        return facts
    members = [pod_facts(by_index[i]) for i in sorted(by_index)]
    exited = [(i, f) for i, f in zip(sorted(by_index), members) if f.exited]
    missing = [i for i in range(size) if i not in by_index]
    detail = {**facts.detail, "members": str(size)}
    if leader is None or exited or missing:
        why = (f"gang member {exited[0][0]} exited: {exited[0][1].exit_reason}" if exited
               else f"gang member(s) {missing} missing")  # fmt: skip
        return ReplicaFacts(facts.replica_id, facts.deployment, facts.spec_hash, facts.node, None,
                            all(f.image_present for f in members), all(f.weights_present for f in members),
                            False, True, exited[0][1].exit_code if exited else None, why, facts.problem, detail)
    return ReplicaFacts(
        facts.replica_id, facts.deployment, facts.spec_hash, facts.node, facts.endpoint,
        all(f.image_present for f in members), all(f.weights_present for f in members),
        all(f.running for f in members), False, None, None, next((f.problem for f in members if f.problem), None),
        detail, kv_events=facts.kv_events,
    )  # fmt: skip
