"""The `fleet` command line: help texts, `validate` exit codes and messages, and the liveness
check `status`/`down` use (fleet.cli)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from typer.testing import CliRunner

from fleet.cli import app
from fleet.cli.local import _pid_alive

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_pid_alive_treats_a_zombie_as_gone() -> None:
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _pid_alive(proc.pid):
        time.sleep(0.05)  # `true` exits at once and stays a zombie until wait()
    assert not _pid_alive(proc.pid)
    assert proc.poll() == 0   # it really was a zombie we had not reaped
    assert _pid_alive(os.getpid())


def test_validate_accepts_the_examples() -> None:
    result = runner.invoke(app, ["validate", str(REPO / "examples" / "quickstart.yaml"),
                                 str(REPO / "examples" / "gpu-tp2.yaml")])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output and "tiny-chat" in result.output and "llama-8b-mig" in result.output


def test_validate_names_the_field_and_exits_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "apiVersion: fleet.inference.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: x}\n"
        "spec:\n  model: {name: m, source: /m}\n  replicas: {min: 3, max: 2}\n"
    )
    result = runner.invoke(app, ["validate", str(bad)])
    assert result.exit_code == 2
    assert "spec.replicas.min: must be <= spec.replicas.max (3 > 2)" in result.output


def test_up_refuses_an_invalid_spec_and_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: fleet.inference.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: x}\n"
                   "spec: {model: {name: m, source: /m}, routing: {policy: fastest}}\n")
    result = runner.invoke(app, ["up", str(bad), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 2
    assert "spec.routing.policy: unknown routing policy 'fastest'" in result.output
    assert not (tmp_path / "state").exists()


def test_status_without_state_says_so(tmp_path: Path) -> None:
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 1
    assert "`fleet up` has not run there" in result.output


def test_every_command_explains_itself() -> None:
    for command in ("up", "status", "down", "validate", "router", "make-tiny-model"):
        result = runner.invoke(app, [command, "--help"])
        assert result.exit_code == 0, (command, result.output)
        assert len(result.output.split()) > 20, (command, result.output)
