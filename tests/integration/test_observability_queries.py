"""promtool checks the shipped rules files and runs the rules' unit tests
(tests/data/observability/fleet-rules.test.yaml); the lint itself is in
tests/unit/test_observability_queries.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from fleet.observability.rules import alerts, kubernetes_alerts, recording_rules
from tests.unit.test_observability_queries import CHART_RULES, DOCS, REPO  # the subject's helpers live in its unit file

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed (Debian package prometheus; .ci/prometheus.sh installs it)",
)


@needs_promtool
@pytest.mark.parametrize("path, extra", [(DOCS / "fleet-rules.yaml", 0), (CHART_RULES, len(kubernetes_alerts()))])
def test_promtool_checks_the_rules(path: Path, extra: int) -> None:
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts()) + len(recording_rules()) + extra} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass() -> None:
    result = subprocess.run(["promtool", "test", "rules", "tests/data/observability/fleet-rules.test.yaml"],
                            capture_output=True, text=True, cwd=REPO)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    tested = yaml.safe_load((REPO / "tests/data/observability/fleet-rules.test.yaml").read_text())
    alerted = {t["alertname"] for case in tested["tests"] for t in case.get("alert_rule_test", [])}
    assert alerted == {a.name for a in [*alerts(), *kubernetes_alerts()]}  # every alert has a unit test
