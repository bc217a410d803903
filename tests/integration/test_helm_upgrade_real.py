"""Integration: ``helm upgrade`` from the previous chart (the chart of commit 0fbb307) to today's,
with live InferenceDeployments, on a REAL Kubernetes 1.20.2 control plane
(fleet/testing/k8s/kube.py: etcd, kube-apiserver, kube-scheduler, kube-controller-manager).

The previous chart says ``kubeVersion: ">=1.30.0-0"``: Helm refuses to render or install it for
1.20 (`test_the_previous_chart_refuses_1_20_and_installs_what_1_20_serves` holds that), so no
release of it can exist on a 1.20 cluster. The test renders it for 1.30.0, the oldest it
accepts, and installs on 1.20 what 1.20 serves: everything but its ``policy/v1``
PodDisruptionBudget (1.20 serves policy/v1beta1 only). The upgrade keeps that manifest as the
release's, as Helm would, and today's chart, rendered for 1.20.2, creates the budget as
policy/v1beta1 (one object to Helm: group, kind and name match).

The previous release has the NetworkPolicies on (``networkPolicy.enabled=true``) and the upgrade
turns them off, so the upgrade also deletes objects the new render no longer has.

Real: every API answer (discovery, validation, defaulting, pruning of CRD-served objects by
their structural schema, the immutable fields an update must carry), the CRD's update in place, the
controllers (Deployment -> ReplicaSet on a new pod template, the DaemonSet controller, the
garbage collector after the uninstall). Stand-ins: ``helm install/upgrade/uninstall`` (the
test applies the rendered manifests as Helm's client-side apply does: tests/support/
helm_release.py), since the real Helm refuses the previous chart on 1.20 (the real Helm's install,
upgrade and uninstall of today's chart on the same control plane: test_helm_real.py); the nodes are HOLLOW (fleet/testing/k8s/hollow.py) and no kubelet runs, so
pods stay Pending and nothing serves.

Tests read the state one module fixture leaves after install and upgrade, in file order; the
last one uninstalls. Skips, saying why, where the control plane cannot be had
(tests/support/real_kube.py), helm is missing, or this checkout lacks commit 0fbb307 (a shallow
clone).
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from fleet.k8s.client import CRDS, INFERENCE_DEPLOYMENTS, KubeClient
from fleet.spec import parse_document
from fleet.testing.k8s.hollow import HollowNodes
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.resources import DAEMONSETS, by_kind
from tests.support.helm import CHART, REPO, helm_binary
from tests.support.helm_release import Applied, Release, key
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.waits import async_wait_until

# The first test may build the control plane (minutes) when tests/run.sh has not.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)

PREVIOUS = "0fbb307"   # the chart's previous release
RELEASE = NAMESPACE = "fleet"
SELECTOR = f"app.kubernetes.io/instance={RELEASE}"   # on every object the chart renders
KUBE_VERSION = "1.20.2"
CPU_NODE, GPU_NODE = "cpu-1", "gpu-1"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
REPLICA_SETS = by_kind("apps/v1", "ReplicaSet")

# Two live InferenceDeployments, valid under both charts' schemas: the simulator on CPU, and a MIG
# deployment with the fields today's CRD checks across fields (CEL from 1.25: replicas
# min/initial/max, queue time under p99 TTFT, interval within the window, TP 1 on a MIG slice,
# canary steps starting with a weight, one stickiness key).
LIVE = tuple(yaml.safe_load_all("""
apiVersion: fleet.inference.dev/v1alpha1
kind: InferenceDeployment
metadata: {name: sim-chat}
spec:
  model: {name: llama-8b-sim, source: "sim://h100-llama-8b", revision: v1}
  engine: {kind: sim, args: ["--seed", "1"], startupTimeoutSeconds: 120}
  resources: {accelerator: cpu, cpuCores: 1}
  replicas: {min: 4, max: 4}
  routing: {policy: latency-aware}
  warmup:
    requests: [{kind: completion, prompt: "Hello.", maxTokens: 16}]
---
apiVersion: fleet.inference.dev/v1alpha1
kind: InferenceDeployment
metadata: {name: qwen-canary}
spec:
  model: {name: Qwen/Qwen2.5-1.5B-Instruct, source: "hf://Qwen/Qwen2.5-1.5B-Instruct"}
  engine: {kind: vllm, image: "vllm/vllm-openai:v0.11.0", args: ["--max-model-len", "4096"]}
  resources: {accelerator: gpu, migProfile: 3g.40gb, tensorParallelSize: 1}
  replicas: {min: 2, max: 6, initial: 3}
  autoscaling: {policy: fleet, queueTimeTargetSeconds: 0.5, ttftP99TargetSeconds: 2.0, intervalSeconds: 10,
                windowSeconds: 60}
  rollout:
    strategy: canary
    steps: [{weight: 10}, {analysis: {}}, {pauseSeconds: 60}]
    analysis:
      metrics: [{metric: ttftP99, maxRatioToStable: 1.2}, {metric: errorRate, max: 0.01}]
    stickiness: {header: x-session-id}
"""))


def _in_own_loop(coro):
    """Run ``coro`` on an event loop of its own (a module fixture may be asked from inside one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def _helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=120)


def _template(chart: Path, kube_version: str, *values: str) -> list[dict]:
    """``helm template fleet CHART -n fleet --kube-version V --set ...``; raises AssertionError
    with Helm's words when it refuses."""
    proc = _helm("template", RELEASE, str(chart), "--namespace", NAMESPACE, "--kube-version", kube_version,
                 *(a for v in values for a in ("--set", v)))  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def _missing(sent: object, kept: object, path: str = "") -> list[str]:
    """Paths of ``sent`` that ``kept`` lacks or holds otherwise (a zero value the server leaves
    out, Go's ``omitempty``, counts as kept)."""
    if isinstance(sent, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        zero = (False, 0, "", [], {})
        return [m for k, v in sent.items() if k in kept or v not in zero
                for m in ([f"{path}.{k}"] if k not in kept else _missing(v, kept[k], f"{path}.{k}"))]  # fmt: skip
    if isinstance(sent, list):
        if not isinstance(kept, list) or len(kept) != len(sent):
            return [path]
        return [m for i, v in enumerate(sent) for m in _missing(v, kept[i], f"{path}[{i}]")]
    return [] if sent == kept or str(sent) == str(kept) else [f"{path}: {sent!r} != {kept!r}"]


@pytest.fixture(scope="module")
def previous_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """charts/fleet as of `PREVIOUS`, from this checkout's history."""
    if helm_binary() is None:
        pytest.skip("helm not installed: run `bash .ci/helm.sh`")
    out = tmp_path_factory.mktemp("previous")
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS, "charts/fleet"], capture_output=True)
    if archive.returncode != 0:
        pytest.skip(f"commit {PREVIOUS} (the previous chart) is not in this checkout: {archive.stderr.decode()[:200]}")
    subprocess.run(["tar", "x", "-C", str(out)], input=archive.stdout, check=True)
    return out / "charts" / "fleet"


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(CPU_NODE, GPU_NODE))


async def _snapshot(kube: KubeClient) -> dict:
    """As read now: the CRD, the live InferenceDeployments by name, and each owner's ReplicaSets
    (owner name -> ReplicaSet name -> ReplicaSet)."""
    crd = await kube.get(CRDS, None, "inferencedeployments.fleet.inference.dev")
    live = {}
    for doc in LIVE:
        live[doc["metadata"]["name"]] = await kube.get(INFERENCE_DEPLOYMENTS, NAMESPACE, doc["metadata"]["name"])
    sets, _ = await kube.list(REPLICA_SETS, NAMESPACE)
    owned = {}
    for rs in sets:
        for owner in rs["metadata"].get("ownerReferences") or []:
            owned.setdefault(owner["name"], {})[rs["metadata"]["name"]] = rs
    return {"crd": crd, "live": live, "replica_sets": owned}


@pytest.fixture(scope="module")
def upgraded(control_plane: RealControlPlane, previous_chart: Path) -> Iterator[dict]:
    """The previous chart installed (what 1.20 serves of its 1.30 render, NetworkPolicies on),
    the two live InferenceDeployments created and their Deployments' first ReplicaSets made, then
    the upgrade to today's chart (rendered for 1.20.2, NetworkPolicies off). Yields the renders,
    what install and upgrade did (`Applied`), and `_snapshot` before and after the upgrade."""
    old = _template(previous_chart, "1.30.0", "networkPolicy.enabled=true")
    new = _template(CHART, KUBE_VERSION)
    wanted = {CPU_NODE: node(CPU_NODE, cpu=16, labels={"kubernetes.io/os": "linux"}),
              GPU_NODE: node(GPU_NODE, cpu=64, gpus=8, taints=[GPU_TAINT], labels={"kubernetes.io/os": "linux"})}

    async def run() -> dict:
        kube = control_plane.client()
        release = Release(kube, control_plane.resource, RELEASE, NAMESPACE)
        try:
            await kube.create(control_plane.resource("v1", "Namespace"), None,
                              {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})  # fmt: skip
            installed = await release.install(old)
            await _established(kube)
            for doc in LIVE:
                await kube.create(INFERENCE_DEPLOYMENTS, NAMESPACE, doc)
            before = await async_wait_until(lambda: _rolled_out(kube, old), timeout_s=60, interval_s=0.3,
                                            explain=control_plane.explain, what="each Deployment's ReplicaSet")  # fmt: skip
            upgrade = await release.upgrade(old, new)
            after = await _snapshot(kube)
            return {"old": old, "new": new, "installed": installed, "upgrade": upgrade, "before": before,
                    "after": after}  # fmt: skip
        finally:
            kube.close()

    with HollowNodes(control_plane, wanted, interval_s=5.0):
        yield _in_own_loop(run())


async def _established(kube: KubeClient) -> None:
    async def established() -> bool:
        crd = await kube.get(CRDS, None, "inferencedeployments.fleet.inference.dev")
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    await async_wait_until(established, timeout_s=30, interval_s=0.2, what="the CRD Established")


async def _rolled_out(kube: KubeClient, docs: list[dict]) -> dict:
    """`_snapshot` once each Deployment of ``docs`` has a ReplicaSet, else {}."""
    snap = await _snapshot(kube)
    names = [d["metadata"]["name"] for d in docs if d["kind"] == "Deployment"]
    return snap if all(snap["replica_sets"].get(n) for n in names) else {}


CLUSTER_KINDS = ("CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding")


def _key(doc: dict) -> tuple:
    """`key` of a rendered object of this release (cluster-scoped kinds have no namespace)."""
    return key(doc, None if doc["kind"] in CLUSTER_KINDS else NAMESPACE)


def _keys(docs: list[dict], kind: str) -> set[tuple]:
    return {_key(d) for d in docs if d["kind"] == kind}


# ----- install and upgrade ----------------------------------------------------------------------


def test_the_previous_chart_refuses_1_20_and_installs_what_1_20_serves(previous_chart, upgraded):
    """Real: discovery (1.20 serves no policy/v1). Helm: the previous chart refuses
    ``--kube-version 1.20.2`` by its Chart.yaml; rendered for 1.30 all but its policy/v1
    PodDisruptionBudget is created on 1.20."""
    refused = _helm("template", RELEASE, str(previous_chart), "--kube-version", KUBE_VERSION)
    assert refused.returncode != 0 and "kubeVersion: >=1.30.0-0" in refused.stderr, refused.stderr
    installed: Applied = upgraded["installed"]
    assert [(k[1], k[3]) for k in installed.skipped] == [("PodDisruptionBudget", "fleet-router")], installed.skipped
    assert len(installed.created) == len(upgraded["old"]) - 1


def test_every_object_of_the_new_render_is_accepted_and_dropped_ones_deleted(upgraded, control_plane):
    """Real: the API server takes every write of the upgrade (an error would have raised in the
    fixture) and keeps each object as today's chart renders it. The upgrade creates what is new
    (the node agent's DaemonSet, ServiceAccount and RBAC; the endpoint picker's Deployment and
    Service; the router pods' ServiceAccount, Role and RoleBinding for the picker Service's
    Endpoints; the policy/v1beta1 budget), deletes the two NetworkPolicies the new values dropped
    and the router pods' headless Service the previous chart had (the picker replaces it), and
    leaves no other object of the release."""
    up: Applied = upgraded["upgrade"]
    new, old = upgraded["new"], upgraded["old"]
    gone = _keys(old, "NetworkPolicy") | {("", "Service", NAMESPACE, "fleet-router-peers")}
    assert set(up.deleted) == gone and len(up.deleted) == 3, up.deleted
    previous = {_key(d) for d in old}
    assert set(up.created) == {_key(d) for d in new if _key(d) not in previous} | _keys(new, "PodDisruptionBudget")
    assert {k[1] for k in up.created} == {"DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                          "Role", "RoleBinding", "PodDisruptionBudget", "Deployment",
                                          "Service"}, up.created  # fmt: skip
    assert {k[3] for k in up.created if k[1] in ("Deployment", "Service")} == {"fleet-picker"}, up.created
    assert up.kept == [] and up.skipped == {}

    async def check() -> list[str]:
        kube = control_plane.client()
        try:
            wrong = []
            for doc in new:
                res = control_plane.resource(doc["apiVersion"], doc["kind"])
                live = await kube.get(res, NAMESPACE if res.namespaced else None, doc["metadata"]["name"])
                wrong += [f"{doc['kind']} {doc['metadata']['name']}: {m}" for m in _missing(doc, live)]
            left = []
            for kind in {(d["apiVersion"], d["kind"]) for d in old + new}:
                try:
                    res = control_plane.resource(*kind)
                except KeyError:
                    continue
                items, _ = await kube.list(res, NAMESPACE if res.namespaced else None, label_selector=SELECTOR)
                left += [key(i, NAMESPACE if res.namespaced else None) for i in items]
            stray = set(left) - {_key(d) for d in new}
            return wrong + [f"left behind: {s}" for s in sorted(stray, key=str)]
        finally:
            kube.close()

    assert _in_own_loop(check()) == []


def test_the_crd_is_updated_in_place_to_the_new_schema(upgraded):
    """Real: the CRD's update (same uid, ``metadata.generation`` moved) to the schema today's
    chart renders for 1.20 (the copy without CEL: fleet/k8s/crd.py), accepted as structural."""
    before, after = upgraded["before"]["crd"], upgraded["after"]["crd"]
    rendered = next(d for d in upgraded["new"] if d["kind"] == "CustomResourceDefinition")
    assert after["metadata"]["uid"] == before["metadata"]["uid"]
    assert after["metadata"]["generation"] > before["metadata"]["generation"], (before["metadata"], after["metadata"])
    assert before["spec"]["versions"] != after["spec"]["versions"]
    assert _missing(rendered["spec"]["versions"], after["spec"]["versions"]) == []
    conditions = {c["type"]: c["status"] for c in after["status"]["conditions"]}
    assert conditions.get("Established") == "True" and "NonStructuralSchema" not in conditions, conditions
    assert after["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_live_inference_deployments_keep_their_spec(upgraded, control_plane):
    """Real: the InferenceDeployments as the API server serves them after the schema changed
    (pruned and defaulted by the new structural schema): the same objects, every field of their
    spec as before, and each still valid by `fleet validate`'s rules (fleet/spec.py)."""
    for doc in LIVE:
        name = doc["metadata"]["name"]
        before, after = upgraded["before"]["live"][name], upgraded["after"]["live"][name]
        assert after["metadata"]["uid"] == before["metadata"]["uid"]
        assert _missing(doc["spec"], after["spec"]) == [], name
        assert _missing(before["spec"], after["spec"]) == [], name
        parse_document({"apiVersion": after["apiVersion"], "kind": after["kind"], "metadata": {"name": name},
                        "spec": after["spec"]})  # fmt: skip


async def test_deployments_roll_where_the_pod_template_changed(upgraded, control_plane):
    """Real: the controller-manager makes a new ReplicaSet for each Deployment whose pod template
    the new chart changed (the operator: its engine settings carry the GPU toleration; the
    router: its own ServiceAccount and --picker-endpoints) and none for one it did not change, and
    the first of the endpoint picker's, new in this chart; the DaemonSet controller wants the agent on the one
    GPU node (GPU Feature Discovery's label) and not on the CPU node. Stand-in: the nodes."""
    old = {d["metadata"]["name"]: d for d in upgraded["old"] if d["kind"] == "Deployment"}
    new = {d["metadata"]["name"]: d for d in upgraded["new"] if d["kind"] == "Deployment"}
    assert set(new) - set(old) == {"fleet-picker"}, sorted(new)
    changed = {n for n in new if n not in old or _missing(new[n]["spec"]["template"], old[n]["spec"]["template"])}
    assert changed == {"fleet-operator", "fleet-router", "fleet-picker"}, changed
    kube = control_plane.client()
    try:
        async def rolled() -> dict:
            snap = (await _snapshot(kube))["replica_sets"]
            first = upgraded["before"]["replica_sets"]
            fresh = {n: [rs for name, rs in snap.get(n, {}).items() if name not in first.get(n, {})] for n in new}
            return fresh if all(bool(fresh[n]) == (n in changed) for n in new) else {}

        fresh = await async_wait_until(rolled, timeout_s=60, interval_s=0.3, explain=control_plane.explain,
                                       what="a new ReplicaSet for each changed pod template")  # fmt: skip
        for name in changed:
            (rs,) = fresh[name]
            assert _missing(new[name]["spec"]["template"]["spec"], rs["spec"]["template"]["spec"]) == []

        async def agent_wanted() -> int:
            ds = await kube.get(DAEMONSETS, NAMESPACE, "fleet-agent")
            return (ds.get("status") or {}).get("desiredNumberScheduled", 0)

        assert await async_wait_until(agent_wanted, timeout_s=90, interval_s=0.5, explain=control_plane.explain,
                                      what="the DaemonSet controller to want the agent on the GPU node") == 1
    finally:
        kube.close()


# ----- uninstall (last: it removes the release) -------------------------------------------------


async def test_uninstall_leaves_only_the_crd_and_the_inference_deployments(upgraded, control_plane):
    """Real: deletion of every object of the new render but the CRD (``helm.sh/resource-policy:
    keep``), and the garbage collector removing the Deployments' ReplicaSets. The CRD and both
    InferenceDeployments stay, readable. Stand-in: ``helm uninstall``."""
    kube = control_plane.client()
    release = Release(kube, control_plane.resource, RELEASE, NAMESPACE)
    try:
        sets, _ = await kube.list(REPLICA_SETS, NAMESPACE, label_selector=SELECTOR)
        assert len(sets) >= 4, [s["metadata"]["name"] for s in sets]   # the router's, the operator's two, the picker's
        gone = await release.uninstall(upgraded["new"])
        assert [k[1] for k in gone.kept] == ["CustomResourceDefinition"]
        assert len(gone.deleted) == len(upgraded["new"]) - 1

        async def left() -> list[tuple]:
            out = []
            kinds = {(d["apiVersion"], d["kind"]) for d in upgraded["new"]} | {("apps/v1", "ReplicaSet")}
            for api_version, kind in kinds:
                res = control_plane.resource(api_version, kind)
                items, _ = await kube.list(res, NAMESPACE if res.namespaced else None, label_selector=SELECTOR)
                out += [(kind, i["metadata"]["name"]) for i in items]
            return out

        remaining = await async_wait_until(lambda: _only_crd(left()), timeout_s=60, interval_s=0.5,
                                           explain=control_plane.explain, what="the release's objects gone")  # fmt: skip
        assert remaining == [("CustomResourceDefinition", "inferencedeployments.fleet.inference.dev")]
        live, _ = await kube.list(INFERENCE_DEPLOYMENTS, NAMESPACE)
        assert sorted(i["metadata"]["name"] for i in live) == sorted(d["metadata"]["name"] for d in LIVE)
        for item in live:
            assert _missing(upgraded["after"]["live"][item["metadata"]["name"]]["spec"], item["spec"]) == []
    finally:
        kube.close()


async def _only_crd(listing) -> list[tuple]:
    out = await listing
    return out if all(kind == "CustomResourceDefinition" for kind, _ in out) else []
