"""Helm for the chart tests: found beside the test interpreter (`.ci/helm.sh` puts it in
.venv/bin) or on PATH. No cluster: `helm lint` and `helm template` only."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "fleet"


def helm_binary() -> str | None:
    beside = Path(sys.executable).parent / "helm"
    return str(beside) if beside.exists() else shutil.which("helm")


def helm(*args: str) -> subprocess.CompletedProcess:
    """Run helm with ``args``; raises AssertionError with its output when it fails."""
    binary = helm_binary()
    assert binary, "helm not found: run `bash .ci/helm.sh` (tests/run.sh does)"
    proc = subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def render(values: list[Path] | None = None, kube_version: str = "1.30.0", api_versions: tuple[str, ...] = (),
           extra: tuple[str, ...] = ()) -> list[dict]:  # fmt: skip
    """`helm template fleet charts/fleet -n fleet` -> the rendered objects."""
    args = ["template", "fleet", str(CHART), "--namespace", "fleet", "--kube-version", kube_version]
    for v in values or []:
        args += ["-f", str(v)]
    for a in api_versions:
        args += ["--api-versions", a]
    return [d for d in yaml.safe_load_all(helm(*args, *extra).stdout) if d]


def render_text(values: list[Path] | None = None, kube_version: str = "1.30.0") -> str:
    args = ["template", "fleet", str(CHART), "--namespace", "fleet", "--kube-version", kube_version]
    for v in values or []:
        args += ["-f", str(v)]
    return helm(*args).stdout
