"""The cluster in a box's scheduler stand-in (fleet/testing/k8s/workloads.py `schedule`) filters
as kube-scheduler 1.20 does for Fleet's pods: the required node affinity Fleet pins engine pods
with (fleet/k8s/pods.py `node_affinity`), label expressions, taints and tolerations, and resource
fit against what the pods bound to a node request; its refusal in the real scheduler's words
(tests/integration/test_scheduling_real.py reads those from the real one)."""

from __future__ import annotations

import pytest

from fleet.k8s.client import NODES, PODS
from fleet.k8s.pod_facts import pod_unschedulable
from fleet.k8s.pods import node_affinity
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.store import ObjectStore
from fleet.testing.k8s.workloads import schedule, selects

NS = "fleet"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TOLERATE_GPU = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]


def _pod(name: str, *, gpus: int = 0, cpu: str = "1", pin: str | None = None, tolerations=TOLERATE_GPU,
         **spec) -> dict:  # fmt: skip
    requests = {"cpu": cpu, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"metadata": {"name": name}, "spec": {
        "containers": [{"name": "c", "image": "x", "resources": {"requests": requests}}],
        "tolerations": tolerations, **({"affinity": node_affinity(pin)} if pin else {}), **spec}}  # fmt: skip


def _store(*nodes: dict) -> ObjectStore:
    store = ObjectStore()
    for n in nodes or (node("cpu-1", cpu=16), node("gpu-1", cpu=64, gpus=8, taints=[GPU_TAINT])):
        store.create(NODES, None, n)
    return store


def _scheduled(store: ObjectStore, name: str) -> dict:
    pod = store.get(PODS, NS, name)
    return next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")


def test_a_pinned_pod_is_bound_to_its_node_and_marked_scheduled():
    store = _store()
    store.create(PODS, NS, _pod("busy", cpu="15", pin="cpu-1"))
    store.create(PODS, NS, _pod("chat-0", pin="cpu-1"))            # the emptier gpu-1 is not its node
    assert schedule(store) == {(NS, "busy"): "cpu-1", (NS, "chat-0"): "cpu-1"}
    assert store.get(PODS, NS, "chat-0")["spec"]["nodeName"] == "cpu-1"
    assert _scheduled(store, "chat-0")["status"] == "True"


def test_gpus_held_by_other_pods_leave_a_pod_unschedulable_in_the_real_schedulers_words():
    store = _store()
    store.create(PODS, NS, _pod("other", gpus=7))
    assert schedule(store) == {(NS, "other"): "gpu-1"}
    store.create(PODS, NS, _pod("chat-0", gpus=2, pin="gpu-1"))
    assert schedule(store) == {(NS, "chat-0"): None}
    pod = store.get(PODS, NS, "chat-0")
    message = "0/2 nodes are available: 1 Insufficient nvidia.com/gpu, 1 node(s) didn't match Pod's node affinity."
    assert (_scheduled(store, "chat-0")["reason"], pod_unschedulable(pod)) == ("Unschedulable", message)
    assert "nodeName" not in pod["spec"] and pod["status"]["phase"] == "Pending"
    version = pod["metadata"]["resourceVersion"]
    schedule(store)
    assert store.get(PODS, NS, "chat-0")["metadata"]["resourceVersion"] == version   # same words: no write
    store.patch_status(PODS, NS, "other", {"status": {"phase": "Succeeded"}})          # an ended pod holds nothing
    assert schedule(store) == {(NS, "chat-0"): "gpu-1"}


@pytest.mark.parametrize("n, pod, reason", [
    (node("n", cpu=4), _pod("p", cpu="5"), "Insufficient cpu"),
    (node("n", cpu=4), _pod("p", cpu="500m", **{"initContainers": [
        {"name": "i", "image": "x", "resources": {"limits": {"memory": "65Gi"}}}]}), "Insufficient memory"),
    (node("n", mig={"3g.40gb": 1}), _pod("p", **{"containers": [{"name": "c", "image": "x", "resources": {
        "limits": {"nvidia.com/mig-3g.40gb": "2"}}}]}), "Insufficient nvidia.com/mig-3g.40gb"),
    (node("n", gpus=8, taints=[GPU_TAINT]), _pod("p", tolerations=[]),
     "node(s) had taint {nvidia.com/gpu: present}, that the pod didn't tolerate"),
    (node("n", unschedulable=True), _pod("p"), "node(s) were unschedulable"),
    (node("n"), _pod("p", nodeSelector={"pool": "gpu"}), "node(s) didn't match Pod's node affinity"),
])  # fmt: skip
def test_each_filter_refuses_with_its_reason(n, pod, reason):
    store = _store(n)
    store.create(PODS, NS, pod)
    assert schedule(store) == {(NS, "p"): None}
    assert pod_unschedulable(store.get(PODS, NS, "p")) == f"0/1 nodes are available: 1 {reason}."


def _affinity(*exprs: dict) -> dict:
    term = {"matchExpressions": list(exprs)}
    return {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [term]}}}}


@pytest.mark.parametrize("expr, matches", [
    ({"key": "pool", "operator": "In", "values": ["gpu", "x"]}, True),
    ({"key": "pool", "operator": "In", "values": ["cpu"]}, False),
    ({"key": "pool", "operator": "NotIn", "values": ["cpu"]}, True),
    ({"key": "zone", "operator": "NotIn", "values": ["a"]}, True),       # absent: not in
    ({"key": "pool", "operator": "Exists"}, True),
    ({"key": "zone", "operator": "Exists"}, False),
    ({"key": "zone", "operator": "DoesNotExist"}, True),
    ({"key": "pool", "operator": "DoesNotExist"}, False),
    ({"key": "nvidia.com/gpu.count", "operator": "Gt", "values": ["4"]}, True),
    ({"key": "nvidia.com/gpu.count", "operator": "Lt", "values": ["4"]}, False),
])  # fmt: skip
def test_label_expressions_of_the_required_node_affinity(expr, matches):
    n = node("n", gpus=8, labels={"pool": "gpu"})
    assert selects(_affinity(expr), n) is matches
    assert selects(_affinity(expr, {"key": "pool", "operator": "In", "values": ["gpu"]}), n) is matches
    assert selects({"affinity": node_affinity("n")}, n) and not selects({"affinity": node_affinity("m")}, n)
