"""The Helm chart read without Helm: its example values files (examples/kubernetes) and its
templates' text. Everything that renders the chart with `helm` is in
tests/integration/test_k8s_chart.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.support.helm import CHART, REPO


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


def test_no_template_renders_randomness_or_reads_the_cluster():
    """`helm template` (GitOps) must give the same manifests every time: no random values, no
    time, no `lookup` (which answers nothing outside `helm install`). The admin token Secret is
    the operator's to make (fleet/k8s/admin_token.py)."""
    banned = re.compile(r"\b(rand\w*|uuidv4|now|lookup|genPrivateKey|genCA|genSelfSignedCert\w*|genSignedCert\w*)\b")
    comment = re.compile(r"{{-?\s*/\*.*?\*/\s*-?}}", re.S)
    for template in sorted((CHART / "templates").glob("*")):
        for action in re.findall(r"{{(.*?)}}", comment.sub("", template.read_text()), re.S):
            assert not banned.search(action), f"{template.name}: {{{{{action.strip()}}}}}"
