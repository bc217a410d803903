"""The `fleet` command line: help texts and `validate` exit codes and messages (fleet.cli). The
liveness check `status`/`down` use, on a real child process, is in tests/integration/test_fleet_cli.py."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from fleet.cli import app

REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def test_validate_accepts_the_examples() -> None:
    # Their model paths are made by `fleet make-tiny-model` (quickstart) or live on the GPU nodes.
    examples = [str(REPO / "examples" / "quickstart.yaml"), str(REPO / "examples" / "gpu-tp2.yaml")]
    result = runner.invoke(app, ["validate", "--paths-on-nodes", *examples])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output and "tiny-chat" in result.output and "llama-8b-mig" in result.output
    assert "not checked (--paths-on-nodes)" in result.output


def test_validate_refuses_a_model_path_that_does_not_exist(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    f = tmp_path / "d.yaml"
    f.write_text("apiVersion: fleet.inference.dev/v1alpha1\nkind: InferenceDeployment\nmetadata: {name: x}\n"
                 f"spec: {{model: {{name: m, source: {missing}}}, resources: {{tensorParallelSize: 1}}}}\n")
    result = runner.invoke(app, ["validate", str(f)], terminal_width=250)
    assert result.exit_code == 2, result.output
    assert f"spec.model.source: '{missing}': no such directory" in result.output


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
