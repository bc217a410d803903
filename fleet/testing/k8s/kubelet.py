"""What a kubelet would write into pod status, as helpers over `ObjectStore`. A TEST STAND-IN.

`run_pod` (containers running, a pod IP), `terminate_pod` (the container exited), `evict_pod`
(phase Failed, reason Evicted), `image_pull_backoff` and `finish_deletions` (graceful deletions
complete: the objects go). Unit tests call them by hand; the integration test's kubelet
(fleet/testing/k8s/apiserver.py) calls them when its simulated engines start and stop.

Image pulls: `ImagePuller` is a STAND-IN for the kubelet's image manager and a registry.
``sync(store, ns, pod)`` pulls the images of a pod bound to a node that its Node's
``status.images`` lacks: after ``steps`` calls the image is added to the node's list (under
the fully qualified name a container runtime reports, ``docker.io/library/x:tag``); an image
configured as unpullable puts the container in ``waiting: ErrImagePull`` (then
``ImagePullBackOff``), as the kubelet does. A pre-pull pod whose image is there completes
(phase Succeeded, exit code 0, an image ID)."""

from __future__ import annotations

import hashlib

from fleet.inventory.gfd import image_aliases
from fleet.k8s.client import NODES, PODS
from fleet.k8s.pods import ENGINE_CONTAINER
from fleet.k8s.prepull import PULL_CONTAINER, is_pull_pod
from fleet.testing.k8s.store import ObjectStore, now_iso


def _status(store: ObjectStore, ns: str, name: str, status: dict) -> dict:
    return store.patch_status(PODS, ns, name, {"status": status})


def run_pod(store: ObjectStore, ns: str, name: str, ip: str) -> dict:
    return _status(store, ns, name, {
        "phase": "Running", "podIP": ip, "startTime": now_iso(),
        "conditions": [{"type": "Ready", "status": "True"}],
        "containerStatuses": [{"name": ENGINE_CONTAINER, "ready": True, "restartCount": 0, "image": "img",
                               "imageID": "sha256:0", "state": {"running": {"startedAt": now_iso()}}}],
    })  # fmt: skip


def terminate_pod(store: ObjectStore, ns: str, name: str, exit_code: int, reason: str = "Error") -> dict:
    phase = "Succeeded" if exit_code == 0 else "Failed"
    return _status(store, ns, name, {
        "phase": phase,
        "containerStatuses": [{"name": ENGINE_CONTAINER, "ready": False, "restartCount": 0, "image": "img",
                               "imageID": "sha256:0",
                               "state": {"terminated": {"exitCode": exit_code, "reason": reason}}}],
    })  # fmt: skip


def evict_pod(store: ObjectStore, ns: str, name: str) -> dict:
    return _status(store, ns, name, {"phase": "Failed", "reason": "Evicted",
                                     "message": "The node was low on resource: memory."})  # fmt: skip


def image_pull_backoff(store: ObjectStore, ns: str, name: str) -> dict:
    return _status(store, ns, name, {"phase": "Pending", "containerStatuses": [{
        "name": ENGINE_CONTAINER, "ready": False, "restartCount": 0, "image": "img", "imageID": "",
        "state": {"waiting": {"reason": "ImagePullBackOff", "message": "Back-off pulling image nope:1"}}}]})


def finish_deletions(store: ObjectStore, ns: str) -> list[str]:
    """Complete every graceful pod deletion in ``ns``; returns the pod names that went."""
    gone = []
    for (plural, pns, name), obj in list(store.objects.items()):
        if plural == PODS.plural and pns == ns and obj["metadata"].get("deletionTimestamp"):
            store.finish_delete(PODS, ns, name)
            gone.append(name)
    return gone


def _runtime_name(image: str) -> str:
    """The name containerd lists for ``image``: the longest (fully qualified) alias."""
    return max(image_aliases(image), key=lambda n: (n.count("/"), len(n)))


def _default_pull_policy(image: str) -> str:
    """The API server's default imagePullPolicy: Always for ``:latest`` or no tag, else IfNotPresent."""
    name = image.split("@", 1)[0]
    tag = name.rsplit(":", 1)[1] if ":" in name.rsplit("/", 1)[-1] else None
    return "Always" if "@" not in image and tag in (None, "latest") else "IfNotPresent"


class ImagePuller:
    """The kubelet's image pulls on the stand-in nodes (see the module docstring). A STAND-IN.

    A container's ``imagePullPolicy`` (else the API server's default) is honoured: ``Always``
    pulls once per pod even when the node lists the image; ``Never`` fails with
    ErrImageNeverPull when it does not.

    ``steps``: ``sync`` calls an image takes to pull (1: the first call pulls it);
    ``unpullable``: images that fail with ErrImagePull; ``pulls``: completed pulls by
    (node, image), so a test can assert an image was pulled once."""

    def __init__(self, steps: int = 1, unpullable: set[str] | None = None, size_bytes: int = 9_000_000_000) -> None:
        self.steps = steps
        self.unpullable = set(unpullable or ())
        self.size_bytes = size_bytes
        self.progress: dict[tuple[str, str], int] = {}
        self.pulls: dict[tuple[str, str], int] = {}
        self.failures: dict[tuple[str, str], int] = {}
        self.pulled_for: dict[str, set[tuple[str, str]]] = {}   # pod -> what it pulled (Always: once per pod)

    def sync(self, store: ObjectStore, ns: str, name: str) -> str:
        """One kubelet pass over pod ``name``: "pulled" (every image is on the node; a pre-pull
        pod is then Succeeded), "pulling" or "failed". Pods on no node are left alone ("unbound")."""
        pod = store.get(PODS, ns, name)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not node_name or pod["metadata"].get("deletionTimestamp"):
            return "unbound"
        containers = [*(pod["spec"].get("initContainers") or []), *pod["spec"]["containers"]]
        for c in containers:
            image = c["image"]
            node = store.get(NODES, None, node_name)
            listed = set()
            for entry in (node.get("status") or {}).get("images") or []:
                for n in entry.get("names") or []:
                    listed |= image_aliases(n)
            key = (node_name, image)
            policy = c.get("imagePullPolicy") or _default_pull_policy(image)
            if image_aliases(image) & listed and (policy != "Always" or key in self.pulled_for.get(name, ())):
                continue
            if policy == "Never":
                self._waiting(store, ns, name, pod, c["name"], image, "ErrImageNeverPull",
                              f'Container image "{image}" is not present with pull policy of Never')
                return "failed"
            if image in self.unpullable:
                self.failures[key] = self.failures.get(key, 0) + 1
                reason = "ErrImagePull" if self.failures[key] == 1 else "ImagePullBackOff"
                message = (f'failed to pull and unpack image "{_runtime_name(image)}": not found' if reason ==
                           "ErrImagePull" else f'Back-off pulling image "{image}"')  # fmt: skip
                self._waiting(store, ns, name, pod, c["name"], image, reason, message)
                return "failed"
            self.progress[key] = self.progress.get(key, 0) + 1
            if self.progress[key] < self.steps:
                self._waiting(store, ns, name, pod, c["name"], image, "ContainerCreating",
                              f"Pulling image {image} ({self.progress[key]}/{self.steps})")
                return "pulling"
            del self.progress[key]
            self.pulls[key] = self.pulls.get(key, 0) + 1
            self.pulled_for.setdefault(name, set()).add(key)
            images = list((node.get("status") or {}).get("images") or [])
            digest = "sha256:" + hashlib.sha256(image.encode()).hexdigest()
            repo = _runtime_name(image).rsplit(":", 1)[0] if "@" not in image else image.split("@")[0]
            images.insert(0, {"names": [f"{repo}@{digest}", _runtime_name(image)], "sizeBytes": self.size_bytes})
            store.patch_status(NODES, None, node_name, {"status": {"images": images}})
        if is_pull_pod(pod) and (pod.get("status") or {}).get("phase") in (None, "Pending"):
            c = pod["spec"]["containers"][0]
            store.patch_status(PODS, ns, name, {"status": {"phase": "Succeeded", "containerStatuses": [{
                "name": PULL_CONTAINER, "ready": False, "restartCount": 0, "image": c["image"],
                "imageID": "sha256:" + hashlib.sha256(c["image"].encode()).hexdigest(),
                "state": {"terminated": {"exitCode": 0, "reason": "Completed"}}}]}})  # fmt: skip
        return "pulled"

    @staticmethod
    def _waiting(store: ObjectStore, ns: str, name: str, pod: dict, container: str, image: str, reason: str,
                 message: str) -> None:  # fmt: skip
        state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        store.patch_status(PODS, ns, name, {"status": {"phase": "Pending", "containerStatuses": [{
            "name": container, "ready": False, "restartCount": 0, "image": image, "imageID": "",
            "state": state}]}})  # fmt: skip
