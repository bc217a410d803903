"""Integration: the user's journey (tests/support/journey.py) on a REAL Kubernetes 1.20.2 control
plane (fleet/testing/k8s/kube.py), the chart installed, upgraded and uninstalled by the real
``helm``, and every pod run by hollow nodes' process kubelet (fleet/testing/k8s/realbox.py).

Real: the API server (admission, RBAC and Node authorization of every request each component and
each node makes), the scheduler, the controller-manager (Deployments, ReplicaSets, DaemonSets,
endpoints, garbage collection, service-account tokens), etcd, helm. Stand-ins, each saying so in
its module: the kubelet and its containers (local processes), the device plugins and NVML of the
GPU nodes, the engines (the simulator), the model hub; no kube-proxy and no cluster DNS.

Needs root (mount namespaces, containers run as their user, the pod network bound on ``lo``),
Linux, helm (`bash .ci/helm.sh`) and the built control plane (tests/run.sh builds it); skips
saying which is missing.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.realbox import RealClusterInABox
from tests.integration.test_cluster_box import _can_run_containers
from tests.support.helm import helm_binary
from tests.support.journey import IMAGE, users_journey
from tests.support.real_kube import control_plane as start_control_plane

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)   # the first test may build the control plane


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    why_not = _can_run_containers()
    if why_not:
        pytest.skip(why_not)
    if helm_binary() is None:
        pytest.skip("helm not installed: run `bash .ci/helm.sh`")
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=RealClusterInABox.NODE_NAMES)


async def test_the_users_journey_on_a_real_control_plane(control_plane: RealControlPlane, tmp_path):
    box = RealClusterInABox(control_plane, tmp_path / "box", helm_binary(), image=IMAGE)
    await box.start()
    try:
        steps = await users_journey(box, tmp_path)
        assert steps[-1][0] == "deleted and uninstalled: nothing left", steps   # the journey ran to its end
    finally:
        await box.stop()
