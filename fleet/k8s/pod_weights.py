"""Where an engine pod's weights come from.

Owns `model_argument` (the engine's model argument, its flags, and the volumes, mounts and init
containers a pod needs to reach the weights of ``spec.model.source``), `ModelFiles` (what it
returns) and the names of the ``weights`` init container, its emptyDir and Fleet's UID. Called by
`fleet.k8s.pods.pod_manifest`; `fleet.k8s.pod_facts` reads the init container's state back.
Pure; tests/unit/test_k8s_engine_pods.py calls it with literals.

Weights from the node's cache (``weightCache.hostPath`` set, the chart's default with the node
agent): for a source the cache fetches (``hf://``, ``http(s)://``; `fleet.sources.Scheme.cached`)
the pod has an init container ``weights`` (Fleet's image, UID 10001) that runs ``fleet cache pull SOURCE
--root HOSTPATH --link /fleet/model/current --holder $(POD_UID)``: one download per node (the
cache's per-model file lock makes pods on one node wait for one fetch), the entry pinned for the
pod, and a symlink to its directory in the pod's emptyDir ``model``. The engine mounts the cache
read-only at the same path (the entry's files are relative symlinks into ``../../blobs``, so
only the whole cache root keeps them valid) and serves ``/fleet/model/current`` under
``--served-model-name spec.model.name``. Without a cache an ``hf://org/name@rev`` source is
``org/name --revision rev`` (vLLM downloads it itself).

The cache's hostPath is ``DirectoryOrCreate``, so a pod never waits in FailedMount: on a node whose
agent has run, its ``prepare`` step made the directory UID 10001's (charts/fleet/templates/
agent-daemonset.yaml); on a node without an agent the kubelet creates it root-owned 0755, the
``weights`` init container (UID 10001) cannot write there and exits 1 with the permission error,
and the pod fails (``restartPolicy: Never``) with that reason instead of hanging. A path source
(``/models/m``) stays ``Directory``: a missing model is a mount error, not an empty directory.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleet.controller.backend import LaunchError, ReplicaWant, engine_model
from fleet.k8s.pod_settings import EnginePodSettings

WEIGHTS_CONTAINER = "weights"              # init container filling the node cache (weightCache set)
MODEL_DIR = "/fleet/model"                 # emptyDir of the pod: the link to the cache entry
MODEL_LINK = f"{MODEL_DIR}/current"        # what the engine is given as its model
FLEET_UID = 10001                          # the user of Fleet's image (charts/fleet/Dockerfile)


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
    from fleet.sources import Scheme, SourceError, parse_source

    dep = want.deployment
    source = dep.spec.model.source
    parsed = dep.spec.model.parsed_source
    sim = dep.spec.engine.kind == "sim"
    if parsed.remote and settings.weight_cache_path:
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
    if parsed.scheme is Scheme.HF:
        return ModelFiles(parsed.location, ("--revision", parsed.revision) if parsed.revision else ())
    if parsed.remote:
        raise LaunchError(f"weights not present: spec.model.source {source!r} needs the node weight cache on "
                          "Kubernetes (the chart's agent.enabled sets weightCache.hostPath); use hf:// or a path "
                          "on the nodes")  # fmt: skip
    path = parsed.location
    if not path.startswith("/"):
        raise LaunchError(f"spec.model.source {source!r}: a relative path means nothing in a pod; "
                          "use an absolute path on the nodes, file:// or hf://")  # fmt: skip
    return ModelFiles(path, (), ({"name": "weights", "hostPath": {"path": path, "type": "Directory"}},),
                      ({"name": "weights", "mountPath": path, "readOnly": True},))


def _cache_volumes(want: ReplicaWant, settings: EnginePodSettings) -> tuple[tuple, tuple, tuple]:
    """(volumes, engine mounts, init containers) of a pod whose weights come from the node cache."""
    spec = want.deployment.spec
    root = settings.weight_cache_path
    volumes = ({"name": "weight-cache", "hostPath": {"path": root, "type": "DirectoryOrCreate"}},
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
