"""What the operator writes back to the cluster, derived from the controller's records: the
InferenceDeployment status (observedGeneration, replicas by state, revisions, conditions Ready /
Progressing / Degraded with reasons), core/v1 Events for replica transitions and decisions,
and the reverse: the previous controller state rebuilt from pods and statuses after an operator
restart (`snapshot_from_cluster`, read by `fleet.controller.reconcile.Controller.start`).

Pure functions over dicts and controller records; `fleet.k8s.operator` sends what they return.
"""

from __future__ import annotations

import datetime
import json
from collections import Counter
from typing import Any

from fleet.controller.reconcile import Controller, ReplicaEvent
from fleet.controller.targets import STATE_FORMAT
from fleet.controller.lifecycle import ReplicaStatus
from fleet.k8s.pod_facts import pod_facts, pod_node
from fleet.k8s.pods import (ANNOTATION_MODEL, ANNOTATION_PLACEMENT, ANNOTATION_READY_AT, LABEL_DEPLOYMENT,
                            LABEL_GANG_ROLE, LABEL_REPLICA, LABEL_REVISION, LABEL_SPEC_HASH)  # fmt: skip
from fleet.placement import ReplicaPlacement

PREEMPTIONS_IN_STATUS = 5
"""Latest preemptions a deployment's status lists (`fleet.controller.preemption.Preemptor.recent`)."""

_IN_PROGRESS = (ReplicaStatus.PENDING, ReplicaStatus.PLACED, ReplicaStatus.PULLING, ReplicaStatus.CACHING,
                ReplicaStatus.STARTING, ReplicaStatus.WARMING, ReplicaStatus.DRAINING)  # fmt: skip


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.datetime.strptime(text[:19], "%Y-%m-%dT%H:%M:%S").replace(tzinfo=datetime.timezone.utc).timestamp()


def _condition(type_: str, ok: bool, reason: str, message: str, generation: int, previous: dict, now: float) -> dict:
    status = "True" if ok else "False"
    old = previous.get(type_) or {}
    since = old.get("lastTransitionTime") if old.get("status") == status else iso(now)
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "observedGeneration": generation, "lastTransitionTime": since or iso(now)}  # fmt: skip


def deployment_status(controller: Controller, name: str, generation: int, previous: dict | None,
                      now: float, records: list | None = None) -> dict[str, Any]:  # fmt: skip
    """The status of deployment ``name`` (the CRD's status schema: fleet/k8s/crd.py).
    ``records``: its replica records when the caller has grouped them (else found here)."""
    ds = controller.deployments[name]
    if records is None:
        records = [r for r in controller.replicas.values() if r.deployment == name]
    live = [r for r in records if not r.status.terminal()]
    states = Counter(r.status.value for r in records)
    ready = states.get(ReplicaStatus.READY.value, 0)
    prev = {c["type"]: c for c in (previous or {}).get("conditions") or []}
    waiting = [controller.waiting_reason(r.id) for r in live if r.status is ReplicaStatus.PENDING]
    waiting = [w for w in waiting if w]
    in_progress = [r for r in live if r.status in _IN_PROGRESS]
    failed_recently = ds.failures_in_row > 0
    ready_ok = ready >= ds.desired
    ready_reason = ("ScaledToZero" if ds.desired == 0 else "AllReplicasReady") if ready_ok else "ReplicasNotReady"
    if in_progress:
        draining = sum(r.status is ReplicaStatus.DRAINING for r in in_progress)
        progress = ("ReplicasDraining" if draining == len(in_progress) else "ReplicasStarting",
                    f"{len(in_progress)} replica(s) starting or draining")
    else:
        progress = ("Stable", "no replica is starting or draining")
    refused = [r for r in live if r.unschedulable]
    if waiting:
        degraded = (True, "Unplaceable", waiting[0])
    elif refused:
        degraded = (True, "Unschedulable", f"{refused[0].id}: the scheduler cannot place it on node "
                    f"{refused[0].node or '?'}: {refused[0].unschedulable}")
    elif failed_recently:
        last = max((r for r in records if r.failure), key=lambda r: r.failure.at_s, default=None)
        why = f"{last.id}: {last.failure.status.value}: {last.failure.reason}" if last else "a replica failed"
        degraded = (True, "ReplicaFailed", f"{ds.failures_in_row} failure(s) in a row; last {why}")
    else:
        degraded = (False, "AsExpected", "no recent replica failure")
    spec = ds.loaded.deployment.spec
    unsupported = spec.standby_unsupported() if spec.standby is not None else None
    return {
        "observedGeneration": generation,
        "desiredReplicas": ds.desired,
        "desiredReason": ds.desired_reason,
        "readyReplicas": ready,
        "standbyReplicas": states.get(ReplicaStatus.STANDBY.value, 0),
        **({"standbyUnsupported": unsupported} if unsupported else {}),
        "replicas": dict(sorted(states.items())),
        "revisions": dict(sorted(Counter(r.revision for r in live).items())),
        "servingHash": ds.loaded.serving_hash,
        "nextIndex": ds.next_index,
        "preemptions": [
            {"replica": str(e.get("replica")), "deployment": str(e.get("deployment")), "for": str(e.get("for")),
             "reason": str(e.get("reason", "")), "time": iso(now - max(0.0, controller.clock() - e.get("at_s", 0.0)))}
            for e in controller.preemption.recent if name in (e.get("deployment"), e.get("for"))
        ][-PREEMPTIONS_IN_STATUS:],
        "conditions": [
            _condition("Ready", ready_ok, ready_reason, f"{ready}/{ds.desired} replicas ready", generation, prev, now),
            _condition("Progressing", bool(in_progress), progress[0], progress[1], generation, prev, now),
            _condition("Degraded", degraded[0], degraded[1], degraded[2][:1000], generation, prev, now),
        ],
    }


def invalid_status(generation: int, problems: list[str], previous: dict | None, now: float) -> dict[str, Any]:
    """Status of a resource `fleet.spec.parse_document` refuses: Ready False, Degraded True,
    reason InvalidSpec, the same messages `fleet validate` prints."""
    prev = {c["type"]: c for c in (previous or {}).get("conditions") or []}
    message = "; ".join(problems)[:1000]
    return {
        "observedGeneration": generation,
        "conditions": [
            _condition("Ready", False, "InvalidSpec", message, generation, prev, now),
            _condition("Progressing", False, "InvalidSpec", "nothing is started from an invalid spec", generation,
                       prev, now),
            _condition("Degraded", True, "InvalidSpec", message, generation, prev, now),
        ],
    }  # fmt: skip


def event_object(e: ReplicaEvent, owner: dict, reporter: str, now: float) -> dict[str, Any]:
    """A core/v1 Event on the InferenceDeployment for one replica transition."""
    meta = owner["metadata"]
    reason = "Replica" + "".join(w.capitalize() for w in e.new.value.split("_"))
    old = e.old.value if e.old else "-"
    return {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta.get("namespace")},
        "involvedObject": {"apiVersion": owner.get("apiVersion"), "kind": owner.get("kind"), "name": meta["name"],
                           "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "reason": reason,
        "message": f"{e.replica_id}: {old} -> {e.new.value}" + (f": {e.detail}" if e.detail else ""),
        "type": "Warning" if e.new.failed() else "Normal",
        "source": {"component": "fleet-operator"},
        "reportingComponent": "fleet-operator", "reportingInstance": reporter,
        "firstTimestamp": iso(now), "lastTimestamp": iso(now), "count": 1,
    }  # fmt: skip


def decision_event(owner: dict, reason: str, message: str, reporter: str, now: float, warning: bool = False) -> dict:
    """A core/v1 Event on the InferenceDeployment for an operator decision (spec accepted,
    refused, deployment retired...)."""
    e = event_object(ReplicaEvent("-", owner["metadata"]["name"], None, ReplicaStatus.PENDING, "", now), owner,
                     reporter, now)  # fmt: skip
    e["reason"], e["message"], e["type"] = reason, message, "Warning" if warning else "Normal"
    return e


def snapshot_from_cluster(crs: list[dict], pods: list[dict]) -> dict[str, Any]:
    """The controller state an earlier operator left, rebuilt from what the cluster keeps:
    targets from each resource's status (desiredReplicas, nextIndex), one replica record per
    pod (placement and model from its annotations, READY when its warm-up-passed annotation is
    there, DRAINING when it is being deleted). Pods of deployments without a resource are
    listed under their model so their pools are drained and deleted."""
    deployments: dict[str, dict] = {}
    for cr in crs:
        status = cr.get("status") or {}
        spec = cr.get("spec") or {}
        deployments[cr["metadata"]["name"]] = {
            "desired": status.get("desiredReplicas", (spec.get("replicas") or {}).get("initial")
                                  or (spec.get("replicas") or {}).get("min", 1)),
            "desired_reason": status.get("desiredReason") or "spec.replicas",
            "next_index": int(status.get("nextIndex") or 0),
            "model": (spec.get("model") or {}).get("name"),
        }  # fmt: skip
    replicas = []
    for pod in pods:
        meta = pod["metadata"]
        labels = meta.get("labels") or {}
        ann = meta.get("annotations") or {}
        rid, dep = labels.get(LABEL_REPLICA), labels.get(LABEL_DEPLOYMENT)
        if not rid or not dep or labels.get(LABEL_GANG_ROLE) == "worker":
            continue   # one record per replica: a gang is recorded from its leader
        d = deployments.setdefault(dep, {"desired": 0, "next_index": 0, "model": ann.get(ANNOTATION_MODEL)})
        index = rid.rsplit("-", 1)[-1]
        if index.isdigit():
            d["next_index"] = max(int(d.get("next_index") or 0), int(index) + 1)
        created = parse_iso(meta.get("creationTimestamp")) or 0.0
        try:
            placement = json.loads(ann.get(ANNOTATION_PLACEMENT) or "null")
            label = ReplicaPlacement.from_dict(placement).label if placement else None
        except (ValueError, KeyError, TypeError):
            placement, label = None, None
        facts = pod_facts(pod)
        record: dict[str, Any] = {
            "id": rid, "deployment": dep, "revision": labels.get(LABEL_REVISION, "?"), "created_at_s": created,
            "spec_hash": labels.get(LABEL_SPEC_HASH, ""), "placed_at_s": created, "assignment": label,
            "placement": placement, "launched_at_s": created, "node": pod_node(pod) or None,
        }  # fmt: skip
        if facts.image_present:
            record["image_ready_at_s"] = record["weights_ready_at_s"] = created
        ready_at = ann.get(ANNOTATION_READY_AT)
        if ready_at:
            record["healthy_at_s"] = record["warmup_passed_at_s"] = float(ready_at)
        deleting = parse_iso(meta.get("deletionTimestamp"))
        if deleting is not None:
            record["drain_requested_at_s"] = record["stop_requested_at_s"] = deleting
        replicas.append(record)
    return {"format": STATE_FORMAT, "deployments": deployments, "replicas": replicas}
