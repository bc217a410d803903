"""What a replica's pods say about it: from Pod objects back to `ReplicaFacts`.

Owns `pod_node` (the node of a pod: the one it is bound to, else the one Fleet pinned it to),
`pod_unschedulable` (the scheduler's message while it cannot place a pod), `pod_facts` (one
pod: phase, engine container state, image and weights present, exit reason, image problems,
endpoint, the scheduler's refusal), `pod_kv_events` (where routers subscribe to its KV cache
events) and `group_facts` (one replica from all its pods: one, or a gang's members). Called by
`fleet.k8s.backend` (observing replicas), `fleet.k8s.prepull` (the node of a pre-pull pod) and
`fleet.k8s.status` (the deployment's status). Pure;
tests/unit/test_k8s_backend.py calls them with literals.

KV cache events: `pod_kv_events` gives routers ``tcp://<pod IP>:<port>`` from the engine
container's declared ``kv-events`` and ``kv-replay`` ports (fleet/k8s/pods.py declares them), so
an adopted pod keeps its addresses; a pod that declares none publishes no addresses.
"""

from __future__ import annotations

from fleet.controller.backend import ReplicaFacts
from fleet.k8s.pod_settings import ENGINE_PORT
from fleet.k8s.pod_weights import WEIGHTS_CONTAINER
from fleet.k8s.pods import (
    ANNOTATION_NODE, ENGINE_CONTAINER, KV_EVENTS_PORT_NAME, KV_REPLAY_PORT_NAME, LABEL_DEPLOYMENT, LABEL_GANG_INDEX,
    LABEL_GANG_SIZE, LABEL_REPLICA, LABEL_SPEC_HASH,
)

_IMAGE_PROBLEMS = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                   "CreateContainerConfigError", "CreateContainerError", "RunContainerError")  # fmt: skip


def pod_node(pod: dict) -> str:
    """The node of ``pod``: ``spec.nodeName`` once the scheduler bound it, else the node Fleet
    pinned it to (the ``fleet.inference.dev/node`` annotation, `fleet.k8s.pods.pin_to_node`);
    "" when neither is set. The one reading of "the pod's node" in fleet/k8s/."""
    bound = (pod.get("spec") or {}).get("nodeName")
    if bound:
        return bound
    return (pod["metadata"].get("annotations") or {}).get(ANNOTATION_NODE) or ""


def pod_unschedulable(pod: dict) -> str | None:
    """The scheduler's message while it cannot place ``pod`` (its ``PodScheduled`` condition
    False with reason ``Unschedulable``, as kube-scheduler writes it: ``0/4 nodes are available:
    1 Insufficient nvidia.com/gpu, 3 node(s) didn't match Pod's node affinity.``); None otherwise
    (bound, not yet tried, or no message)."""
    if (pod.get("spec") or {}).get("nodeName"):
        return None
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
            return c.get("message") or "Unschedulable"
    return None


def pod_facts(pod: dict) -> ReplicaFacts:
    """What a Pod object says about its replica (see `fleet.controller.backend.ReplicaFacts`)."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    node = pod_node(pod)
    unschedulable = pod_unschedulable(pod)
    statuses = [c for c in status.get("containerStatuses") or [] if c.get("name") == ENGINE_CONTAINER]
    cs = statuses[0] if statuses else {}
    state = cs.get("state") or {}
    ip = status.get("podIP")
    detail = {"pod": meta["name"], "node": node or "-", "phase": phase}
    if ip:
        detail["ip"] = ip
    if unschedulable:
        detail["scheduling"] = f"the scheduler cannot place it on node {node or '?'}: {unschedulable}"
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
        kv_events=pod_kv_events(pod, ip) if endpoint is not None else None, unschedulable=unschedulable,
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


def group_facts(pods: list[dict]) -> ReplicaFacts:
    """One replica's facts from all its pods (one, or a gang's members): the leader's endpoint;
    running while every member runs; exited when any member exited or one is missing;
    unschedulable while the scheduler cannot place one member (the first such, named)."""
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
    refused = next(((i, f) for i, f in zip(sorted(by_index), members) if f.unschedulable), None)
    unschedulable = None
    if refused:
        unschedulable = f"gang member {refused[0]} on node {refused[1].node}: {refused[1].unschedulable}"
    if refused and "scheduling" not in detail:
        detail["scheduling"] = f"the scheduler cannot place {unschedulable}"
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
        detail, kv_events=facts.kv_events, unschedulable=unschedulable,
    )  # fmt: skip
