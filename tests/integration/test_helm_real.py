"""Integration: the REAL ``helm`` (v4, .venv/bin/helm: .ci/helm.sh) installs, upgrades and
uninstalls today's chart on a REAL Kubernetes 1.20.2 control plane (fleet/testing/k8s/kube.py),
with live InferenceDeployments across the upgrade.

Real: Helm's client (chart checks against the cluster's version, its release records, the
three-way merge of an upgrade, the resource policy on uninstall) and every API answer and
controller behind it. Stand-ins: the nodes are HOLLOW (fleet/testing/k8s/hollow.py); no kubelet
runs, so pods stay Pending and ``--wait`` is never asked. The upgrade from the PREVIOUS chart
(0fbb307), which Helm refuses on 1.20 by its ``kubeVersion``, is in test_helm_upgrade_real.py.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from fleet.k8s.client import CRDS, INFERENCE_DEPLOYMENTS
from fleet.testing.k8s.hollow import HollowNodes
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.nodes import node
from tests.integration.test_helm_upgrade_real import LIVE
from tests.support.helm import CHART, helm_binary
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)   # the first test may build the control plane

RELEASE = NAMESPACE = "fleet"
CPU_NODE = "cpu-1"
CRD = "inferencedeployments.fleet.inference.dev"
NETWORK_POLICIES = ("networking.k8s.io/v1", "NetworkPolicy")


def _in_own_loop(coro):
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    if helm_binary() is None:
        pytest.skip("helm not installed: run `bash .ci/helm.sh`")
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(CPU_NODE,))


@pytest.fixture(scope="module")
def helm(control_plane: RealControlPlane) -> Iterator:
    """``helm(*args)``: the real helm against the control plane (its admin kubeconfig), the
    release's namespace; returns the CompletedProcess. A hollow CPU node is Ready meanwhile."""
    kubeconfig = control_plane.kubeconfig()

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([helm_binary(), *args, "--namespace", NAMESPACE, "--kubeconfig", str(kubeconfig)],
                              capture_output=True, text=True, timeout=180)  # fmt: skip

    with HollowNodes(control_plane, {CPU_NODE: node(CPU_NODE, cpu=16, labels={"kubernetes.io/os": "linux"})},
                     interval_s=5.0):  # fmt: skip
        yield run


async def _names(control_plane: RealControlPlane, api_version: str, kind: str) -> list[str]:
    kube = control_plane.client()
    try:
        res = control_plane.resource(api_version, kind)
        items, _ = await kube.list(res, NAMESPACE if res.namespaced else None)
        return sorted(i["metadata"]["name"] for i in items)
    finally:
        kube.close()


def test_install_upgrade_and_uninstall_with_live_inference_deployments(helm, control_plane: RealControlPlane):
    """``helm install`` (NetworkPolicies on), two InferenceDeployments created, ``helm upgrade``
    (NetworkPolicies off, another operator log level), ``helm uninstall``: each command succeeds;
    the upgrade deletes the NetworkPolicies and keeps both resources; the uninstall keeps the CRD
    (``helm.sh/resource-policy: keep``) and the resources, and nothing else of the release."""
    installed = helm("install", RELEASE, str(CHART), "--create-namespace", "--set", "networkPolicy.enabled=true")
    assert installed.returncode == 0, installed.stderr
    assert _in_own_loop(_names(control_plane, *NETWORK_POLICIES))   # rendered and created

    async def create_live() -> None:
        kube = control_plane.client()
        try:
            await async_wait_until(lambda: _established(kube), timeout_s=30, interval_s=0.2, what="the CRD Established")
            for doc in LIVE:
                await kube.create(INFERENCE_DEPLOYMENTS, NAMESPACE, doc)
        finally:
            kube.close()

    _in_own_loop(create_live())
    upgraded = helm("upgrade", RELEASE, str(CHART), "--set", "operator.logLevel=debug")
    assert upgraded.returncode == 0, upgraded.stderr
    history = helm("history", RELEASE, "-o", "yaml")
    assert history.returncode == 0 and history.stdout.count("revision:") == 2, history.stdout
    assert _in_own_loop(_names(control_plane, *NETWORK_POLICIES)) == []   # dropped by the new values
    live = _in_own_loop(_names(control_plane, "fleet.inference.dev/v1alpha1", "InferenceDeployment"))
    assert live == sorted(d["metadata"]["name"] for d in LIVE)

    gone = helm("uninstall", RELEASE)
    assert gone.returncode == 0 and CRD in gone.stdout, gone.stdout + gone.stderr   # "kept due to the resource policy"
    assert _in_own_loop(_names(control_plane, "apps/v1", "Deployment")) == []
    assert _in_own_loop(_names(control_plane, "apiextensions.k8s.io/v1", "CustomResourceDefinition")) == [CRD]
    assert _in_own_loop(_names(control_plane, "fleet.inference.dev/v1alpha1", "InferenceDeployment")) == live


async def _established(kube) -> bool:
    crd = await kube.get(CRDS, None, CRD)
    return any(c["type"] == "Established" and c["status"] == "True" for c in (crd.get("status") or {}).get("conditions") or [])


def test_helm_refuses_a_kubernetes_older_than_the_chart_states(helm):
    """Helm's own check of ``kubeVersion`` (charts/fleet/Chart.yaml: >=1.20) against the real
    server's /version passes on 1.20.2; a chart that asks for more is refused naming the range."""
    shown = helm("template", RELEASE, str(CHART), "--kube-version", "1.19.0")
    assert shown.returncode != 0 and "kubeVersion" in shown.stderr, shown.stderr
