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


def replica(rid: str, status: str, port: int | None, deployment: str = "chat", revision: str = "v1") -> dict:
    return {"id": rid, "deployment": deployment, "revision": revision, "status": status,
            "endpoint": f"http://127.0.0.1:{port}" if port else None}  # fmt: skip


SNAPSHOT = {
    "deployments": {
        "chat": {"desired": 3, "min": 1, "max": 4, "model": "llama", "failures_in_row": 1, "failures_total": {"v1": 1}},
        "embed": {"desired": 1, "min": 1, "max": 1, "model": "e5", "failures_in_row": 0},
    },
    "replicas": [
        replica("chat-2", "READY", 9002, revision="v2"),
        replica("chat-0", "READY", 9000),
        replica("chat-1", "DRAINING", 9001),
        replica("chat-3", "STARTING", 9003, revision="v2"),
        replica("chat-4", "FAILED_START", 9004),
        replica("chat-5", "TERMINATED", 9005),
        replica("chat-6", "PENDING", None),
        replica("embed-0", "WARMING", 9100, deployment="embed"),
    ],
}


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (Debian package prometheus; .ci/prometheus.sh installs it)")


def test_promtool_accepts_the_scrape_config(tmp_path: Path) -> None:
    (tmp_path / "t.json").write_text(json.dumps(file_sd_groups(SNAPSHOT, "http://127.0.0.1:8080")))
    config = tmp_path / "prometheus.yml"
    config.write_text(prometheus_config(tmp_path / "t.json"))
    result = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
