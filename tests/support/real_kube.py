"""The real Kubernetes 1.20.2 control plane (fleet/testing/k8s/kube.py) as the integration tests
take it: started once per test module, or the module skipped saying why.

Owns `control_plane`, the body of the module fixtures of the tests on the real control plane
(tests/integration/*_real*.py), and `real_node`, a real kubelet node joined to it
(fleet/testing/k8s/realnode.py) or the module skipped saying why.
"""

from __future__ import annotations

import contextlib
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


@contextlib.contextmanager
def real_node(plane: RealControlPlane, name: str, workdir: Path, **options) -> Iterator:
    """A started `fleet.testing.k8s.realnode.RealNode` called ``name`` (a node ``plane`` issued an
    identity for) with its state under ``workdir`` (``options``: `RealNode`'s, e.g. ``nvml_state``),
    stopped afterwards (the machine left as it was); skips the test module with the reason when the
    node cannot run here."""
    from fleet.testing.k8s.realnode import RealNode

    node = RealNode(plane, name, workdir, **options)
    try:
        node.__enter__()
    except Unavailable as err:
        pytest.skip(f"no real node here: {err}")
    try:
        yield node
    finally:
        node.__exit__(None, None, None)
