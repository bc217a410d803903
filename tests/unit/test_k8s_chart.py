"""The Helm chart's example values files (examples/kubernetes), read without Helm. Everything that
renders the chart with `helm` is in tests/integration/test_k8s_chart.py."""

from __future__ import annotations

from pathlib import Path

import yaml

from tests.support.helm import REPO


EXAMPLES = REPO / "examples" / "kubernetes"
VALUES = {
    "defaults": [],
    "ha": [EXAMPLES / "values-ha.yaml"],
    "monitoring": [EXAMPLES / "values-monitoring.yaml"],
    "gpu-mig": [EXAMPLES / "values-gpu-mig.yaml"],
}


def test_example_values_files_are_valid_yaml_mappings():
    for files in VALUES.values():
        for f in files:
            assert isinstance(yaml.safe_load(Path(f).read_text()), dict)
