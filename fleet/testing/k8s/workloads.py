"""The controllers and scheduler of the cluster in a box: Deployments and DaemonSets become pods,
pods without a node get one. A TEST STAND-IN for kube-controller-manager and kube-scheduler, as
small as the chart's workloads need.

`Workloads.sync()` (called every ``period_s`` by `run`):
- a Deployment keeps ``spec.replicas`` pods of its template (named ``<name>-<hash>-<suffix>``,
  owned by it, so deleting it deletes them); pods that ended (Succeeded / Failed) are replaced;
  a changed template replaces its pods (no surge: rollouts are not what the box tests);
- a DaemonSet keeps one pod on every node its nodeSelector and tolerations admit;
- the scheduler (`schedule`, also called alone by unit tests and by the kubelet stand-in of
  fleet/testing/k8s/apiserver.py) binds each unbound pod to a node that passes kube-scheduler's
  filters, in the order v1.20's default plugins run them (pkg/scheduler/algorithmprovider/
  registry.go; the first that fails gives the node's reason): NodeUnschedulable (cordoned),
  TaintToleration (NoSchedule and NoExecute taints), NodeAffinity (``nodeSelector`` and the
  required node affinity: ``matchFields`` on ``metadata.name``, ``matchExpressions`` on labels
  with In, NotIn, Exists, DoesNotExist, Gt, Lt) and NodeResourcesFit (cpu, memory, pods and
  extended resources such as ``nvidia.com/gpu`` requested against the Node's
  ``status.allocatable`` minus the requests of the pods bound there and not ended). Among the
  nodes that pass, pods asking for no GPU go to CPU nodes first, and the pods of one owner
  spread. A bound pod gets ``PodScheduled`` True; a pod no node takes stays Pending with
  ``PodScheduled`` False, reason ``Unschedulable`` and the scheduler's message
  (``0/3 nodes are available: 1 Insufficient nvidia.com/gpu, 2 node(s) didn't match Pod's node
  affinity.``, pkg/scheduler/core/generic_scheduler.go ``FitError.Error``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import json
import uuid

from collections import Counter
from collections.abc import Callable

from kubernetes.utils.quantity import parse_quantity

from fleet.k8s.client import NODES, PODS, ApiError
from fleet.testing.k8s.resources import DAEMONSETS, DEPLOYMENTS
from fleet.testing.k8s.store import ObjectStore, now_iso

UNSCHEDULABLE = "node(s) were unschedulable"                 # NodeUnschedulable's ErrReasonUnschedulable
NOT_SELECTED = "node(s) didn't match Pod's node affinity"    # NodeAffinity's ErrReasonPod
TOO_MANY_PODS = "Too many pods"                              # NodeResourcesFit


def _template_hash(template: dict) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def _tolerates(toleration: dict, taint: dict) -> bool:
    """core/v1 ``Toleration.ToleratesTaint``: effect (empty: all), key (empty with Exists: all),
    operator Exists, or Equal (the default) with the same value."""
    if toleration.get("effect") and toleration["effect"] != taint.get("effect"):
        return False
    if toleration.get("key") and toleration["key"] != taint.get("key"):
        return False
    if toleration.get("operator") == "Exists":
        return True
    return bool(toleration.get("key")) and toleration.get("value", "") == taint.get("value", "")


def _untolerated(pod_spec: dict, node: dict) -> dict | None:
    """The first NoSchedule or NoExecute taint of ``node`` no toleration of the pod tolerates."""
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and \
                not any(_tolerates(t, taint) for t in pod_spec.get("tolerations") or []):
            return taint
    return None


def _expression_matches(expr: dict, value: str | None) -> bool:
    """One NodeSelectorRequirement against the node's value for its key (None: absent)."""
    op, values = expr.get("operator"), expr.get("values") or []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and len(values) == 1:
        try:
            return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
        except ValueError:
            return False
    return False


def _term_matches(term: dict, node: dict) -> bool:
    """A NodeSelectorTerm: every expression on labels and every field (``metadata.name``) matches;
    an empty term matches nothing (k8s.io/component-helpers nodeaffinity)."""
    exprs, fields = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not fields:
        return False
    labels = node["metadata"].get("labels") or {}
    fields_of = {"metadata.name": node["metadata"]["name"]}
    return all(_expression_matches(e, labels.get(e.get("key"))) for e in exprs) and \
        all(_expression_matches(f, fields_of.get(f.get("key"))) for f in fields)


def selects(pod_spec: dict, node: dict) -> bool:
    """NodeAffinity's filter: the pod's ``nodeSelector`` and, when it has one, any term of its
    required node affinity match ``node``."""
    labels = node["metadata"].get("labels") or {}
    if any(labels.get(k) != v for k, v in (pod_spec.get("nodeSelector") or {}).items()):
        return False
    required = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
                .get("requiredDuringSchedulingIgnoredDuringExecution"))  # fmt: skip
    if not required:
        return True
    return any(_term_matches(t, node) for t in required.get("nodeSelectorTerms") or [])


def admits(pod_spec: dict, node: dict) -> bool:
    """The node filters but resources: not cordoned, selected, every taint tolerated."""
    return not (node.get("spec") or {}).get("unschedulable") and selects(pod_spec, node) \
        and _untolerated(pod_spec, node) is None


def pod_requests(pod_spec: dict) -> Counter:
    """What a pod requests (resource name -> amount, cpu in cores, memory in bytes): the sum
    over its containers, at least the largest init container's (the scheduler's
    ``computePodResourceRequest``); a resource with a limit and no request requests its limit
    (the API server's defaulting)."""
    def of(container: dict) -> Counter:
        res = container.get("resources") or {}
        asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
        return Counter({k: float(parse_quantity(v)) for k, v in asked.items()})

    total: Counter = Counter()
    for c in pod_spec.get("containers") or []:
        total.update(of(c))
    for c in pod_spec.get("initContainers") or []:
        for k, v in of(c).items():
            total[k] = max(total[k], v)
    return total


def _insufficient(asked: Counter, node: dict, used: Counter, pods_on: int) -> list[str]:
    """NodeResourcesFit's reasons: each requested resource the node's allocatable minus ``used``
    cannot hold (a resource the node does not list has none), and the pod count."""
    alloc = (node.get("status") or {}).get("allocatable") or {}
    reasons = []
    if pods_on + 1 > int(parse_quantity(alloc.get("pods", "110"))):
        reasons.append(TOO_MANY_PODS)
    for name, amount in sorted(asked.items()):
        if amount > 0 and amount + used[name] > float(parse_quantity(alloc.get(name, "0"))):
            reasons.append(f"Insufficient {name}")
    return reasons


def unfit(pod_spec: dict, node: dict, used: Counter, pods_on: int) -> list[str]:
    """Why ``node`` cannot take the pod, in kube-scheduler's words ([] when it can): the first
    filter that fails, in v1.20's plugin order (see the module docstring)."""
    if (node.get("spec") or {}).get("unschedulable"):
        return [UNSCHEDULABLE]
    if (taint := _untolerated(pod_spec, node)) is not None:
        return [f"node(s) had taint {{{taint.get('key')}: {taint.get('value', '')}}}, that the pod didn't tolerate"]
    if not selects(pod_spec, node):
        return [NOT_SELECTED]
    return _insufficient(pod_requests(pod_spec), node, used, pods_on)


def fit_error(nodes: int, reasons: Counter) -> str:
    """The scheduler's message for a pod no node takes (pkg/scheduler/core/generic_scheduler.go ``FitError.Error``:
    the reasons counted over nodes, sorted as strings)."""
    parts = sorted(f"{count} {reason}" for reason, count in reasons.items())
    return f"0/{nodes} nodes are available: {', '.join(parts)}."


def _ended(pod: dict) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


def schedule(store: ObjectStore) -> dict[tuple[str, str], str | None]:
    """One scheduling pass over every unbound pod of ``store``: each is bound to a node that
    passes the filters, or marked Unschedulable with the reasons (module docstring). Returns
    (namespace, pod) -> the node it was bound to, or None."""
    nodes = [o for (plural, _ns, _n), o in list(store.objects.items()) if plural == NODES.plural]
    used: dict[str, Counter] = {n["metadata"]["name"]: Counter() for n in nodes}
    count: Counter = Counter()
    owners: dict[str, Counter] = {}
    pending = []
    for (plural, ns, name), pod in list(store.objects.items()):
        if plural != PODS.plural:
            continue
        bound = (pod.get("spec") or {}).get("nodeName")
        if not bound:
            if not pod["metadata"].get("deletionTimestamp"):
                pending.append((ns, name, pod))
            continue
        count[bound] += 1
        for ref in pod["metadata"].get("ownerReferences") or []:
            owners.setdefault(bound, Counter())[ref.get("uid")] += 1
        if not _ended(pod):
            used.setdefault(bound, Counter()).update(pod_requests(pod["spec"]))
    out: dict[tuple[str, str], str | None] = {}
    for ns, name, pod in pending:
        reasons: Counter = Counter()
        fits = []
        for n in nodes:
            why = unfit(pod["spec"], n, used[n["metadata"]["name"]], count[n["metadata"]["name"]])
            reasons.update(why)
            if not why:
                fits.append(n)
        if not fits:
            out[(ns, name)] = None
            _unschedulable(store, ns, name, pod, fit_error(len(nodes), reasons))
            continue
        owner = next(iter(pod["metadata"].get("ownerReferences") or []), {}).get("uid")
        gpu = any(k.startswith("nvidia.com/") for k in pod_requests(pod["spec"]))
        node = min(fits, key=lambda n: (_gpu_node(n) and not gpu, owners.get(n["metadata"]["name"], Counter())[owner],
                                        count[n["metadata"]["name"]]))  # fmt: skip
        chosen = node["metadata"]["name"]
        try:
            store.patch(PODS, ns, name, {"spec": {"nodeName": chosen}})
            store.patch_status(PODS, ns, name, {"status": {"conditions": [
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": now_iso()}]}})
        except ApiError:
            continue   # deleted meanwhile
        out[(ns, name)] = chosen
        count[chosen] += 1
        used[chosen].update(pod_requests(pod["spec"]))
        if owner:
            owners.setdefault(chosen, Counter())[owner] += 1
    return out


def _unschedulable(store: ObjectStore, ns: str, name: str, pod: dict, message: str) -> None:
    """``PodScheduled`` False, reason Unschedulable, with ``message`` (written when it changes)."""
    seen = [c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "PodScheduled"]
    if seen and seen[0].get("reason") == "Unschedulable" and seen[0].get("message") == message:
        return
    try:
        store.patch_status(PODS, ns, name, {"status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": message,
             "lastTransitionTime": now_iso()}]}})  # fmt: skip
    except ApiError:
        pass


async def sync_every(sync: Callable[[], None], period_s: float, stop: asyncio.Event) -> None:
    """A stand-in controller's loop: ``sync()`` every ``period_s`` seconds until ``stop`` is set."""
    while not stop.is_set():
        sync()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


class Workloads:
    def __init__(self, store: ObjectStore, period_s: float = 0.2) -> None:
        self.store = store
        self.period_s = period_s
        self.created = 0

    async def run(self, stop: asyncio.Event) -> None:
        await sync_every(self.sync, self.period_s, stop)

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
        schedule(self.store)

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



def _gpu_node(node: dict) -> bool:
    """Pods that ask for no GPU go to CPU nodes first (what a cluster's taints usually arrange)."""
    alloc = (node.get("status") or {}).get("allocatable") or {}
    return any(k.startswith("nvidia.com/") for k in alloc)
