"""The node facts the agent publishes (fleet/k8s/node_facts.py): values, the merge patch, the
operator's parser; the pods' uids behind the PodResources API's names (`PodUids`); the
credentials stripped (fleet/sources.py `redact_source`) and the NVLink label's format
(fleet/inventory/gfd.py `format_nvlink_domains`). The Kubernetes wrapper is the in-repo fake."""

from __future__ import annotations

import json
import random
import re

import pytest

from fleet.inventory.gfd import format_nvlink_domains, node_from_k8s, parse_nvlink_domains
from fleet.inventory.nvml import node_from_nvml
from fleet.k8s.client import NODES, PODS, ApiError
from fleet.inventory.gpu_health import gpu_health_value
from fleet.k8s.node_facts import (
    CACHED_ANNOTATION, GPU_HEALTH_ANNOTATION, NVLINK_DOMAINS_LABEL, GpuHealthFacts, NodeFacts, NodeFactsPublisher,
    PodUids, QuarantinedGpu, cached_value, node_facts, node_facts_patch, parse_gpu_health,
)
from fleet.sources import redact_source
from fleet.testing.fake_nvml import mig_h100, nvlink_pairs_4gpu, nvswitch_8gpu, partial_nvlink_8gpu, pcie_4gpu
from fleet.testing.k8s.nodes import node
from tests.support.fake_kube import FakeKube


@pytest.mark.parametrize("source, redacted", [
    ("https://u:p@h.example/x?X-Amz-Signature=abc&X-Amz-Credential=k", "https://h.example/x"),
    ("https://h.example/m/fleet-manifest.json#frag", "https://h.example/m/fleet-manifest.json"),
    ("http://token@h.example:8080/m/", "http://h.example:8080/m/"),
    ("hf://org/name@rev", "hf://org/name@rev"),
    ("s3://bucket/path/to/model?versionId=3", "s3://bucket/path/to/model"),
    ("s3://AKIA:secret@bucket/key", "s3://bucket/key"),
    ("file:///models/m", "file:///models/m"),
    ("/models/m", "/models/m"),
])
def test_redact_source_strips_userinfo_query_and_fragment(source, redacted):
    assert redact_source(source) == redacted


@pytest.mark.parametrize("snapshot, label", [
    (nvswitch_8gpu(), "0-7"), (partial_nvlink_8gpu(), "0-3_4-7"), (nvlink_pairs_4gpu(), "0-1_2-3"),
    (pcie_4gpu(), "none"),
])
def test_the_nvlink_label_is_written_from_nvml_and_reads_back(snapshot, label):
    domains = node_from_nvml(snapshot, "n").nvlink_domains
    assert format_nvlink_domains(domains) == label
    assert parse_nvlink_domains(label) == domains
    assert LABEL_VALUE.fullmatch(label)


def test_format_nvlink_domains_writes_gaps_as_lists():
    assert format_nvlink_domains([(0, 2, 3), (5,)]) == "0.2-3_5"
    assert parse_nvlink_domains(format_nvlink_domains([(0, 2, 3)])) == ((0, 2, 3),)


# Kubernetes' label value (apimachinery IsValidLabelValue): at most 63 characters.
LABEL_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


def _groupings(n: int, rng: random.Random) -> list[tuple[tuple[int, ...], ...]]:
    """Ways to put GPUs 0..n-1 in NVLink domains: the longest to write (every other GPU, no
    runs), one GPU per domain, pairs, all in one, and random partitions."""
    out = [(tuple(range(0, n, 2)), tuple(range(1, n, 2))), tuple((i,) for i in range(n)),
           tuple((i, i + 1) for i in range(0, n - 1, 2)), (tuple(range(n)),)]
    for _ in range(200):
        labels = [rng.randrange(max(1, n // 2)) for _ in range(n)]
        out.append(tuple(tuple(i for i in range(n) if labels[i] == d) for d in sorted(set(labels))))
    return out


@pytest.mark.parametrize("gpus", [2, 4, 8, 16])
def test_every_grouping_of_up_to_16_gpus_is_a_legal_label_value_that_reads_back(gpus):
    for domains in _groupings(gpus, random.Random(gpus)):
        value = format_nvlink_domains(domains)
        assert len(value) <= 63 and LABEL_VALUE.fullmatch(value), value
        assert parse_nvlink_domains(value) == tuple(sorted(domains)), value


def test_a_grouping_too_long_for_a_label_is_refused_and_not_published():
    every_other = (tuple(range(0, 32, 2)), tuple(range(1, 32, 2)))
    with pytest.raises(ValueError, match=r"take 85 characters; a label value holds at most 63"):
        format_nvlink_domains(every_other)
    facts = node_facts({}, [], {}, [], every_other)
    assert facts.nvlink_domains is None
    patch = node_facts_patch(facts) or {"metadata": {}}
    assert NVLINK_DOMAINS_LABEL not in patch["metadata"].get("labels", {})
    assert node_facts({}, [], {}, [], (tuple(range(32)),)).nvlink_domains == "0-31"   # one run fits


# {pod uid: device ids}, as `PodUids` hands them on (fleet/agent/pod_devices.py reads the kubelet).
ALLOCATIONS = {
    "pod-a": ("GPU-00000002-0000-0000-0000-000000000000", "GPU-00000003-0000-0000-0000-000000000000"),
    "pod-b": ("GPU-00000000-0000-0000-0000-000000000000",),
    "pod-d": ("GPU-00000001-0000-0000-0000-000000000000",),
}


def _pod(kube: FakeKube, name: str) -> str:
    """Create pod ``fleet/<name>``; its uid (the store gives one)."""
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"namespace": "fleet", "name": name}}
    return kube.store.create(PODS, "fleet", body)["metadata"]["uid"]


def test_pod_uids_are_got_once_per_listed_pod_and_a_gone_pod_is_left_out():
    kube = FakeKube()
    uid1, uid2 = _pod(kube, "r-1"), _pod(kube, "r-2")
    uids = PodUids(kube)
    listed = {("fleet", "r-1"): ("GPU-1",), ("fleet", "r-2"): ("GPU-2",), ("fleet", "gone"): ("GPU-3",)}
    assert uids.resolve_sync(listed) == ({uid1: ("GPU-1",), uid2: ("GPU-2",)}, True)
    assert kube.calls["get"] == 3
    assert uids.resolve_sync(listed)[0] == {uid1: ("GPU-1",), uid2: ("GPU-2",)}
    assert kube.calls["get"] == 4                       # only the pod the API server did not have, again
    # r-1 leaves the listing and comes back as another pod of the same name: got again
    kube.store.delete(PODS, "fleet", "r-1")
    assert uids.resolve_sync({("fleet", "r-2"): ("GPU-2",)}) == ({uid2: ("GPU-2",)}, True)
    uid9 = _pod(kube, "r-1")
    assert uid9 != uid1 and uids.resolve_sync({("fleet", "r-1"): ("GPU-1",)}) == ({uid9: ("GPU-1",)}, True)


def test_a_failed_get_leaves_the_pod_out_and_the_answer_incomplete():
    kube = FakeKube()
    uid = _pod(kube, "r-1")
    kube.fail_next["get"] = ApiError(403, "Forbidden", "pods is forbidden")
    uids = PodUids(kube)
    assert uids.resolve_sync({("fleet", "r-1"): ("GPU-1",)}) == ({}, False)
    assert uids.resolve_sync({("fleet", "r-1"): ("GPU-1",)}) == ({uid: ("GPU-1",)}, True)


def _status(*quarantined):
    return {"health_checks": True, "quarantined": [
        {"gpu": gpu, "reason": reason, "since_s": 1_764_000_000.0} for gpu, reason in quarantined]}


def test_node_facts_name_the_quarantined_gpu_and_the_pods_holding_it():
    snap = nvswitch_8gpu()
    uuid = snap["devices"][3]["uuid"]
    facts = node_facts(_status((uuid, "xid: Xid 79: GPU has fallen off the bus (gpu_lost)"), ("node", "NVML failed")),
                       snap["devices"], {**ALLOCATIONS, "pod-gone": ("GPU-not-on-this-node",)},
                       ["https://u:p@h/m/?sig=1", "hf://org/m@main"], node_from_nvml(snap, "n").nvlink_domains)
    assert facts.nvlink_domains == "0-7"
    assert facts.cached == "hf://org/m@main,https://h/m/"
    assert facts.gpu_health == GpuHealthFacts(
        quarantined=(QuarantinedGpu(index=3, uuid=uuid, mig=None, reason="xid: Xid 79: GPU has fallen off the bus "
                                    "(gpu_lost)", since_s=1_764_000_000.0, pods=("pod-a",)),),
        allocations={"pod-a": (2, 3), "pod-b": (0,), "pod-d": (1,)}, health_checks=True)


def test_a_quarantined_mig_instance_names_its_gpu_index_and_its_pods():
    snap = mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)], [("3g.40gb", 0), ("3g.40gb", 4)]])
    devices = [{**d, "mig_instances": [{"uuid": m["uuid"], "name": m["name"], "gpu_instance_id": m["gi_id"]}
                                       for m in d["mig_instances"]]}
               for d in snap["devices"]]   # as NvmlHealthReader.read gives them
    facts = node_facts(_status(("MIG-1-1", "xid: Xid 94")), devices,
                       {"pod-m": ("MIG-1-1",), "pod-n": ("MIG-1-0",), "pod-o": ("MIG-0-0",)}, [], ())
    [q] = facts.gpu_health.quarantined
    assert (q.index, q.uuid, q.mig, q.pods) == (1, snap["devices"][1]["uuid"], "MIG-1-1", ("pod-m",))
    assert q.profile == "3g.40gb"
    assert facts.gpu_health.allocations == {"pod-m": (1,), "pod-n": (1,), "pod-o": (0,)}
    assert facts.nvlink_domains == "none"
    # the whole GPU quarantined: every pod on one of its instances holds it
    facts = node_facts(_status((snap["devices"][1]["uuid"], "ecc")), devices,
                       {"pod-m": ("MIG-1-1",), "pod-n": ("MIG-1-0",), "pod-o": ("MIG-0-0",)}, [], ())
    assert facts.gpu_health.quarantined[0].pods == ("pod-m", "pod-n")


def test_the_gpu_health_annotation_round_trips_in_the_contract_shape():
    facts = GpuHealthFacts((QuarantinedGpu(index=3, uuid="GPU-3", mig=None, reason="xid: Xid 79",
                                           since_s=1_764_000_000.0, pods=("uid-1",)),), {"uid-1": (2, 3)}, True)
    doc = json.loads(gpu_health_value(facts))
    assert doc == {"quarantined": [{"index": 3, "uuid": "GPU-3", "mig": None, "reason": "xid: Xid 79",
                                    "sinceS": 1_764_000_000.0, "pods": ["uid-1"]}],
                   "allocations": {"uid-1": [2, 3]}, "healthChecks": True}
    assert parse_gpu_health(gpu_health_value(facts)) == facts


@pytest.mark.parametrize("value", ["{", "[]", '{"quarantined": [{"uuid": "GPU-1"}]}',
                                   '{"quarantined": [{"index": "3", "uuid": "x"}]}', '{"allocations": {"p": ["a"]}}'])
def test_a_bad_gpu_health_annotation_is_refused_naming_it(value):
    with pytest.raises(ValueError, match=GPU_HEALTH_ANNOTATION):
        parse_gpu_health(value)


def test_the_patch_writes_only_what_changed_and_leaves_unknown_facts_alone():
    health = GpuHealthFacts((), {}, True)
    first = NodeFacts("0-7", "hf://org/m@main", health)
    assert node_facts_patch(first) == {"metadata": {
        "labels": {NVLINK_DOMAINS_LABEL: "0-7"},
        "annotations": {CACHED_ANNOTATION: "hf://org/m@main", GPU_HEALTH_ANNOTATION: gpu_health_value(health)}}}
    assert node_facts_patch(first, first) is None
    assert node_facts_patch(NodeFacts("0-7", "", health), first) == {
        "metadata": {"annotations": {CACHED_ANNOTATION: None}}}       # nothing cached: removed
    assert node_facts_patch(NodeFacts(None, "", None)) == {"metadata": {"annotations": {CACHED_ANNOTATION: None}}}


def test_the_publisher_patches_the_node_once_per_change_and_inventory_reads_it():
    kube = FakeKube()
    kube.store.create(NODES, None, node("gpu-a", gpus=8, labels={NVLINK_DOMAINS_LABEL: "0-3"}))
    publisher = NodeFactsPublisher(kube, "gpu-a")
    snap = nvswitch_8gpu()
    facts = node_facts(_status(), snap["devices"], {}, ["hf://org/m@main"], node_from_nvml(snap, "n").nvlink_domains)
    assert publisher.publish_sync(facts) and not publisher.publish_sync(facts)
    assert kube.calls["patch"] == 1
    obj = kube.store.get(NODES, None, "gpu-a")
    assert obj["metadata"]["labels"][NVLINK_DOMAINS_LABEL] == "0-7"
    assert parse_gpu_health(obj["metadata"]["annotations"][GPU_HEALTH_ANNOTATION]) == facts.gpu_health
    inv = node_from_k8s(obj)
    assert inv.nvlink_domains == ((0, 1, 2, 3, 4, 5, 6, 7),) and "hf://org/m@main" in inv.cached
    uuid = snap["devices"][5]["uuid"]
    sick = node_facts(_status((uuid, "ecc")), snap["devices"], {}, ["hf://org/m@main"], ((0, 1, 2, 3, 4, 5, 6, 7),))
    assert publisher.publish_sync(sick) and kube.calls["patch"] == 2
    [q] = parse_gpu_health(kube.store.get(NODES, None, "gpu-a")["metadata"]["annotations"][GPU_HEALTH_ANNOTATION]).quarantined
    assert (q.index, q.uuid) == (5, uuid)


def test_cached_value_redacts_and_keeps_the_comma_rule():
    assert cached_value(["https://a:b@h/m/?t=1", "https://h/m/", "b"]) == "b,https://h/m/"
