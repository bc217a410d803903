"""The real Kubernetes 1.20.2 control plane (fleet/testing/k8s/kube.py) as the integration tests
take it: started once per test module, or the module skipped saying why.

Owns `control_plane`, the body of the module fixtures of tests/integration/
test_real_control_plane.py and test_node_labels_real_apiserver.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleet.testing.k8s.kube import RealControlPlane, Unavailable, build, built


def control_plane(workdir: Path, nodes: tuple[str, ...] = ()) -> Iterator[RealControlPlane]:
    """Yield a started `RealControlPlane` (state under ``workdir``; ``nodes``: the hollow nodes it
    issues identities for) and stop it afterwards. Skips the test module when ``FLEET_KUBE=skip``,
    when tests/run.sh's build step said the layer is unavailable (``FLEET_KUBE_UNAVAILABLE``) and
    nothing is built, when the build fails here, or when the processes do not start; the skip
    says which, with the reason."""
    if os.environ.get("FLEET_KUBE") == "skip":
        pytest.skip("FLEET_KUBE=skip: the real control plane layer is switched off")
    if (said := os.environ.get("FLEET_KUBE_UNAVAILABLE")) and built() is None:
        pytest.skip(f"no real Kubernetes control plane here (tests/run.sh's build step: {said})")
    try:
        binaries = build()
    except Unavailable as err:
        pytest.skip(f"no real Kubernetes control plane here: {err}")
    try:
        plane = RealControlPlane(binaries, workdir, nodes=nodes).__enter__()
    except Unavailable as err:
        pytest.skip(f"the real Kubernetes control plane did not start: {err}")
    try:
        yield plane
    finally:
        plane.__exit__(None, None, None)
