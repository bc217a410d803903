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

tests/run.sh runs them on two pytest-xdist workers (`-n 2`). The tests that hold something of the
whole machine run one after another on one worker, in the order collected (`ONE_AT_A_TIME`, one
work unit of `OneAtATimeScheduling`): real vLLM, which takes a core for minutes, and the Kubernetes
layers that bind fixed addresses (127.0.x.y, 10.244.x.y), cgroups, iptables chains and the real
node's lock. Every other test runs beside them: each binds ports the kernel gives and keeps its
state in its own temporary directory.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Any

import pytest

from tests.support.guards import record_bound_ports

# Fixtures of the shared harness (tests/support/) that test files of several tiers use.
pytest_plugins = ["tests.support.weights"]

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "integration", "e2e")
ONE_AT_A_TIME = re.compile(r"^tests/e2e/|^tests/integration/([^/:]*_real[_.]|test_(cluster_box|box_|fleet_image"
                           r"|pod_resources_root_only|node_agent_facts|kv_events_vllm|vllm_engine_args|tokenize_vllm))")
"""Test ids (``tests/TIER/FILE::NAME``) that run one after another on one xdist worker: the e2e tier
and the integration files that hold the machine (the real Kubernetes layers: ``*_real*``)."""

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scheduler for tests/run.sh's workers: `OneAtATimeScheduling`. (xdist's own
    ``--dist loadgroup`` cannot be used: it renames items through ``Node._nodeid``, which pytest
    9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class OneAtATimeScheduling(LoadScopeScheduling):
        """Every test a work unit of its own, but the `ONE_AT_A_TIME` tests one unit together (the
        largest, so handed out first: xdist's ``--loadscope-reorder``)."""

        def _split_scope(self, nodeid: str) -> str:
            return "one-at-a-time" if ONE_AT_A_TIME.search(nodeid) else nodeid

    return OneAtATimeScheduling(config, log)
