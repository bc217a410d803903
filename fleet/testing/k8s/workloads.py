"""The controllers and scheduler of the cluster in a box: Deployments and DaemonSets become pods,
pods without a node get one. A TEST STAND-IN for kube-controller-manager and kube-scheduler, as
small as the chart's workloads need.

`Workloads.sync()` (called every ``period_s`` by `run`):
- a Deployment keeps ``spec.replicas`` pods of its template (named ``<name>-<hash>-<suffix>``,
  owned by it, so deleting it deletes them); pods that ended (Succeeded / Failed) are replaced;
  a changed template replaces its pods (no surge: rollouts are not what the box tests);
- a DaemonSet keeps one pod on every node its nodeSelector and tolerations admit;
- the scheduler binds each unbound pod to an admissible node (nodeSelector, taints tolerated,
  cordoned nodes skipped), spreading the pods of one owner over nodes.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import uuid

from fleet.k8s.client import PODS, ApiError
from fleet.testing.k8s.resources import DAEMONSETS, DEPLOYMENTS
from fleet.testing.k8s.store import ObjectStore


def _template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _tolerated(pod_spec: dict, node: dict) -> bool:
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if not any((t.get("operator") == "Exists" and t.get("key") in (None, taint["key"])) or
                   (t.get("key") == taint["key"] and t.get("value") == taint.get("value"))
                   for t in pod_spec.get("tolerations") or []):  # fmt: skip
            return False
    return True


def admits(pod_spec: dict, node: dict) -> bool:
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    return not (node.get("spec") or {}).get("unschedulable") and _tolerated(pod_spec, node)


class Workloads:
    def __init__(self, store: ObjectStore, period_s: float = 0.2) -> None:
        self.store = store
        self.period_s = period_s
        self.created = 0

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            self.sync()
            try:
                await asyncio.wait_for(stop.wait(), self.period_s)
            except asyncio.TimeoutError:
                pass

    def _pods_of(self, owner: dict) -> list[dict]:
        uid = owner["metadata"]["uid"]
        return [p for (plural, _ns, _n), p in self.store.objects.items() if plural == "pods"
                and any(o.get("uid") == uid for o in p["metadata"].get("ownerReferences") or [])]  # fmt: skip

    def _create_pod(self, owner: dict, kind: str, name: str, node: str | None) -> None:
        template = copy.deepcopy(owner["spec"]["template"])
        meta = template.setdefault("metadata", {})
        meta["name"] = name
        meta.setdefault("labels", {})["pod-template-hash"] = _template_hash(owner["spec"]["template"])
        meta["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": kind, "name": owner["metadata"]["name"],
                                    "uid": owner["metadata"]["uid"], "controller": True}]  # fmt: skip
        if node:
            template["spec"]["nodeName"] = node
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": template["spec"]}
        self.store.create(PODS, owner["metadata"]["namespace"], pod)
        self.created += 1

    def _delete(self, pod: dict) -> None:
        try:
            self.store.delete(PODS, pod["metadata"]["namespace"], pod["metadata"]["name"])
        except ApiError:
            pass

    def sync(self) -> None:
        nodes = [o for (plural, _ns, _n), o in list(self.store.objects.items()) if plural == "nodes"]
        for (plural, _ns, _n), obj in list(self.store.objects.items()):
            if obj["metadata"].get("deletionTimestamp"):
                continue
            if plural == DEPLOYMENTS.plural:
                self._deployment(obj)
            elif plural == DAEMONSETS.plural:
                self._daemonset(obj, nodes)
        self._schedule(nodes)

    def _deployment(self, d: dict) -> None:
        want = int(d["spec"].get("replicas", 1))
        current = _template_hash(d["spec"]["template"])
        pods = [p for p in self._pods_of(d) if not p["metadata"].get("deletionTimestamp")]
        for p in pods:
            ended = (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            if ended or p["metadata"]["labels"].get("pod-template-hash") != current:
                self._delete(p)
        live = [p for p in pods if (p.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
                and p["metadata"]["labels"].get("pod-template-hash") == current]  # fmt: skip
        for _ in range(want - len(live)):
            self._create_pod(d, "Deployment", f"{d['metadata']['name']}-{current[:9]}-{uuid.uuid4().hex[:5]}", None)
        for p in live[want:]:
            self._delete(p)
        ready = sum(1 for p in live if any(c.get("type") == "Ready" and c.get("status") == "True"
                                           for c in (p.get("status") or {}).get("conditions") or []))  # fmt: skip
        self.store.patch_status(DEPLOYMENTS, d["metadata"]["namespace"], d["metadata"]["name"],
                                {"status": {"replicas": len(live), "readyReplicas": ready}})

    def _daemonset(self, ds: dict, nodes: list[dict]) -> None:
        pods = [p for p in self._pods_of(ds) if not p["metadata"].get("deletionTimestamp")]
        by_node = {p["spec"].get("nodeName"): p for p in pods}
        for p in pods:
            if (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                self._delete(p)
                by_node.pop(p["spec"].get("nodeName"), None)
        for node in nodes:
            name = node["metadata"]["name"]
            if name not in by_node and admits(ds["spec"]["template"]["spec"], node):
                self._create_pod(ds, "DaemonSet", f"{ds['metadata']['name']}-{uuid.uuid4().hex[:5]}", name)

    def _schedule(self, nodes: list[dict]) -> None:
        for (plural, ns, name), pod in list(self.store.objects.items()):
            if plural != "pods" or pod["spec"].get("nodeName") or pod["metadata"].get("deletionTimestamp"):
                continue
            owner = next(iter(pod["metadata"].get("ownerReferences") or []), {}).get("uid")
            fits = [n for n in nodes if admits(pod["spec"], n) and not _gpu_node(n)] or \
                [n for n in nodes if admits(pod["spec"], n)]  # fmt: skip
            if not fits:
                continue

            def load(n: dict) -> tuple[int, int]:
                on = [p for (pl, _a, _b), p in self.store.objects.items() if pl == "pods"
                      and p["spec"].get("nodeName") == n["metadata"]["name"]]  # fmt: skip
                same = sum(1 for p in on if any(o.get("uid") == owner for o in p["metadata"].get("ownerReferences") or []))
                return same, len(on)

            node = min(fits, key=load)
            self.store.patch(PODS, ns, name, {"spec": {"nodeName": node["metadata"]["name"]}})


def _gpu_node(node: dict) -> bool:
    """Pods that ask for no GPU go to CPU nodes first (what a cluster's taints usually arrange)."""
    alloc = (node.get("status") or {}).get("allocatable") or {}
    return any(k.startswith("nvidia.com/") for k in alloc)

