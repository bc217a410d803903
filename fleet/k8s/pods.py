"""What a replica's pod looks like: the pure mapping from a `ReplicaWant` to a Pod manifest,
and from a Pod object back to `ReplicaFacts`.

Owns `EnginePodSettings` (cluster-wide pod settings from the chart's ``engine:`` values:
runtime class, tolerations, /dev/shm, extra env, MIG strategy), `pod_manifest` and `pod_facts`,
and the label and annotation keys Fleet puts on pods. No API calls: `fleet.k8s.backend` sends
what this builds. Pure functions; tests/unit/test_k8s_backend.py calls them with literals.

A replica is one Pod: ``restartPolicy: Never`` (replacing a failed replica is the controller's
decision, with its backoff, as with the local backend), bound to the node Fleet's placement
chose with ``spec.nodeName`` (the scheduler is bypassed; the kubelet still admits the pod
against its device plugins, node selector and taints), GPUs requested as
``nvidia.com/gpu: <TP>``, a MIG instance as ``nvidia.com/mig-<profile>: 1`` (device plugin's
``mixed`` strategy; ``single``: ``nvidia.com/gpu: 1``), ``/health`` as readiness, liveness and
startup probe (the startup probe allows ``spec.engine.startupTimeoutSeconds``). Which GPU of the
node the pod gets is the device plugin's choice: placement decides the node and how many.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from fleet.controller.backend import LaunchError, ReplicaFacts, ReplicaWant, engine_model
from fleet.engines.kinds import get_engine

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
ENGINE_CONTAINER = "engine"

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
        return cls(
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
            gang_service=d.get("gangService") or "fleet-gangs",
        )  # fmt: skip


def model_argument(want: ReplicaWant) -> tuple[str, dict | None]:
    """The engine's model argument in a pod, and the hostPath volume that brings it (or None).

    ``hf://ORG/NAME`` -> ``ORG/NAME`` (vLLM downloads it); an absolute path or ``file://`` ->
    that path on the node, mounted read-only; ``sim://`` -> the simulator profile. Raises
    LaunchError naming spec.model.source for relative paths (relative to what, in a pod?) and
    s3:// or http(s):// (they need the node agent's weight cache)."""
    dep = want.deployment
    source = dep.spec.model.source
    if dep.spec.engine.kind == "sim":
        return engine_model(want), None
    if source.startswith("hf://"):
        return source[len("hf://"):], None
    if source.startswith(("s3://", "http://", "https://")):
        raise LaunchError(f"weights not present: spec.model.source {source!r} needs the node agent's weight cache "
                          "on Kubernetes; use hf:// or a path on the nodes")  # fmt: skip
    path = source[len("file://"):] if source.startswith("file://") else source
    if not path.startswith("/"):
        raise LaunchError(f"spec.model.source {source!r}: a relative path means nothing in a pod; "
                          "use an absolute path on the nodes, file:// or hf://")  # fmt: skip
    return path, {"name": "weights", "hostPath": {"path": path, "type": "Directory"}}


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
    model, volume = model_argument(want)
    engine = get_engine(spec.engine.kind)
    argv = engine.command(dep.engine_launch(want.base_dir), model, "0.0.0.0", ENGINE_PORT)
    flags = argv[len(engine.entry(model)):]
    command = [*POD_ENTRY[spec.engine.kind](model), *flags]
    env = {**spec.engine.env, **{k: v for k, v in want.placement.env.items() if k not in _NOT_IN_PODS}}
    env_list = [{"name": k, "value": v} for k, v in sorted(env.items())]
    env_list += [{"name": "FLEET_REPLICA_ID", "value": want.replica_id},
                 {"name": "FLEET_DEPLOYMENT", "value": dep.name}, *settings.extra_env]  # fmt: skip
    limits = gpu_resources(want, settings)
    requests: dict[str, str] = dict(limits)
    if spec.resources.accelerator == "cpu":
        requests["cpu"] = str(spec.resources.cpu_cores)
    startup_s = spec.engine.startup_timeout_seconds
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 2}
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": image,
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": command,
        "env": env_list,
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "resources": {"requests": requests, **({"limits": limits} if limits else {})},
        "startupProbe": {**probe, "periodSeconds": 5, "failureThreshold": max(1, int(startup_s // 5) + 1)},
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "volumeMounts": [],
    }
    volumes = []
    if settings.shm_size:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": settings.shm_size}})
        container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
    if volume is not None:
        volumes.append(volume)
        container["volumeMounts"].append({"name": "weights", "mountPath": model, "readOnly": True})
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
    if volumes:
        pod_spec["volumes"] = volumes
    for key, value in (("runtimeClassName", settings.runtime_class_name),
                       ("priorityClassName", settings.priority_class_name),
                       ("serviceAccountName", settings.service_account_name),
                       ("tolerations", settings.tolerations), ("nodeSelector", settings.node_selector),
                       ("imagePullSecrets", settings.image_pull_secrets)):  # fmt: skip
        if value:
            pod_spec[key] = value
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


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
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in _IMAGE_PROBLEMS:
        problem = f"{waiting['reason']}: {waiting.get('message', '')}".rstrip(": ")
        if waiting["reason"] != "ErrImagePull":   # the first pull error may be transient; back-off is not
            exited, reason = True, f"container cannot start: {problem}"
    return ReplicaFacts(
        replica_id=labels.get(LABEL_REPLICA, meta["name"]), deployment=labels.get(LABEL_DEPLOYMENT, "?"),
        spec_hash=labels.get(LABEL_SPEC_HASH, ""), node=node,
        endpoint=f"http://{ip}:{ENGINE_PORT}" if ip and (running or exited) else None,
        image_present=image_present, weights_present=image_present, running=running and not exited,
        exited=exited, exit_code=code, exit_reason=reason, problem=problem, detail=detail,
    )  # fmt: skip


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
    c["resources"] = {"requests": {"nvidia.com/gpu": str(per_node)}, "limits": {"nvidia.com/gpu": str(per_node)}}
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
        wc["resources"] = {"requests": {"nvidia.com/gpu": str(len(member.devices))},
                           "limits": {"nvidia.com/gpu": str(len(member.devices))}}  # fmt: skip
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
        detail,
    )  # fmt: skip
