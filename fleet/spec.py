"""The `InferenceDeployment` document a model owner writes, and loading it from YAML.

Owns the pydantic models of the spec (apiVersion, kind, metadata, spec: model, resources,
replicas, standby, routing, prePull; `engine` is `fleet.engines.spec.EngineSpec`, `warmup`
`warmup.plan.WarmupPlan`, `autoscaling` `autoscaler.spec.AutoscalingSpec`, `rollout`
`fleet.rollout.spec.RolloutSpec`), the YAML loader for one or many files with several
documents each, and the error format: every problem names its file, document, field path and
reason
(``quickstart.yaml[0] spec.replicas.min: must be <= spec.replicas.max (3 > 2)``). A rule over
several fields is a `fleet.base.rules.CrossFieldRule` in its section's ``cross_field_rules``: the
CRD's CEL rule (`fleet.k8s.crd`) comes from the same record, with the same words.

Called by the CLI (`fleet validate`, `fleet up`) and the controller. Nothing is started from a
document that fails here.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

from autoscaler.spec import AutoscalingSpec
from fleet.engines.kinds import ENGINE_KINDS, EngineLaunch
from fleet.engines.spec import EngineSpec
from fleet.rollout.spec import RolloutSpec
from fleet.sources import ModelSource, Scheme, SourceError
from router.pools.policies import ROUTING_POLICIES
from router.pools.upstream import DEFAULT_MAX_STREAM_DURATION_S, DEFAULT_MIGRATION_LIMIT, DEFAULT_MIN_BYTES_PER_S, \
    DEFAULT_RATE_WINDOW_S
from fleet.base.names import DNS_LABEL, MIG_PROFILE
from fleet.base.rules import CrossFieldRule, sections_in
from fleet.base.spec import FieldError, SpecModel
from fleet.base.yaml_text import yaml_problem
from warmup.plan import WarmupPlan

API_VERSION = "fleet.inference.dev/v1alpha1"
KIND = "InferenceDeployment"



class Metadata(SpecModel):
    name: str = Field(..., max_length=63, description="Deployment name, a DNS-1123 label.")
    labels: dict[str, str] = Field(
        default_factory=dict,
        description="Free-form labels of the deployment; Fleet reads none of them (on Kubernetes: the resource's "
        "own labels).",
    )

    @field_validator("name")
    @classmethod
    def _dns_label(cls, v: str) -> str:
        if not DNS_LABEL.match(v):  # the name becomes part of replica ids, pod names and metric labels
            raise ValueError(
                f"{v!r} is not a DNS-1123 label (lower-case letters, digits and '-', "
                "starting and ending with a letter or digit)"
            )
        return v


class ModelSpec(SpecModel):
    name: str = Field(
        ..., min_length=1, max_length=256,
        description="The model name clients send in requests (`model` field); the router routes by it.",
    )
    source: str = Field(
        ..., min_length=1,
        description="Where the weights are: a local path (absolute, or relative to the YAML file), "
        "file:///abs/path, hf://org/name[@revision], or an http(s):// manifest URL (remote sources are fetched "
        "by the node agent's weight cache, docs/node-agent.md); "
        "with engine.kind sim, sim://PROFILE names a simulator profile instead. fleet validate refuses a local "
        "path that does not exist (--paths-on-nodes: a path that exists only on the GPU nodes).",
    )
    revision: str = Field("v1", min_length=1, max_length=128, description="Version label of these weights.")

    @field_validator("source")
    @classmethod
    def _parses(cls, v: str) -> str:
        try:
            ModelSource.parse(v)
        except SourceError as err:
            raise ValueError(str(err)) from None
        return v

    @property
    def parsed_source(self) -> ModelSource:
        """``source`` parsed (`fleet.sources.ModelSource`; validated when the spec was)."""
        return ModelSource.parse(self.source)

    def local_path(self, base_dir: Path) -> Path | None:
        """The weights directory on this machine, or None for a remote or simulated source.

        A relative path is resolved against ``base_dir`` (the YAML file's directory).
        """
        return self.parsed_source.local_path(base_dir)


class ResourcesSpec(SpecModel):
    accelerator: Literal["gpu", "cpu"] = Field(
        "gpu", description="`gpu`: whole GPUs or a MIG slice per replica; `cpu`: CPU cores (vLLM CPU build)."
    )
    gpu_product: str | list[str] | None = Field(
        None,
        description="GPU product name as NVML reports it, e.g. 'NVIDIA H100 80GB HBM3' (GFD's "
        "'NVIDIA-H100-80GB-HBM3' is the same product), or a list of acceptable products in order of "
        "preference. Every replica of one revision runs on one product: the first listed that can host the "
        "replicas (docs/placement.md#gpu-products). Any product if unset.",
    )  # fmt: skip
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per replica (vLLM tensor parallelism).")
    mig_profile: str | None = Field(None, description="One MIG instance of this profile per replica, e.g. 3g.40gb. "
                                    "Without gpuProduct, fleet validate sizes it as NVML reports it on an H100 80GB "
                                    "(3g.40gb: 40,448 MiB).")
    cpu_cores: int = Field(1, ge=1, le=1024, description="CPU cores per replica (accelerator: cpu).")

    @field_validator("gpu_product")
    @classmethod
    def _products(cls, v: str | list[str] | None) -> str | list[str] | None:
        if v is None:
            return None
        names = [v] if isinstance(v, str) else v
        if not names:
            raise ValueError("an empty list; name at least one product, or leave gpuProduct unset for any")
        seen: dict[str, int] = {}
        for i, name in enumerate(names):
            if not name.strip():
                raise ValueError("an empty product name" + (f" at [{i}]" if not isinstance(v, str) else ""))
            # fleet.inventory.model.product_key's comparison (spaces, dashes, an NVIDIA prefix)
            key = re.sub(r"[\s_\-]+", "-", name.strip()).lower().removeprefix("nvidia-")
            if key in seen:
                raise ValueError(f"{name!r} at [{i}] is the same product as [{seen[key]}] ({names[seen[key]]!r})")
            seen[key] = i
        return v

    @property
    def gpu_products(self) -> tuple[str, ...]:
        """``gpuProduct`` as a tuple, most preferred first; () for any product."""
        if self.gpu_product is None:
            return ()
        return (self.gpu_product,) if isinstance(self.gpu_product, str) else tuple(self.gpu_product)

    @field_validator("mig_profile")
    @classmethod
    def _mig_name(cls, v: str | None) -> str | None:
        if v is not None and not MIG_PROFILE.match(v):
            raise ValueError(f"{v!r} is not a MIG profile name such as 1g.10gb or 3g.40gb")
        return v

    cross_field_rules = (
        CrossFieldRule(
            cel=None, no_cel="the CRD keeps gpuProduct (a name or a list of names) as an untyped value, which "
            "CEL cannot read",
            holds=lambda r: r.accelerator != "cpu" or r.gpu_product is None,
            field="gpuProduct", message="is a GPU setting; remove it or set accelerator: gpu",
            breaks={"resources": {"accelerator": "cpu", "gpuProduct": "NVIDIA H100 80GB HBM3"}},
            keeps=({"resources": {"accelerator": "gpu", "gpuProduct": "NVIDIA H100 80GB HBM3"}},),
        ),
        CrossFieldRule(
            cel="self.accelerator != 'cpu' || !has(self.migProfile)",
            holds=lambda r: r.accelerator != "cpu" or r.mig_profile is None,
            field="migProfile", message="is a GPU setting; remove it or set accelerator: gpu",
            breaks={"resources": {"accelerator": "cpu", "migProfile": "1g.10gb"}},
            keeps=({"resources": {"accelerator": "gpu", "migProfile": "1g.10gb"}},),
        ),
        CrossFieldRule(
            cel="self.accelerator != 'cpu' || self.tensorParallelSize == 1",
            holds=lambda r: r.accelerator != "cpu" or r.tensor_parallel_size == 1,
            field="tensorParallelSize", message="must be 1 with accelerator: cpu",
            breaks={"resources": {"accelerator": "cpu", "tensorParallelSize": 2}},
            keeps=({"resources": {"accelerator": "cpu", "tensorParallelSize": 1}},),
        ),
        CrossFieldRule(
            cel="!has(self.migProfile) || self.tensorParallelSize == 1",
            holds=lambda r: r.mig_profile is None or r.tensor_parallel_size == 1,
            field="tensorParallelSize",
            message="must be 1 with migProfile {migProfile} (got {tensorParallelSize}): MIG slices have no NVLink "
            "or CUDA IPC, so tensor parallelism across slices is not possible",
            breaks={"resources": {"migProfile": "3g.40gb", "tensorParallelSize": 2}},
            keeps=({"resources": {"migProfile": "3g.40gb", "tensorParallelSize": 1}},),
        ),
    )


class ReplicasSpec(SpecModel):
    min: int = Field(1, ge=0, le=10_000, description="Fewest replicas.")
    max: int = Field(1, ge=1, le=10_000, description="Most replicas.")
    initial: int | None = Field(None, ge=0, description="Replicas at start; defaults to min.")

    cross_field_rules = (
        CrossFieldRule(
            cel="self.min <= self.max", holds=lambda r: r.min <= r.max,
            field="min", message="must be <= spec.replicas.max ({min} > {max})",
            breaks={"replicas": {"min": 3, "max": 2}}, keeps=({"replicas": {"min": 2, "max": 2}},),
        ),
        CrossFieldRule(
            cel="!has(self.initial) || (self.min <= self.initial && self.initial <= self.max)",
            holds=lambda r: r.initial is None or r.min <= r.initial <= r.max,
            field="initial", message="must be within spec.replicas.min..max ({min}..{max}), got {initial}",
            breaks={"replicas": {"min": 1, "max": 2, "initial": 5}},
            keeps=({"replicas": {"min": 1, "max": 2, "initial": 2}},),
        ),
    )

    @property
    def desired_at_start(self) -> int:
        return self.min if self.initial is None else self.initial


class StandbySpec(SpecModel):
    """Replicas kept placed, loaded and asleep (vLLM sleep mode), woken on a scale-up in seconds."""

    max_replicas: int = Field(
        0, alias="maxReplicas", ge=0, le=10_000,
        description="Most standby replicas kept beside the serving ones: placed, loaded and asleep (vLLM "
        "sleep mode level 1: weights in CPU memory, KV cache freed), holding their GPUs but out of the "
        "router's pool. A scale-down sleeps a drained replica instead of stopping it while fewer are kept; "
        "a scale-up wakes one (seconds) before starting a new one (minutes). 0: off.",
    )
    sleep_level: Literal[1] = Field(
        1, alias="sleepLevel",
        description="vLLM sleep level: 1 (weights offloaded to CPU memory). Level 2 discards the weights, "
        "so a wake would reload them: not offered.",
    )


class RoutingSpec(SpecModel):
    policy: str = Field("kv-aware", description="Routing policy name (see `fleet validate --help`).")
    max_concurrency_per_endpoint: int | None = Field(
        None, ge=1, le=100_000,
        description="Most requests one replica gets at once; more wait in the router's admission queue "
        "(first come, first served) and a replica that joins takes them at once. Unset: no router queue, "
        "requests queue inside the engines. Set it near the engine's batch size (vLLM --max-num-seqs).",
    )  # fmt: skip
    max_queue_length: int = Field(
        1000, ge=0, le=1_000_000, description="Most requests waiting in the admission queue; more get 503."
    )
    queue_timeout_seconds: float = Field(
        30.0, gt=0, le=3600, description="Longest wait in the admission queue before a 503 (seconds)."
    )
    first_token_timeout_seconds: float | None = Field(
        None, gt=0, le=3600,
        description="Seconds the router waits for a replica's first streamed token (a non-streamed answer: its "
        "head, plus 0.2 s per max_tokens) before it sends the request to another replica and counts a stall "
        "(replicas that stall twice in a row are ejected for a while). Unset: 10 s plus the prompt's "
        "prefill at 1,000 tokens/s, a floor well below any measured engine (docs/routing.md).",
    )  # fmt: skip
    max_retries: int = Field(
        1, ge=0, le=10,
        description="Times a request is sent to another replica after a first-token timeout or a 5xx, while "
        "nothing has been streamed to the client.",
    )
    migration_limit: int = Field(
        DEFAULT_MIGRATION_LIMIT, ge=0, le=10,
        description="Times a stream whose replica failed mid-way goes on from another replica of its revision, "
        "with the prompt and the text streamed so far (Dynamo's migration_limit; 0: never).",
    )
    max_stream_duration_seconds: float | None = Field(
        DEFAULT_MAX_STREAM_DURATION_S, gt=0, le=86400,
        description="Longest a request may take in the router, arrival to last byte, retries and migrations "
        "included (Envoy's max_stream_duration); unset: no limit.",
    )
    min_bytes_per_second: float = Field(
        DEFAULT_MIN_BYTES_PER_S, ge=0, le=1e9,
        description="Least bytes per second a replica's stream must bring once it began, measured over "
        "byteRateWindowSeconds; a slower one is cut (and migrated). 0: no floor.",
    )
    byte_rate_window_seconds: float = Field(
        DEFAULT_RATE_WINDOW_S, gt=0, le=3600, description="Seconds over which minBytesPerSecond is measured."
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        return ROUTING_POLICIES.check(v)


# Kubernetes label syntax (kubernetes.io/docs/concepts/overview/working-with-objects/labels):
# an optional DNS-subdomain prefix and "/", then a name of <= 63 characters; values <= 63.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class PrePullSpec(SpecModel):
    """Kubernetes only: pull the engine image onto every node matching ``nodeSelector`` ahead of
    need (fleet/k8s/prepull.py); the nodes a replica is placed on are pre-pulled anyway."""

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels that must all match (empty: every node engine pods may use).",
    )
    max_parallel: int = Field(4, ge=1, le=1000, description="Most nodes pulling the image at once.")

    @field_validator("node_selector")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            prefix, _, name = key.rpartition("/")
            if not _LABEL_NAME.match(name) or (prefix and (len(prefix) > 253 or not _LABEL_PREFIX.match(prefix))):
                raise FieldError(key, "is not a Kubernetes label key ([prefix/]name, name <= 63 characters of "
                                      "letters, digits, '-', '_', '.')")  # fmt: skip
            if value and not _LABEL_NAME.match(value):
                raise FieldError(key, f"{value!r} is not a Kubernetes label value (<= 63 characters of letters, "
                                      "digits, '-', '_', '.', alphanumeric at both ends)")  # fmt: skip
        return v


class DeploymentSpec(SpecModel):
    model: ModelSpec = Field(
        ..., description="What is served: the name clients ask for, where the weights are, and their revision."
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        description="The inference engine every replica runs (vLLM, or the engine simulator) and its arguments.",
    )
    resources: ResourcesSpec = Field(
        default_factory=ResourcesSpec,
        description="The shape of one replica: whole GPUs (tensor parallel), one MIG instance, or CPU cores "
        "(docs/placement.md).",
    )
    replicas: ReplicasSpec = Field(
        default_factory=ReplicasSpec,
        description="How many replicas: the bounds the autoscaler scales within, and the count at start.",
    )
    priority: int = Field(
        0, ge=-1_000_000_000, le=1_000_000_000,
        description="How much this deployment matters against others competing for the same GPUs (higher "
        "wins; the range of a Kubernetes PriorityClass value). A deployment below spec.replicas.min whose "
        "replicas cannot be placed preempts replicas of lower-priority deployments: they drain through the "
        "router, then stop (docs/placement.md, \"Priorities and preemption\"). Equal priorities never preempt. "
        "fleet plan lists deployments highest priority first and names the replicas it would preempt, and why.",
    )
    preemptible: bool = Field(
        False,
        description="Whether a higher-priority deployment may take this deployment below its own "
        "spec.replicas.min (to zero). false (default): only replicas above the minimum are preempted.",
    )
    standby: StandbySpec | None = Field(
        None, description="Standby replicas woken on a scale-up (docs/autoscaling.md, \"Standby replicas\"). "
        "Needs an engine that can sleep: vLLM on GPUs, or the engine simulator; vLLM's CPU build cannot, and "
        "such a deployment starts cold (the reason shown by `fleet validate` and `fleet status`).",
    )
    routing: RoutingSpec = Field(
        default_factory=RoutingSpec,
        description="How the router picks a replica for each request, and its admission queue (docs/router.md).",
    )
    warmup: WarmupPlan = Field(
        default_factory=WarmupPlan,
        description="Requests a replica must answer, after /health passes, before it joins the router's pool.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        None, description="Scale between spec.replicas.min and max on queue time and p99 TTFT. Unset: "
        "spec.replicas.initial replicas, fixed.",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How a new revision (a change of model source or revision, or engine image, args or env) "
        "reaches users: `replace` (default) or `canary` steps judged against stable (rollout.spec).",
    )
    pre_pull: PrePullSpec | None = Field(
        None, description="Kubernetes: pre-pull the engine image onto every node matching a selector, a bounded "
        "number at once (OpenKruise ImagePullJob's idea). Unset: only the nodes replicas are placed on.",
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="!has(self.autoscaling) || self.autoscaling.policy == 'fixed' "
            "|| (has(self.replicas) && self.replicas.min != self.replicas.max)",
            holds=lambda d: d.autoscaling is None or d.autoscaling.policy == "fixed"
            or d.replicas.min != d.replicas.max,
            field="replicas.max",
            message="must be > spec.replicas.min to autoscale (both {replicas.max}); raise it, or remove "
            "spec.autoscaling",
            breaks={"replicas": {"min": 2, "max": 2}, "autoscaling": {"policy": "fleet"}},
            keeps=({"replicas": {"min": 2, "max": 2}, "autoscaling": {"policy": "fixed"}},),
        ),
        CrossFieldRule(
            cel="!self.model.source.trim().startsWith('sim://') || (has(self.engine) && self.engine.kind == 'sim')",
            holds=lambda d: d.model.parsed_source.scheme is not Scheme.SIM or d.engine.kind == "sim",
            field="model.source",
            message="'{model.source}' names an engine-simulator profile; it needs engine.kind: sim (got "
            "'{engine.kind}')",
            breaks={"model": {"name": "m", "source": "sim://h100-llama-8b"}, "engine": {"kind": "vllm"}},
            keeps=({"model": {"name": "m", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"}},),
        ),
    )

    @property
    def standby_max(self) -> int:
        """Most standby replicas to keep: ``spec.standby.maxReplicas``, 0 when unset or when the
        engine cannot sleep here (`standby_unsupported`)."""
        if self.standby is None or self.standby_unsupported() is not None:
            return 0
        return self.standby.max_replicas

    def standby_unsupported(self) -> str | None:
        """Why this deployment's engine cannot keep standby replicas (`EngineKind.sleep_unsupported`),
        or None."""
        return ENGINE_KINDS.get(self.engine.kind)().sleep_unsupported(self.resources.accelerator)


class InferenceDeployment(SpecModel):
    """One deployment: a model served by homogeneous replicas behind the router."""

    api_version: Literal["fleet.inference.dev/v1alpha1"] = Field(
        ..., alias="apiVersion", description="The document's API version: fleet.inference.dev/v1alpha1."
    )
    kind: Literal["InferenceDeployment"] = Field(..., description="The document's kind: InferenceDeployment.")
    metadata: Metadata = Field(..., description="The deployment's name and labels (on Kubernetes: the resource's).")
    spec: DeploymentSpec = Field(
        ..., description="The deployment: model, engine, replica shape and count, routing, warm-up, autoscaling, "
        "rollout."
    )

    @property
    def name(self) -> str:
        return self.metadata.name

    def engine_launch(self, base_dir: Path) -> EngineLaunch:
        """What the engine kind (`fleet.engines.kinds`) reads to start a replica: model name and
        source (resolved against ``base_dir``, the YAML file's directory), TP size, engine args."""
        spec = self.spec
        return EngineLaunch(served_model_name=spec.model.name, source=spec.model.source,
                            local_path=spec.model.local_path(base_dir),
                            tensor_parallel_size=spec.resources.tensor_parallel_size,
                            args=tuple(spec.engine.args), sleep_mode=spec.standby_max > 0)  # fmt: skip


@dataclass(frozen=True)
class LoadedDeployment:
    """A validated deployment and where it came from (relative model paths resolve against it)."""

    deployment: InferenceDeployment
    path: Path
    index: int

    @property
    def base_dir(self) -> Path:
        return self.path.resolve().parent

    @functools.cached_property
    def serving_hash(self) -> str:
        """What a replica of this deployment serves, as 16 hex digits of sha256: the model (name,
        source with relative paths resolved, revision), the engine (kind, image, args, env; not
        its start-up timeout, image pull policy or the CUDA placement checks drivers against) and
        the replica shape. Replicas with equal hashes are interchangeable; a restarted controller
        adopts a running replica only when its hash is today's (else it is drained and replaced).
        Computed once per loaded document (the controller reads it several times a tick)."""
        spec = self.deployment.spec
        local = spec.model.local_path(self.base_dir)
        what = {
            "model": {**spec.model.model_dump(mode="json"), "resolved": str(local) if local else None},
            # How long a start may take, how the kubelet finds the image and which drivers placement
            # admits change nothing served.
            "engine": spec.engine.model_dump(mode="json", exclude={"startup_timeout_seconds", "image_pull_policy",
                                                                   "cuda_version", "cuda_compatibility"}),
            "resources": spec.resources.model_dump(mode="json"),
        }
        if spec.standby_max > 0:   # the engine starts with --enable-sleep-mode: a different process
            what["sleep_mode"] = True
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


class SpecError(Exception):
    """One or more documents are invalid. ``problems`` holds one line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def format_errors(err: ValidationError, prefix: str = "") -> list[str]:
    """Render pydantic errors as ``<prefix>field.path: reason`` lines (list indexes as ``[i]``)."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        reason = e["msg"]
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            loc.append(cause.field)
            reason = cause.reason
        elif e["type"] == "value_error" and reason.startswith("Value error, "):
            reason = reason[len("Value error, "):]
        elif e["type"] == "extra_forbidden":
            reason = "unknown field" + _did_you_mean(loc)
        elif e["type"] == "missing":
            reason = "required field is missing"
        path = ""
        for part in loc:
            path += f"[{part}]" if part.isdigit() else (f".{part}" if path else part)
        lines.append(f"{prefix}{path or '(document)'}: {reason}")
    return lines


def _did_you_mean(loc: list[str]) -> str:
    """``"; did you mean 'replicas'?"`` for an unknown field at ``loc`` (a path into an
    InferenceDeployment) whose name is close to one the section has (difflib's ratio >= 0.6),
    else ""."""
    models: list[type[BaseModel]] = [InferenceDeployment]
    for part in loc[:-1]:
        if part.isdigit():
            continue
        inner: list[type[BaseModel]] = []
        for m in models:
            for name, info in m.model_fields.items():
                if part in (name, info.alias):
                    inner += [section for section, _ in sections_in(info.annotation)]
        models = inner
    known = sorted({info.alias or name for m in models for name, info in m.model_fields.items()})
    close = difflib.get_close_matches(loc[-1], known, n=1) if loc else []
    return f"; did you mean {close[0]!r}?" if close else ""


def parse_document(doc: Any, where: str = "") -> InferenceDeployment:
    """Validate one parsed YAML document. Raises SpecError naming each bad field."""
    if not isinstance(doc, dict):
        raise SpecError([f"{where}(document): must be a mapping, got {type(doc).__name__}"])
    try:
        return InferenceDeployment.model_validate(doc)
    except ValidationError as err:
        raise SpecError(format_errors(err, where)) from None


def load_deployments(paths: list[Path]) -> list[LoadedDeployment]:
    """Load every document of every file, all or nothing.

    Raises:
        SpecError: listing every problem in every file (unreadable file, YAML syntax with line
            and column, invalid fields, duplicate deployment or model names).
    """
    loaded: list[LoadedDeployment] = []
    problems: list[str] = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as err:
            problems.append(f"{path}: cannot read: {err.strerror or err}")
            continue
        try:
            docs = [d for d in yaml.safe_load_all(text)]
        except yaml.YAMLError as err:
            problems.append(yaml_problem(str(path), err))
            continue
        docs = [d for d in docs if d is not None]
        if not docs:
            problems.append(f"{path}: no documents")
        for i, doc in enumerate(docs):
            try:
                loaded.append(LoadedDeployment(parse_document(doc, f"{path}[{i}] "), Path(path), i))
            except SpecError as err:
                problems.extend(err.problems)
    problems.extend(_cross_document_problems(loaded))
    if problems:
        raise SpecError(problems)
    return loaded


def _cross_document_problems(loaded: list[LoadedDeployment]) -> list[str]:
    problems = []
    by_name: dict[str, LoadedDeployment] = {}
    by_model: dict[str, LoadedDeployment] = {}
    for ld in loaded:
        where = f"{ld.path}[{ld.index}] "
        first = by_name.setdefault(ld.deployment.name, ld)
        if first is not ld:
            problems.append(
                f"{where}metadata.name: {ld.deployment.name!r} is already used by {first.path}[{first.index}]"
            )
        model = ld.deployment.spec.model.name
        first = by_model.setdefault(model, ld)
        if first is not ld:
            problems.append(
                f"{where}spec.model.name: {model!r} is already served by deployment "
                f"{first.deployment.name!r}; one deployment per model name"
            )
    return problems


def dump_deployment(dep: InferenceDeployment) -> str:
    """YAML text of a deployment with every default written out (loads back equal)."""
    return yaml.safe_dump(dep.to_document(), sort_keys=False)
