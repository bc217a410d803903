"""promtool accepts the scrape config `fleet prometheus-config` writes
(fleet/observability/scrape.py); the rest of discovery is in tests/unit/test_observability_discovery.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from fleet.observability.discovery import (
    file_sd_groups,
)
from fleet.observability.scrape import prometheus_config
from tests.unit.test_observability_discovery import SNAPSHOT  # the subject's helpers live in its unit file


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package prometheus; .ci/prometheus.sh installs it)")


def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080")))
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_config(tmp_path / "t.json"))
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
