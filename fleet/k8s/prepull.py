"""Image pre-pull on Kubernetes: the engine image is pulled onto a node before a replica's pod
is created there, and optionally onto every node matching a selector (``spec.prePull``).

Owns `pull_pod_manifest` (the short-lived pod that pulls one image on one node),
`pod_pull_state` (what such a pod says: pulling, pulled, failed and why), `PrePullPolicy` (the
pure, clock-injected state machine per node and image: pulling / present / backing off, with
tenacity's wait and stop strategies) and `PrePuller` (the policy's decisions sent through
`fleet.k8s.client.Kube`: pods created and deleted). Called by the Kubernetes backend
(`fleet.k8s.backend.KubernetesBackend.observe`, every controller tick); tests:
tests/unit/test_k8s_prepull.py against the fake cluster and the stand-in kubelet that pulls
(fleet/testing/k8s/kubelet.py).

Why short-lived pods and not the CRI socket (docs/kubernetes.md has the user's view): a pod needs nothing
but the API server the operator already talks to; it works with any container runtime
(containerd, CRI-O, a Kata or gVisor runtime class: the pod uses the engine pods' runtime
class, so the image lands in the store the engine will read); the kubelet's own pull
credentials apply (node credential providers, the pod's ``imagePullSecrets`` and service
account, registry mirrors configured in the runtime) and its pull is what later engine pods
reuse with ``IfNotPresent``. Talking to the CRI socket (what OpenKruise's kruise-daemon does)
needs a hostPath mount of the socket, a privileged DaemonSet, per-runtime socket paths and
Fleet's own copy of the credential logic: more privilege and more code for the same pull.

The pod: one container, the engine image, ``imagePullPolicy: IfNotPresent``, command ``true``,
``restartPolicy: Never``, pinned to the node as engine pods are (`fleet.k8s.pods.pin_to_node`:
a required node affinity on its name; the scheduler binds it), the engine pods' tolerations,
node selector, runtime class, service account and pull secrets, tiny requests, no GPU. What
counts is the pull, not the command: the kubelet pulls before it creates the container, so a
container that then fails to start (an image without ``true``: distroless, scratch) still
means "pulled" (`pod_pull_state` reads the image ID and the start error as such). kube-fledged
copies a static ``echo`` from a busybox init container into the image's container to run
anything at all; that costs a second image every node must be able to pull (air-gapped
mirrors), for a command whose result Fleet does not need.

Facts, not guesses: a (node, image) is present when ``Node.status.images`` lists it (names
compared after Docker's normalisation, `fleet.inventory.gfd.image_aliases`) or when its
pre-pull pod reports the image (the node's list lags by a status update, and the kubelet
reports at most 50 images). A pull fails on ErrImagePull, ImagePullBackOff, InvalidImageName,
ErrImageNeverPull (the container's ``waiting.reason``), a pod the node rejected or the scheduler
cannot place (``PodScheduled`` False, ``Unschedulable``), a pod that vanished, or ``timeout_s``
without a result; the pod is deleted and the next attempt waits
``wait(attempt)`` (tenacity: ``wait_exponential``); after ``stop`` says stop, the replicas
waiting on it are failed with the node and the reason (the controller replaces them with its
own backoff), and a later want starts again after the last wait.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import tenacity

from fleet.inventory.gfd import image_aliases, node_images
from fleet.k8s.client import PODS, Kube
from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pod_facts import pod_node, pod_unschedulable
from fleet.k8s.pods import LABEL_FLEET, LABEL_MANAGED_BY, MANAGED_BY, label_value, pin_to_node

log = logging.getLogger("fleet.k8s.prepull")

LABEL_PREPULL = "fleet.inference.dev/prepull"             # "true" on every pre-pull pod
LABEL_PREPULL_NODE = "fleet.inference.dev/prepull-node"   # the node (as a label value)
ANNOTATION_PREPULL_IMAGE = "fleet.inference.dev/prepull-image"   # the image, exactly as asked
PULL_CONTAINER = "pull"
PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                 "RegistryUnavailable", "SignatureValidationFailed")  # fmt: skip
"""Container ``waiting.reason`` values meaning the image could not be pulled (kubelet's
pkg/kubelet/images/types.go)."""
STARTED_AFTER_PULL = ("CreateContainerError", "CreateContainerConfigError", "RunContainerError", "StartError",
                      "CrashLoopBackOff")  # fmt: skip
"""Reasons the kubelet gives only after the image is there: the pull is done."""


def is_pull_pod(pod: dict) -> bool:
    return (pod["metadata"].get("labels") or {}).get(LABEL_PREPULL) == "true"


def pull_pod_name(node: str, image: str, attempt: int = 0) -> str:
    """``prepull-<node>-<10 hex of sha256(node, image)>-<attempt>``: one pod per node, image and
    attempt (a retry never collides with the failed pod still being deleted), a DNS-1123 name
    of <= 63 characters."""
    digest = hashlib.sha256(f"{node}\0{image}".encode()).hexdigest()[:10]
    return f"prepull-{label_value(node.lower())[:36].strip('-.')}-{digest}-{attempt}"


def pull_pod_manifest(node: str, image: str, *, fleet_id: str, settings: EnginePodSettings,
                      attempt: int = 0) -> dict[str, Any]:  # fmt: skip
    """The pod that pulls ``image`` onto ``node`` (see the module docstring for its shape)."""
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 0,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [{
            "name": PULL_CONTAINER, "image": image, "imagePullPolicy": "IfNotPresent", "command": ["true"],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}},
        }],
    }  # fmt: skip
    for key, value in (("runtimeClassName", settings.runtime_class_name),
                       ("serviceAccountName", settings.service_account_name),
                       ("tolerations", settings.tolerations), ("nodeSelector", settings.node_selector),
                       ("imagePullSecrets", settings.image_pull_secrets)):  # fmt: skip
        if value:
            spec[key] = value
    return pin_to_node({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": pull_pod_name(node, image, attempt),
            "labels": {LABEL_MANAGED_BY: MANAGED_BY, LABEL_FLEET: label_value(fleet_id), LABEL_PREPULL: "true",
                       LABEL_PREPULL_NODE: label_value(node)},
            "annotations": {ANNOTATION_PREPULL_IMAGE: image},
        },
        "spec": spec,
    }, node)  # fmt: skip


class PodPull(Enum):
    PULLING = "pulling"
    PULLED = "pulled"
    FAILED = "failed"


def pod_pull_state(pod: dict) -> tuple[PodPull, str]:
    """What a pre-pull pod says, and why (the kubelet's reason and message for a failure)."""
    status = pod.get("status") or {}
    statuses = [c for c in status.get("containerStatuses") or [] if c.get("name") == PULL_CONTAINER]
    cs = statuses[0] if statuses else {}
    state = cs.get("state") or {}
    waiting = state.get("waiting") or {}
    reason = waiting.get("reason") or ""
    if reason in PULL_FAILURES:
        return PodPull.FAILED, f"{reason}: {waiting.get('message', '')}".rstrip(": ")
    if cs.get("imageID") or "running" in state or "terminated" in state or reason in STARTED_AFTER_PULL:
        return PodPull.PULLED, ""
    if status.get("phase") == "Succeeded":
        return PodPull.PULLED, ""
    if (refused := pod_unschedulable(pod)) is not None:
        return PodPull.FAILED, f"the scheduler cannot place it on node {pod_node(pod)}: {refused}"
    if status.get("phase") == "Failed":   # rejected by the node before any container (OutOfpods, admission)
        why = status.get("reason") or "Failed"
        return PodPull.FAILED, f"pod rejected by the node: {why}: {status.get('message', '')}".rstrip(": ")
    return PodPull.PULLING, ""


class Pull(Enum):
    PRESENT = "present"
    PULLING = "pulling"
    BACKOFF = "backoff"      # failed; the next attempt waits until retry_at_s
    GAVE_UP = "gave-up"      # failed and `stop` said stop: waiting replicas fail; retried after retry_at_s


@dataclass
class PullRecord:
    """One (node, image): its phase, the attempts that failed, the last reason."""

    node: str
    image: str
    phase: Pull
    started_s: float | None = None
    pod_seen: bool = False
    failures: int = 0
    first_failure_s: float | None = None
    reason: str = ""
    retry_at_s: float | None = None

    def describe(self, now: float) -> str:
        """For `fleet status` and events: ``pulling image X onto node N (12 s)``..."""
        if self.phase is Pull.PULLING:
            since = f" ({now - self.started_s:.0f} s)" if self.started_s is not None else ""
            return f"pulling image {self.image} onto node {self.node}{since}"
        if self.phase in (Pull.BACKOFF, Pull.GAVE_UP):
            wait = max(0.0, (self.retry_at_s or now) - now)
            return (f"pull of image {self.image} on node {self.node} failed ({self.failures}x): {self.reason}; "
                    f"next attempt in {wait:.0f} s")  # fmt: skip
        return f"image {self.image} present on node {self.node}"


@dataclass
class PrePullPlan:
    """What `PrePullPolicy.step` decided: pods to create ((node, image)) and delete (names), and
    the records that failed in this step (for events)."""

    create: list[tuple[str, str]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    failed: list[PullRecord] = field(default_factory=list)


def _retry_state(attempt: int, first_s: float, now: float) -> tenacity.RetryCallState:
    """A tenacity call state for ``attempt`` failures, on Fleet's clock (tenacity's own
    strategies read only these fields; no tenacity loop runs: the reconcile never sleeps)."""
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    state.start_time = first_s
    state.outcome_timestamp = now
    return state


class PrePullPolicy:
    """The pre-pull state machine per (node, image). Pure: no API calls; ``clock`` injected.

    ``timeout_s``: a pull without a result for this long fails. ``wait``: a tenacity wait
    strategy giving the seconds before attempt n+1 after n failures (default
    ``wait_exponential(multiplier=10, max=600)``: 10, 20, 40 ... 600 s). ``stop``: a tenacity
    stop strategy; when it says stop, the record turns GAVE_UP (default ``stop_after_attempt(3)``).
    """

    def __init__(self, clock: Callable[[], float], *, timeout_s: float = 1800.0,
                 wait: tenacity.wait.wait_base | None = None, stop: tenacity.stop.stop_base | None = None) -> None:  # fmt: skip
        self.clock = clock
        self.timeout_s = timeout_s
        self.wait = wait or tenacity.wait_exponential(multiplier=10, max=600)
        self.stop = stop or tenacity.stop_after_attempt(3)
        self.records: dict[tuple[str, str], PullRecord] = {}

    def present(self, node: str, image: str, images_on_node: Iterable[str]) -> bool:
        """The node holds the image: its status lists it, or its pre-pull finished."""
        if image_aliases(image) & set(images_on_node):
            return True
        rec = self.records.get((node, image))
        return rec is not None and rec.phase is Pull.PRESENT

    def record(self, node: str, image: str) -> PullRecord | None:
        return self.records.get((node, image))

    def step(self, wanted: dict[tuple[str, str], int | None], images: dict[str, frozenset[str]],
             pods: dict[tuple[str, str], dict]) -> PrePullPlan:  # fmt: skip
        """One reconcile. ``wanted``: (node, image) -> the parallelism limit of its image (None:
        no limit; replicas wait on it); ``images``: node -> the names its status lists (nodes
        absent here are gone); ``pods``: the pre-pull pods that exist, by (node, image)."""
        now = self.clock()
        plan = PrePullPlan()
        for key in set(self.records) | set(pods):
            node, image = key
            pod = pods.get(key)
            rec = self.records.get(key)
            if node not in images:   # the node is gone
                self.records.pop(key, None)
                if pod is not None:
                    plan.delete.append(pod["metadata"]["name"])
                continue
            if image_aliases(image) & images[node]:
                if rec is not None and rec.phase is Pull.PRESENT:
                    del self.records[key]   # the node lists it: its status is the fact from now on
                elif rec is not None:
                    rec.phase, rec.failures, rec.first_failure_s = Pull.PRESENT, 0, None
                if pod is not None:
                    plan.delete.append(pod["metadata"]["name"])
                continue
            if pod is not None:
                if rec is None or rec.phase is not Pull.PULLING:   # left by an earlier operator: adopt it
                    rec = self.records.setdefault(key, PullRecord(node, image, Pull.PULLING))
                    rec.phase, rec.started_s = Pull.PULLING, now   # its timeout counts from now
                rec.pod_seen = True
                state, why = pod_pull_state(pod)
                if state is PodPull.PULLED:
                    rec.phase, rec.failures, rec.first_failure_s = Pull.PRESENT, 0, None   # a success resets the count
                    plan.delete.append(pod["metadata"]["name"])
                elif state is PodPull.FAILED:
                    self._fail(rec, why, now, plan)
                    plan.delete.append(pod["metadata"]["name"])
                elif rec.started_s is not None and now - rec.started_s >= self.timeout_s:
                    self._fail(rec, f"timed out after {self.timeout_s:.0f} s without a result", now, plan)
                    plan.delete.append(pod["metadata"]["name"])
                continue
            if rec is not None and rec.phase is Pull.PULLING:
                if rec.pod_seen:   # it existed and went without a result
                    self._fail(rec, "the pre-pull pod was deleted before the pull finished", now, plan)
                elif rec.started_s is not None and now - rec.started_s >= self.timeout_s:
                    self._fail(rec, f"timed out after {self.timeout_s:.0f} s: the pre-pull pod never appeared",
                               now, plan)  # fmt: skip
        in_flight: dict[str, int] = {}
        for rec in self.records.values():
            if rec.phase is Pull.PULLING:
                in_flight[rec.image] = in_flight.get(rec.image, 0) + 1
        for key in sorted(wanted, key=lambda k: (wanted[k] is not None, k)):   # replicas' pulls first
            node, image = key
            if node not in images or image_aliases(image) & images[node]:
                continue
            rec = self.records.get(key)
            if rec is not None and (rec.phase in (Pull.PULLING, Pull.PRESENT) or now < (rec.retry_at_s or 0.0)):
                continue
            limit = wanted[key]
            if limit is not None and in_flight.get(image, 0) >= limit:
                continue
            if rec is None:
                rec = self.records[key] = PullRecord(node, image, Pull.PULLING)
            rec.phase, rec.started_s, rec.pod_seen = Pull.PULLING, now, False
            in_flight[image] = in_flight.get(image, 0) + 1
            plan.create.append(key)
        return plan

    def fail(self, rec: PullRecord, why: str, plan: PrePullPlan) -> None:
        """Record a failure seen outside `step` (the API server refused the pod)."""
        self._fail(rec, why, self.clock(), plan)

    def _fail(self, rec: PullRecord, why: str, now: float, plan: PrePullPlan) -> None:
        rec.failures += 1
        rec.first_failure_s = rec.first_failure_s if rec.first_failure_s is not None else now
        state = _retry_state(rec.failures, rec.first_failure_s, now)
        rec.reason = why
        rec.retry_at_s = now + float(self.wait(state))
        rec.phase = Pull.GAVE_UP if self.stop(state) else Pull.BACKOFF
        plan.failed.append(rec)


class PrePuller:
    """`PrePullPolicy` with its side effects: pre-pull pods created and deleted in ``namespace``
    through `Kube`. ``reconcile`` is called with what the backend's informers hold."""

    def __init__(self, kube: Kube, namespace: str, fleet_id: str, settings: EnginePodSettings,
                 policy: PrePullPolicy) -> None:  # fmt: skip
        self.kube, self.namespace, self.fleet_id, self.settings = kube, namespace, fleet_id, settings
        self.policy = policy
        self.created = 0                 # pre-pull pods created since start
        self._deleting: set[str] = set()

    async def reconcile(self, wanted: dict[tuple[str, str], int | None], nodes: list[dict],
                        pull_pods: list[dict]) -> PrePullPlan:  # fmt: skip
        """Decide and act. ``nodes``: every Node object; ``pull_pods``: the pre-pull pods of
        this fleet (`is_pull_pod`). API errors are logged; the next reconcile retries."""
        images = {n["metadata"]["name"]: node_images(n) for n in nodes}
        pods: dict[tuple[str, str], dict] = {}
        names = set()
        for pod in pull_pods:
            names.add(pod["metadata"]["name"])
            if pod["metadata"].get("deletionTimestamp") or pod["metadata"]["name"] in self._deleting:
                continue
            image = (pod["metadata"].get("annotations") or {}).get(ANNOTATION_PREPULL_IMAGE)
            node = pod_node(pod)
            if image and node:
                pods[(node, image)] = pod
        self._deleting &= names
        plan = self.policy.step(wanted, images, pods)
        for name in plan.delete:
            if name in self._deleting:
                continue
            self._deleting.add(name)
            try:
                await self.kube.delete(PODS, self.namespace, name, grace_period_s=0)
            except Exception as err:  # noqa: BLE001 - ApiError, connection errors: retried next time
                self._deleting.discard(name)
                log.warning("cannot delete pre-pull pod %s: %s", name, err)
        for node, image in plan.create:
            rec = self.policy.record(node, image)
            body = pull_pod_manifest(node, image, fleet_id=self.fleet_id, settings=self.settings,
                                     attempt=rec.failures if rec is not None else 0)  # fmt: skip
            try:
                await self.kube.create(PODS, self.namespace, body)
                self.created += 1
                log.info("pre-pulling image %s onto node %s (pod %s)", image, node, body["metadata"]["name"])
            except Exception as err:  # noqa: BLE001 - 409: it exists (an earlier operator's): the next step reads it
                if getattr(err, "status", None) != 409 and rec is not None:
                    self.policy.fail(rec, f"the API server refused the pre-pull pod: {err}", plan)
        for rec in plan.failed:
            log.warning("%s", rec.describe(self.policy.clock()))
        return plan
