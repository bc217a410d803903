"""Integration: the user's journey on the cluster in a box (fleet/testing/k8s/box.py), from
`helm install` of the chart AS RENDERED to uninstall with nothing left.

The box is a STAND-IN for a cluster (docs/kubernetes.md, "The cluster in a box"): an API server
stand-in enforcing the chart's RBAC per service account, a kubelet running every pod's
containers as local processes from the rendered spec (own mount namespace, the securityContext's
user, hostPath / emptyDir / Secret volumes, env from the downward API and Secrets, probes,
restart policy), a device plugin per GPU node and a fake NVML per node. Nodes: 8xH100 SXM
(NVSwitch), 4xH100 NVL in two NVLink pairs joined by PCIe, an H100 cut into two 3g.40gb MIG
instances, and a CPU node. Engines are the simulator; weights come from the local hub stand-in.

The journey (tests/support/journey.py, the same one the real control plane runs:
tests/integration/test_real_cluster_journey.py): install -> agents up, node facts published ->
TP=2 on NVLink pairs, MIG, TP=1 served through two router pods -> an Xid 79: quarantined, drained,
replaced, no request failed before streaming -> a canary promoted -> helm upgrade -> kill -9 of
the operator, an agent and a router pod -> delete and uninstall, nothing left.

Needs root (mount namespaces, running containers as their user) and Linux; skips otherwise.
"""

from __future__ import annotations

import os

import pytest

from tests.support.journey import IMAGE, users_journey

pytestmark = [pytest.mark.timeout(900)]


def _can_run_containers() -> str | None:
    if os.geteuid() != 0:
        return "the cluster in a box runs containers as their user in mount namespaces: needs root"
    import ctypes

    pid = os.fork()
    if pid == 0:   # probe unshare(CLONE_NEWNS) in a child, so this process keeps its namespace
        os._exit(0 if ctypes.CDLL("libc.so.6", use_errno=True).unshare(0x00020000) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return None if os.waitstatus_to_exitcode(status) == 0 else "unshare(CLONE_NEWNS) is not permitted here"


async def test_the_users_journey_on_the_cluster_in_a_box(tmp_path):
    why_not = _can_run_containers()
    if why_not:
        pytest.skip(why_not)
    from fleet.testing.k8s.box import ClusterInABox

    box = ClusterInABox(tmp_path / "box", image=IMAGE)
    await box.start()
    try:
        steps = await users_journey(box, tmp_path)
        assert steps[-1][0] == "deleted and uninstalled: nothing left", steps   # the journey ran to its end
    finally:
        await box.stop()
