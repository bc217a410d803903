"""The three tiers (`./tests/run.sh` runs them in this order):

* tests/unit: in-process only. No process, no socket but to the test's own loopback fixtures, no
  real Kubernetes client: the guards of tests/support/guards.py fail a test that tries
  (tests/unit/conftest.py switches them on). Seconds to run.
* tests/integration: real processes on loopback: `fleet up` and the router over the engine
  SIMULATOR, the API-server stand-in (fleet/testing/k8s), the hub stand-in, Prometheus and
  promtool, helm. No real vLLM.
* tests/e2e: real vLLM (CPU build) only.

Every test gets the marker of its tier (`pytest -m unit`, `-m "not e2e"`); the shared harness
lives in tests/support/.
"""

from __future__ import annotations

from pathlib import Path

import platform

import pytest

from tests.support.guards import record_bound_ports

# Fixtures of the shared harness (tests/support/) that test files of several tiers use.
pytest_plugins = ["tests.support.weights"]

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")

# Remember every port a socket of this process binds, from the start: a unit test may connect to
# its own in-process servers (tests/support/guards.py).
record_bound_ports()
# `platform.processor()` runs `uname -p` once and caches it; HTTP clients (openai's user agent) ask
# for it. Ask here, before any unit test's process guard is on.
platform.processor()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            tier = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))
        if tier == "e2e":
            item.add_marker(pytest.mark.timeout(900))


@pytest.fixture
def vllm_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM counts as installed: the engine's preflight passes (controller tests on fake backends)."""
    from fleet.engines.kinds import VllmEngine

    monkeypatch.setattr(VllmEngine, "preflight", lambda self: None)
