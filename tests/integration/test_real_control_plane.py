"""Integration: Fleet's chart and the scheduler's GPU arithmetic on a REAL Kubernetes 1.20.2
control plane (fleet/testing/k8s/kube.py): etcd, ``kube-apiserver`` (RBAC and Node authorization,
a cluster's admission plugins, service-account tokens), ``kube-scheduler`` and
``kube-controller-manager``, built from Debian bookworm's source and run on 127.0.0.1.

Real here: every API answer (discovery, admission, defaulting, 403/404/422), the controllers
(Deployment -> ReplicaSet -> Pod, service accounts and their tokens, the node lifecycle taints)
and the scheduler's decisions. Stand-ins: the nodes are HOLLOW, Node objects the test registers
with each node's own identity (``system:node:NAME``) and keeps Ready with a status heartbeat,
with the ``nvidia.com/gpu`` capacity a device plugin would have the kubelet report
(fleet/testing/k8s/nodes.py); no kubelet runs, so a bound pod stays Pending (nothing starts it).

Skips, saying why, when the control plane cannot be built here (no apt, no root, Debian's source
unreachable) or cannot start. `tests/run.sh` builds it before the tiers (``python -m
fleet.testing.k8s.kube build``, bounded) and the build is cached; run alone, the first test
builds it (minutes). ``FLEET_KUBE=skip`` switches the layer off.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from fleet.k8s.client import CRDS, NODES, PODS, ApiError, KubeClient
from fleet.testing.k8s.hollow import HollowNodes
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.resources import DEPLOYMENTS, SERVICE_ACCOUNTS
from tests.support.helm import CHART, helm, helm_binary
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.waits import async_wait_until
from tests.unit.test_k8s_chart import VALUES

# The first test may build the control plane (minutes) when tests/run.sh has not.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)

KUBE_VERSION = "1.20.2"
CPU_NODE, GPU_NODE = "cpu-1", "gpu-1"
HEARTBEAT_S = 5.0   # a kubelet reports every 10 s; the test waits for one beat
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}   # as GPU node pools carry it


def _in_own_loop(coro):
    """Run ``coro`` on an event loop of its own (a module fixture may be asked from inside one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(CPU_NODE, GPU_NODE))


@pytest.fixture(scope="module")
def hollow_nodes(control_plane: RealControlPlane) -> Iterator[dict[str, dict]]:
    """A CPU node (16 cores) and a GPU node (8 GPUs, the GPU taint), each registered by itself
    (``system:node:NAME``: Node authorization and NodeRestriction admit it), kept Ready by a
    heartbeat, and schedulable: the node lifecycle controller has lifted the not-ready taint that
    admission put on them at registration."""
    wanted = {CPU_NODE: node(CPU_NODE, cpu=16, labels={"kubernetes.io/os": "linux"}),
              GPU_NODE: node(GPU_NODE, cpu=64, gpus=8, taints=[GPU_TAINT], labels={"kubernetes.io/os": "linux"})}

    async def schedulable() -> None:
        kube = control_plane.client()

        async def no_condition_taints() -> bool:
            nodes = [await kube.get(NODES, None, n) for n in wanted]
            return all(not [t for t in n["spec"].get("taints") or [] if t["key"].startswith("node.kubernetes.io/")]
                       for n in nodes)  # fmt: skip

        try:
            await async_wait_until(no_condition_taints, timeout_s=90, interval_s=0.5, explain=control_plane.explain,
                                   what="the node lifecycle controller to lift the not-ready taints")  # fmt: skip
        finally:
            kube.close()

    with HollowNodes(control_plane, wanted, interval_s=HEARTBEAT_S):
        _in_own_loop(schedulable())
        yield wanted


@pytest.fixture
async def kube(control_plane: RealControlPlane) -> AsyncIterator[KubeClient]:
    client = control_plane.client()
    yield client
    client.close()


async def _namespace(kube: KubeClient, plane: RealControlPlane, name: str) -> None:
    """Create namespace ``name`` and wait for its ``default`` ServiceAccount's token Secret (the
    ServiceAccount admission plugin refuses pods until the token controller has minted it)."""
    await kube.create(plane.resource("v1", "Namespace"), None, {"apiVersion": "v1", "kind": "Namespace",
                                                               "metadata": {"name": name}})  # fmt: skip

    async def token() -> bool:
        try:
            return bool((await kube.get(SERVICE_ACCOUNTS, name, "default")).get("secrets"))
        except ApiError:
            return False

    await async_wait_until(token, timeout_s=60, interval_s=0.2, explain=plane.explain,
                           what=f"the default ServiceAccount's token in {name}")  # fmt: skip


# ----- the API server ---------------------------------------------------------------------------


def test_version_is_kubernetes_1_20_2(control_plane):
    """Real: kube-apiserver's ``/version``, where Helm reads ``.Capabilities.KubeVersion`` (the
    build stamps it through hack/lib/version.sh's ldflags)."""
    version = control_plane.get_json("/version")
    assert (version["gitVersion"], version["major"], version["minor"]) == ("v1.20.2", "1", "20"), version


async def test_rbac_and_node_restriction_are_enforced(control_plane, hollow_nodes, kube):
    """Real: RBAC refuses an anonymous list (403); NodeRestriction refuses one node writing
    another's status; the same node may write its own. Stand-in: the nodes (hollow)."""
    anonymous = control_plane.client(None)
    as_cpu_node = control_plane.client(control_plane.tokens[f"system:node:{CPU_NODE}"])
    try:
        with pytest.raises(ApiError) as refused:
            await anonymous.list(PODS, "default")
        assert refused.value.status == 403
        with pytest.raises(ApiError) as refused:
            await as_cpu_node.patch_status(NODES, None, GPU_NODE, {"status": {"capacity": {"nvidia.com/gpu": "80"}}})
        assert refused.value.status == 403 and GPU_NODE in str(refused.value), refused.value
        await as_cpu_node.patch(NODES, None, CPU_NODE, {"metadata": {"annotations": {"fleet.test/own": "yes"}}})
    finally:
        anonymous.close()
        as_cpu_node.close()
    assert (await kube.get(NODES, None, GPU_NODE))["status"]["capacity"]["nvidia.com/gpu"] == "8"


async def test_hollow_nodes_stay_ready_by_their_heartbeat(control_plane, hollow_nodes, kube):
    """Real: the node lifecycle controller (it would mark a node without heartbeats NotReady and
    taint it); the nodes' status as the API server keeps it. Stand-in: the heartbeat (a
    kubelet's status loop, fleet/testing/k8s/hollow.py)."""

    async def ready(name: str) -> dict:
        node = await kube.get(NODES, None, name)
        return next(c for c in node["status"]["conditions"] if c["type"] == "Ready")

    first = {name: (await ready(name))["lastHeartbeatTime"] for name in hollow_nodes}
    for name in hollow_nodes:

        async def beaten(name: str = name) -> dict:
            condition = await ready(name)
            return condition if condition["lastHeartbeatTime"] != first[name] else {}

        condition = await async_wait_until(beaten, timeout_s=4 * HEARTBEAT_S, interval_s=0.5,
                                           what=f"a heartbeat of {name}", explain=control_plane.explain)  # fmt: skip
        assert condition["status"] == "True", condition
        assert not (await kube.get(NODES, None, name))["spec"].get("unschedulable")


# ----- the scheduler and GPUs -------------------------------------------------------------------


def _gpu_pod(name: str, gpus: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {
        "automountServiceAccountToken": False, "tolerations": [{**GPU_TAINT, "operator": "Equal"}],
        "containers": [{"name": "engine", "image": "registry.invalid/engine:1",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}  # fmt: skip


def _scheduled(pod: dict) -> dict:
    return next((c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), {})


async def test_the_real_scheduler_places_gpus_and_counts_what_is_held(control_plane, hollow_nodes, kube):
    """Real: the scheduler binds a pod asking ``nvidia.com/gpu: 2`` to the only node with GPUs,
    then refuses 7 (6 are left: what a bound pod holds is subtracted) and 9 (more than the node
    has), saying "Insufficient nvidia.com/gpu" in the pod's PodScheduled condition. Stand-ins:
    the nodes (hollow: their capacity is written as a device plugin would report it)."""
    ns = "gpu-placement"
    await _namespace(kube, control_plane, ns)
    await kube.create(PODS, ns, _gpu_pod("two", 2))

    async def bound() -> str | None:
        return (await kube.get(PODS, ns, "two"))["spec"].get("nodeName")

    assert await async_wait_until(bound, timeout_s=60, interval_s=0.2, explain=control_plane.explain,
                                  what="the scheduler to bind the 2-GPU pod") == GPU_NODE  # fmt: skip
    for name, gpus in (("seven", 7), ("nine", 9)):
        await kube.create(PODS, ns, _gpu_pod(name, gpus))
    for name in ("seven", "nine"):

        async def refused(name: str = name) -> dict:
            condition = _scheduled(await kube.get(PODS, ns, name))
            return condition if condition.get("status") == "False" else {}

        condition = await async_wait_until(refused, timeout_s=60, interval_s=0.2, explain=control_plane.explain,
                                           what=f"the scheduler to refuse pod {name}")  # fmt: skip
        assert condition["reason"] == "Unschedulable"
        assert "Insufficient nvidia.com/gpu" in condition["message"], condition
        assert not (await kube.get(PODS, ns, name))["spec"].get("nodeName")


# ----- the chart --------------------------------------------------------------------------------

# One release per example values file, each in its own namespace; the defaults with the node agent on.
RELEASES = {"fleet": (VALUES["defaults"], ("--set", "agent.enabled=true")),
            **{f"fleet-{name}": (files, ()) for name, files in VALUES.items() if name != "defaults"}}
ORDER = {"CustomResourceDefinition": 0, "Namespace": 0, "ServiceAccount": 1, "Secret": 1, "ConfigMap": 1,
         "ClusterRole": 2, "Role": 2, "ClusterRoleBinding": 3, "RoleBinding": 3}  # fmt: skip


def _render(release: str) -> list[dict]:
    """``helm template RELEASE charts/fleet -n RELEASE --kube-version 1.20.2`` with its values."""
    import yaml

    files, extra = RELEASES[release]
    args = ["template", release, str(CHART), "--namespace", release, "--kube-version", KUBE_VERSION]
    for f in files:
        args += ["-f", str(f)]
    return [d for d in yaml.safe_load_all(helm(*args, *extra).stdout) if d]


def _dropped(sent: object, kept: object, path: str = "") -> list[str]:
    """Paths of ``sent`` that the server did not keep (a field 1.20 does not know is dropped
    without a word: there is no strict field validation before 1.25). A zero value the server
    leaves out (``false``, ``0``, ``""``, empty: Go's ``omitempty``) is kept."""
    if isinstance(sent, dict):
        if not isinstance(kept, dict):
            return [path or "."]
        zero = (False, 0, "", [], {})
        return [d for k, v in sent.items() for d in ([f"{path}.{k}"] if k not in kept and v not in zero
                                                     else _dropped(v, kept.get(k), f"{path}.{k}"))]  # fmt: skip
    if isinstance(sent, list):
        if not isinstance(kept, list) or len(kept) != len(sent):
            return [path]
        return [d for i, v in enumerate(sent) for d in _dropped(v, kept[i], f"{path}[{i}]")]
    return []


@pytest.fixture(scope="module")
def installed(control_plane: RealControlPlane, hollow_nodes) -> dict[str, list[tuple[dict, dict | str]]]:
    """Every release of `RELEASES` rendered for 1.20.2 and each object created on the real API
    server, CRD first, as ``helm install`` does: release -> [(rendered, created object or the
    refusal)]. The CRD, shared by the releases, is created once."""
    if helm_binary() is None:
        pytest.skip("helm not installed: run `bash .ci/helm.sh`")

    async def install() -> dict[str, list[tuple[dict, dict | str]]]:
        kube = control_plane.client()
        out: dict[str, list[tuple[dict, dict | str]]] = {}
        try:
            for release in RELEASES:
                await _namespace(kube, control_plane, release)
                docs = sorted(_render(release), key=lambda d: ORDER.get(d["kind"], 5))
                out[release] = []
                for doc in docs:
                    if doc["kind"] == "CustomResourceDefinition" and release != "fleet":
                        continue
                    try:
                        res = control_plane.resource(doc["apiVersion"], doc["kind"])
                        created = await kube.create(res, release if res.namespaced else None, doc)
                    except (KeyError, ApiError) as err:
                        created = f"{type(err).__name__}: {err}"
                    out[release].append((doc, created))
        finally:
            kube.close()
        return out

    return _in_own_loop(install())


def test_every_object_the_chart_renders_for_1_20_is_accepted(installed, control_plane):
    """Real: the API server's discovery, admission and validation of every object ``helm
    template --kube-version 1.20.2`` renders (the router's PodDisruptionBudget as policy/v1beta1:
    1.20 has no policy/v1), the CRD Established with a structural schema, and no rendered field
    dropped as unknown to 1.20. Stand-in: ``helm install`` (the test creates what Helm renders)."""
    refused = [f"{release} {doc['kind']} {doc['metadata']['name']}: {created}"
               for release, objs in installed.items() for doc, created in objs if isinstance(created, str)]  # fmt: skip
    assert refused == []
    kinds = {(doc["apiVersion"], doc["kind"]) for objs in installed.values() for doc, _ in objs}
    assert ("policy/v1beta1", "PodDisruptionBudget") in kinds and ("apps/v1", "DaemonSet") in kinds, kinds
    # 1.20 knows no CEL rules in a CRD (beta in 1.25): it keeps the CRD and drops them, and the
    # operator reports those mistakes in status instead (docs/kubernetes.md, supported versions).
    def cel(doc: dict, path: str) -> bool:
        return doc["kind"] == "CustomResourceDefinition" and path.endswith("x-kubernetes-validations")

    dropped = [f"{release} {doc['kind']} {doc['metadata']['name']}: {path}" for release, objs in installed.items()
               for doc, created in objs for path in _dropped(doc, created) if not cel(doc, path)]  # fmt: skip
    assert dropped == [], "\n".join(dropped)
    crd = next(doc for doc, _ in installed["fleet"] if doc["kind"] == "CustomResourceDefinition")

    async def established() -> dict:
        kube = control_plane.client()
        try:
            got = await kube.get(CRDS, None, crd["metadata"]["name"])
        finally:
            kube.close()
        conditions = {c["type"]: c["status"] for c in (got.get("status") or {}).get("conditions") or []}
        return conditions if conditions.get("Established") == "True" else {}

    conditions = _in_own_loop(async_wait_until(established, timeout_s=30, interval_s=0.2, what="the CRD Established"))
    assert "NonStructuralSchema" not in conditions, conditions


async def test_the_controllers_and_scheduler_place_the_charts_deployments(installed, control_plane, kube):
    """Real: the controller-manager turns each release's Deployments (router, operator, picker) into a
    ReplicaSet and its Pods, and the scheduler binds every Pod to the CPU node (the GPU node's
    taint keeps them off it). Stand-ins: the nodes (hollow); no kubelet, so the Pods stay Pending."""
    deployments = {(release, doc["metadata"]["name"]): doc["spec"]["replicas"] for release, objs in installed.items()
                   for doc, _ in objs if doc["kind"] == "Deployment"}  # fmt: skip
    assert {name.rsplit("-", 1)[-1] for _, name in deployments} == {"router", "operator", "picker"}
    assert len(deployments) == 3 * len(RELEASES)

    async def placed() -> dict[tuple[str, str], list[str]]:
        out: dict[tuple[str, str], list[str]] = {}
        for release, name in deployments:
            dep = await kube.get(DEPLOYMENTS, release, name)
            selector = ",".join(f"{k}={v}" for k, v in dep["spec"]["selector"]["matchLabels"].items())
            pods, _ = await kube.list(PODS, release, label_selector=selector)
            out[(release, name)] = sorted(p["spec"].get("nodeName") or "" for p in pods)
        complete = all(nodes == [CPU_NODE] * deployments[key] for key, nodes in out.items())
        return out if complete else {}

    await async_wait_until(placed, timeout_s=120, interval_s=0.5, explain=control_plane.explain,
                           what="every Deployment's pods bound to the CPU node")  # fmt: skip
    for release, name in deployments:
        pods, _ = await kube.list(PODS, release, label_selector=f"app.kubernetes.io/instance={release}")
        for pod in [p for p in pods if p["metadata"]["name"].startswith(f"{name}-")]:
            owner = pod["metadata"]["ownerReferences"][0]
            assert owner["kind"] == "ReplicaSet" and owner["name"].startswith(f"{name}-"), owner
            assert pod["status"]["phase"] == "Pending" and _scheduled(pod)["status"] == "True", pod["status"]


# ----- the endpoint picker's Lease ----------------------------------------------------------------


async def test_the_picker_fails_over_on_a_real_lease_under_the_charts_role(control_plane, kube, tmp_path):
    """Real: kube-apiserver's Lease API (coordination.k8s.io/v1: resourceVersion conflicts, the
    Lease's times) and its RBAC, with the chart's picker ServiceAccount, Role and RoleBinding
    (router.picker.ha) and the token the token controller minted for it. Two `fleet endpoint-picker
    --lease` processes, a router's client under load, kill -9 then SIGTERM of the leader
    (tests/integration/test_picker_failover.py, where the Service is stood in for: no kube-proxy
    here): no pick fails. Stand-ins: the Service (a forwarder probing /ready), the engines' KV
    publishers (in this process)."""
    import base64
    import yaml

    from fleet.k8s.client import SECRETS
    from tests.integration.test_picker_failover import HA_VALUES, failover, kubeconfig_for

    ns = "pickers"
    await _namespace(kube, control_plane, ns)
    rendered = yaml.safe_load_all(helm("template", "fleet", str(CHART), "--namespace", ns, "--kube-version",
                                       KUBE_VERSION, *HA_VALUES).stdout)  # fmt: skip
    for doc in [d for d in rendered if d and d["kind"] in ("ServiceAccount", "Role", "RoleBinding")]:
        if doc["metadata"]["name"] == "fleet-picker":
            await kube.create(control_plane.resource(doc["apiVersion"], doc["kind"]), ns, doc)

    async def token() -> str | None:
        secrets = (await kube.get(SERVICE_ACCOUNTS, ns, "fleet-picker")).get("secrets") or []
        if not secrets:
            return None
        data = (await kube.get(SECRETS, ns, secrets[0]["name"])).get("data") or {}
        return base64.b64decode(data["token"]).decode() if "token" in data else None

    picker_token = await async_wait_until(token, timeout_s=60, interval_s=0.2, explain=control_plane.explain,
                                          what="the picker ServiceAccount's token")  # fmt: skip
    kubeconfig = kubeconfig_for(tmp_path / "picker.kubeconfig", control_plane.url, picker_token,
                                control_plane.ca_file)  # fmt: skip
    figures = await failover(tmp_path, kubeconfig, ns)
    lease = await kube.get(control_plane.resource("coordination.k8s.io/v1", "Lease"), ns, "fleet-picker")
    spec = lease["spec"]
    assert spec["holderIdentity"] == figures["leader"] and spec["leaseTransitions"] >= 2, spec
    assert figures["failed"] == 0
