"""What a kubelet would write into pod status, as helpers over `ObjectStore`. A TEST STAND-IN.

`run_pod` (containers running, a pod IP), `terminate_pod` (the container exited), `evict_pod`
(phase Failed, reason Evicted), `image_pull_backoff` and `finish_deletions` (graceful deletions
complete: the objects go). Unit tests call them by hand; the integration test's kubelet
(tests/k8s/apiserver.py) calls them when its simulated engines start and stop."""

from __future__ import annotations

from fleet.k8s.client import PODS
from fleet.k8s.pods import ENGINE_CONTAINER
from tests.k8s.store import ObjectStore, now_iso


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
