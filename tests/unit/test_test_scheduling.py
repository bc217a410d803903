"""tests/run.sh's two xdist workers: every integration test file that holds something of the whole
machine (a real Kubernetes layer, the box's kubelet, real vLLM) is in the one-at-a-time unit
(tests/conftest.py `ONE_AT_A_TIME`), so that no two of them ever run at once, and the others are
not (they run beside it)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ONE_AT_A_TIME

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"
HOLDS_THE_MACHINE = re.compile(
    r"^\s*(from|import)\s+(tests\.support\.real_kube|fleet\.testing\.k8s\.(box|realbox|realnode|podrunner|images"
    r"|apiext)|vllm)\b|importorskip\(\"vllm\"", re.M)
"""What a test file imports when it runs the real control plane or node, the box's kubelet, Fleet's
image or real vLLM."""


def _nodeid(path: Path) -> str:
    return f"tests/integration/{path.name}::test"


def test_every_file_that_holds_the_machine_runs_one_at_a_time() -> None:
    holding = [p for p in sorted(INTEGRATION.glob("test_*.py")) if HOLDS_THE_MACHINE.search(p.read_text())]
    assert len(holding) >= 10, holding   # the pattern still finds them
    assert [p.name for p in holding if not ONE_AT_A_TIME.search(_nodeid(p))] == []


def test_the_e2e_tier_runs_one_at_a_time_and_the_rest_beside_it() -> None:
    assert ONE_AT_A_TIME.search("tests/e2e/test_fleet_up.py::test_quickstart")
    assert ONE_AT_A_TIME.search("tests/integration/test_real_node.py::test_x")
    assert ONE_AT_A_TIME.search("tests/integration/test_helm_real.py::test_x")
    for beside in ("tests/integration/test_rollout_sim.py::test_x", "tests/unit/test_real_node_unit.py::test_x",
                   "tests/integration/test_picker_failover.py::test_x"):
        assert not ONE_AT_A_TIME.search(beside), beside
