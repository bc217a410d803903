"""GPU health reaches cluster placement (fleet/inventory/gpu_health.py, fleet/inventory/gfd.py,
fleet/k8s/backend.py, `fleet.controller.drain.Drainer`): the node agent's annotation parsed, its
quarantined GPUs and MIG instances kept out of the inventory (on the synthetic id of the replica
that really holds them), the pod holding one reported sick, drained and replaced by the real
controller on the fake cluster, and a TP pod whose GPUs span NVLink domains flagged."""

from __future__ import annotations

import pytest

from fleet.inventory.gfd import node_from_k8s
from fleet.inventory.gpu_health import ANNOTATION, GpuHealthFacts, QuarantinedGpu, gpu_health_value, \
    parse_gpu_health  # fmt: skip
from fleet.k8s.client import EVENTS, NODES
from fleet.k8s.pod_facts import pod_node
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.placement import ReplicaPlacement
from fleet.testing.k8s.nodes import node
from tests.unit.test_k8s_backend import NS, Cluster, _dep

XID = QuarantinedGpu(index=3, uuid="GPU-3", reason="xid: Xid 79 (fell off the bus)", since_s=1.0, pods=("uid-a",))


def _annotated(name="gpu-a", gpus=8, facts=GpuHealthFacts(), **kw) -> dict:
    return node(name, gpus=gpus, annotations={ANNOTATION: gpu_health_value(facts)}, **kw)


def test_the_annotation_round_trips_and_bad_values_name_it():
    facts = GpuHealthFacts((XID, QuarantinedGpu(0, "GPU-0", "ecc", mig="MIG-1", profile="1g.10gb")),
                           {"uid-a": (3,), "uid-b": (0, 1)}, True)  # fmt: skip
    assert parse_gpu_health(gpu_health_value(facts)) == facts
    assert parse_gpu_health(None) == parse_gpu_health("") == GpuHealthFacts()
    for bad in ("{", "[]", '{"quarantined": [{"uuid": "x"}]}', '{"allocations": {"u": "0"}}'):
        with pytest.raises(ValueError, match=ANNOTATION):
            parse_gpu_health(bad)


def test_sick_pods_from_the_pods_lists_and_the_allocations():
    facts = GpuHealthFacts((XID,), {"uid-b": (2, 3), "uid-c": (0,)})
    assert set(facts.sick_pods()) == {"uid-a", "uid-b"}


def test_a_quarantined_gpu_leaves_the_inventory_once():
    inv = node_from_k8s(_annotated(facts=GpuHealthFacts((XID,))))
    assert [g.index for g in inv.gpus if not g.health.healthy] == [3]
    assert "Xid 79" in inv.quarantined["gpu-a/gpu3"]
    # the device plugin withholds it too (allocatable 7): still one GPU out, not two
    obj = _annotated(facts=GpuHealthFacts((XID,)))
    obj["status"]["allocatable"]["nvidia.com/gpu"] = "7"
    assert sum(not g.health.healthy for g in node_from_k8s(obj).gpus) == 1
    with pytest.raises(ValueError, match="node gpu-a: annotation"):
        node_from_k8s(node("gpu-a", gpus=8, annotations={ANNOTATION: "{"}))


def test_the_mark_follows_the_pod_that_holds_the_gpu():
    # physical GPU 3, held by the pod whose replica Fleet placed on synthetic gpu0
    inv = node_from_k8s(_annotated(facts=GpuHealthFacts((XID,))), held={"uid-a": ("gpu-a/gpu0",),
                                                                         "uid-z": ("gpu-a/gpu3",)})
    assert list(inv.quarantined) == ["gpu-a/gpu0"]
    # held by no pod of ours, but a replica sits on synthetic gpu3: a free GPU of its NVLink domain carries it
    free = QuarantinedGpu(index=3, uuid="GPU-3", reason="ecc")
    obj = _annotated(gpus=4, facts=GpuHealthFacts((free,)))
    obj["metadata"]["labels"]["fleet.inference.dev/nvlink-domains"] = "0-1;2-3"
    inv = node_from_k8s(obj, held={"uid-z": ("gpu-a/gpu3",)})
    assert list(inv.quarantined) == ["gpu-a/gpu2"]


def test_a_quarantined_mig_instance_of_its_profile_is_left_out():
    q = QuarantinedGpu(index=0, uuid="GPU-0", reason="xid 43", mig="MIG-x", profile="1g.10gb")
    obj = node("mig-a", gpus=1, mig={"3g.40gb": 1, "1g.10gb": 2}, annotations={ANNOTATION: gpu_health_value(
        GpuHealthFacts((q,)))})
    profiles = sorted(m.profile for g in node_from_k8s(obj).gpus for m in g.mig_instances)
    assert profiles == ["1g.10gb", "3g.40gb"]


# ----- on the fake cluster, with the real controller ----------------------------------------------------


def _gpu_dep(tp=1):
    return _dep(resources={"accelerator": "gpu", "tensorParallelSize": tp}, replicas={"min": 2, "max": 2})


async def _ready(*nodes, tp=1) -> Cluster:
    cl = Cluster(_gpu_dep(tp), nodes=nodes)
    await cl.c.start(None)
    await cl.tick()
    cl.kubelet_runs_everything()
    await cl.tick(n=3)
    assert set(cl.status().values()) == {S.READY}, cl.status()
    return cl


async def _annotate(cl: Cluster, name: str, facts: GpuHealthFacts) -> None:
    await cl.kube.patch(NODES, None, name, {"metadata": {"annotations": {ANNOTATION: gpu_health_value(facts)}}})


async def test_a_pod_on_a_quarantined_gpu_is_drained_and_replaced_off_it():
    cl = await _ready(node("gpu-a", gpus=2, images=["fleet:1"]), node("gpu-b", gpus=2, images=["fleet:1"]))
    pods = cl.pods()
    victim = next(p for p in pods.values() if pod_node(p) == "gpu-a")
    rid = victim["metadata"]["name"]
    # the device plugin gave it physical GPU 1, whatever synthetic id Fleet placed it on
    q = QuarantinedGpu(index=1, uuid="GPU-1", reason="xid: Xid 79", pods=(victim["metadata"]["uid"],))
    await _annotate(cl, "gpu-a", GpuHealthFacts((q,), {victim["metadata"]["uid"]: (1,)}, True))
    await cl.tick()
    r = cl.c.replicas[rid]
    assert r.status is S.DRAINING and "quarantines" in r.drain_reason and "Xid 79" in r.drain_reason
    placed = ReplicaPlacement.from_dict(r.placement).devices
    inv = await cl.backend.inventory()
    assert list(inv.node("gpu-a").quarantined) == list(placed)   # the mark sits where that replica was placed
    await cl.tick(n=3)
    replacement = [x for x in cl.c.replicas.values() if x.id != rid and x.status.counts_toward_desired()]
    assert len(replacement) == 2
    held = {d for x in replacement if x.placement for d in ReplicaPlacement.from_dict(x.placement).devices}
    assert not held & set(placed)


async def test_a_tp_pod_across_nvlink_domains_gets_a_warning_once():
    obj = node("gpu-a", gpus=4, images=["fleet:1"])
    obj["metadata"]["labels"]["fleet.inference.dev/nvlink-domains"] = "0-1;2-3"
    cl = await _ready(obj, tp=2)
    uids = {p["metadata"]["uid"]: p["metadata"]["name"] for p in cl.pods().values()}
    split, paired = list(uids)
    await _annotate(cl, "gpu-a", GpuHealthFacts((), {split: (1, 2), paired: (2, 3)}, True))
    await cl.tick(n=2)
    events = [e for e in cl.store.list(EVENTS, NS, None)[0] if e["reason"] == "NVLinkSpan"]
    assert len(events) == 1 and events[0]["type"] == "Warning"
    assert uids[split] in events[0]["message"] and "GPUs 1,2" in events[0]["message"]
    facts = await cl.backend.observe()
    assert "nvlink" in facts[uids[split]].detail and "nvlink" not in facts[uids[paired]].detail
    assert all(r.status is S.READY for r in cl.c.replicas.values())   # flagged, not failed
