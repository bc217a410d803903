"""What a replica's pods look like: the pure mapping from a `ReplicaWant` to Pod manifests.

Owns `pod_manifest` (the Pod of a single-node replica), `pod_group` (the pods of a replica: one,
or one per member of a multi-node gang), `product_selector`, `member_name`, and the label,
annotation, container and port names Fleet puts on engine pods (`label_value` makes a string a
label value). No API calls: `fleet.k8s.backend` sends what this builds; `fleet.k8s.status`,
`fleet.k8s.prepull`, the operator and the kubelet stand-in (fleet/testing/k8s/) read the names.
Pure functions; tests/unit/test_k8s_backend.py calls them with literals.

A replica is one Pod: ``restartPolicy: Never`` (replacing a failed replica is the controller's
decision, with its backoff, as with the local backend), pinned to the node Fleet's placement
chose by a required node affinity on the node's name (`node_affinity`, as the DaemonSet
controller pins its pods: pkg/controller/daemon/util ``ReplaceDaemonSetPodNodeNameNodeAffinity``)
and bound by the scheduler, which admits it against what every pod on the node requests, Fleet's
or not, and its taints; the chosen node is also the annotation ``fleet.inference.dev/node``
(`ANNOTATION_NODE`), so the pod's node is known before it is bound. GPUs requested as
``nvidia.com/gpu: <TP>``, a MIG instance as ``nvidia.com/mig-<profile>: 1`` (device plugin's
``mixed`` strategy; ``single``: ``nvidia.com/gpu: 1``), ``/health`` as readiness, liveness and
startup probe (the startup probe allows ``spec.engine.startupTimeoutSeconds``). Which GPU of the
node the pod gets is the device plugin's choice: placement decides the node and how many.

Where the weights come from is fleet/k8s/pod_weights.py's, what the pod requests
fleet/k8s/pod_resources.py's, the chart's pod settings fleet/k8s/pod_settings.py's, and reading
pods back into `ReplicaFacts` fleet/k8s/pod_facts.py's.

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
import re
from typing import Any

from fleet.controller.backend import LaunchError, ReplicaWant
from fleet.engines.kinds import KvEventsBind, fleet_kv_events, get_engine
from fleet.inventory.gfd import GFD_PRODUCT
from fleet.k8s.pod_resources import engine_resources
from fleet.k8s.pod_settings import ENGINE_PORT, EnginePodSettings
from fleet.k8s.pod_weights import model_argument

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
ANNOTATION_NODE = "fleet.inference.dev/node"            # the node placement chose (the pod is pinned to it)
ANNOTATION_MODEL = "fleet.inference.dev/model"          # spec.model.name (the router pool it serves)
ANNOTATION_READY_AT = "fleet.inference.dev/ready-at"    # Unix seconds its warm-up passed (operator writes it)
ANNOTATION_REVISION = "fleet.inference.dev/revision"    # spec.model.revision as written (the label is sanitised)
KV_EVENTS_PORT_NAME = "kv-events"          # container port of the engine's KV event PUB socket
KV_REPLAY_PORT_NAME = "kv-replay"          # ... and of its replay ROUTER socket
ENGINE_CONTAINER = "engine"

# How each engine kind starts inside its image (the local backend runs `EngineKind.entry` with
# this interpreter; a pod runs the image's own entry point).
POD_ENTRY = {
    "vllm": lambda model: ["vllm", "serve", model],
    "sim": lambda model: ["python", "-m", "fleet.enginesim", "--model", model],
}
_NOT_IN_PODS = ("CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND")   # the device plugin / kubelet pin devices
_LABEL_VALUE = re.compile(r"[^A-Za-z0-9_.-]")


def label_value(text: str) -> str:
    """A string as a label value (<= 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends)."""
    return _LABEL_VALUE.sub("-", text)[:63].strip("-_.") or "none"


def node_affinity(node: str) -> dict[str, Any]:
    """The pod ``affinity`` that lets the scheduler bind a pod to ``node`` and nowhere else: a
    required node affinity term matching the field ``metadata.name`` (the DaemonSet controller's
    pin since Kubernetes 1.12, pkg/controller/daemon/util ``ReplaceDaemonSetPodNodeNameNodeAffinity``)."""
    term = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}}}


def pin_to_node(pod: dict[str, Any], node: str) -> dict[str, Any]:
    """``pod`` (a manifest) pinned to ``node``: its node affinity and `ANNOTATION_NODE` set; returned."""
    pod["spec"]["affinity"] = node_affinity(node)
    pod["metadata"].setdefault("annotations", {})[ANNOTATION_NODE] = node
    return pod


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
    return pin_to_node({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec},
                       want.placement.nodes[0])


def product_selector(want: ReplicaWant) -> str | None:
    """The ``nvidia.com/gpu.product`` value a whole-GPU replica's pod selects: the product
    placement chose for its revision (`fleet.placement.shapes.ReplicaPlacement.product`, spelled
    as the node's GPU Feature Discovery label spells it, since the Kubernetes inventory is read
    from that label). Every replica of a revision runs on one product (``gpuProduct`` may list
    several); the pod is pinned to its node, and the scheduler leaves it Pending if the node's
    label no longer names that product. None for MIG and CPU replicas (GFD's ``single`` MIG strategy
    relabels the product) and for a product that is no label value."""
    product = want.placement.product
    resources = want.deployment.spec.resources
    if not product or resources.accelerator != "gpu" or resources.mig_profile:
        return None
    return product if label_value(product) == product else None


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
        pin_to_node(worker, member.node)
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
