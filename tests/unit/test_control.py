"""The control channel of a running `fleet up` (fleet.local.control): `fleet apply` and `fleet rollout`
requests written to the state directory, handled by the controller, answered; invalid or unknown
deployments change nothing; nobody listening is an error, and the request is withdrawn."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleet.cli import app
from fleet.local.control import ControlError, ControlServer, apply_request, control_dir, rollout_request, submit
from fleet.spec import load_deployments
from tests.unit.test_controller_rollout import Fleet, write

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


def serve_while_waiting(server: ControlServer):
    """`submit`'s sleep: the running fleet up takes the request meanwhile."""
    return lambda seconds: server.handle_pending()


async def test_apply_and_rollout_requests_reach_the_controller_and_are_answered(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    state = tmp_path / "state"
    lines: list[str] = []
    server = ControlServer(state, f.c, lines.append)
    reply = submit(state, apply_request(load_deployments([write(tmp_path, revision="v2")])),
                   sleep=serve_while_waiting(server))  # fmt: skip
    assert reply["ok"] and reply["lines"][0].startswith("chat: canary rollout of v2@")
    assert lines == [f"apply: {reply['lines'][0]}"]
    assert f.c.deployments["chat"].revs.canary is not None
    assert list(control_dir(state).iterdir()) == []          # request and reply both gone
    await f.tick(4)
    status = submit(state, rollout_request("chat", "status"), sleep=serve_while_waiting(server))
    assert status["ok"] and {r["role"]: r["weight"] for r in status["status"]["revisions"]} == {
        "stable": 75.0, "canary": 25.0}
    promoted = submit(state, rollout_request("chat", "promote"), sleep=serve_while_waiting(server))
    assert promoted["lines"] == ["promoted: promoted by hand"]


async def test_bad_requests_change_nothing_and_say_why(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    server = ControlServer(tmp_path / "state", f.c)
    doc = yaml.safe_load(write(tmp_path, revision="v2").read_text())
    doc["spec"]["rollout"]["steps"] = [{"weight": 150}]
    bad = {"kind": "apply", "documents": [{"document": doc, "path": "x.yaml", "index": 0}]}
    reply = server.handle(bad)
    assert not reply["ok"] and reply["lines"] == ["x.yaml[0] spec.rollout.steps[0].weight: Input should be less "
                                                  "than 100"]  # fmt: skip
    assert f.c.deployments["chat"].revs.canary is None
    assert server.handle(rollout_request("nope", "pause")) == {
        "ok": False, "lines": ["deployment 'nope' is not run by this fleet"]}
    assert not server.handle(rollout_request("chat", "explode"))["ok"]
    assert not server.handle({"kind": "reboot"})["ok"]
    control_dir(tmp_path / "state").mkdir(parents=True)
    (control_dir(tmp_path / "state") / "1-x.json").write_text("{not json")
    assert server.handle_pending() == 1
    reply = json.loads((control_dir(tmp_path / "state") / "1-x.reply.json").read_text())
    assert not reply["ok"] and "unreadable request" in reply["lines"][0]


def test_nobody_listening_is_an_error_and_the_request_is_withdrawn(tmp_path):
    ticks = iter(range(100))
    with pytest.raises(ControlError, match="no running `fleet up` answered"):
        submit(tmp_path, rollout_request("chat", "status"), timeout_s=3, clock=lambda: next(ticks),
               sleep=lambda s: None)  # fmt: skip
    assert list(control_dir(tmp_path).iterdir()) == []


def test_fleet_apply_validates_first_and_needs_a_running_fleet(tmp_path):
    runner = CliRunner()
    good = write(tmp_path)
    doc = yaml.safe_load(good.read_text())
    doc["spec"]["rollout"]["strategy"] = "blue-green"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = runner.invoke(app, ["apply", str(bad), "--state-dir", str(tmp_path / "s")])
    assert result.exit_code == 2
    assert "spec.rollout.strategy" in result.output and "nothing applied" in result.output
    assert not (tmp_path / "s" / "control").exists()
    result = runner.invoke(app, ["apply", str(good), "--state-dir", str(tmp_path / "s")])
    assert result.exit_code == 1 and "No `fleet up` runs" in result.output
    result = runner.invoke(app, ["rollout", "pause", "chat", "--state-dir", str(tmp_path / "s")])
    assert result.exit_code == 1 and "No `fleet up` runs" in result.output


def test_fleet_apply_runs_the_checks_of_fleet_validate_before_handing_anything_over(tmp_path, monkeypatch):
    """A spec vLLM would refuse at start (an engine flag its parser refuses, a --max-model-len
    above the model's maximum) is refused by `fleet apply` as by `fleet validate`, and never
    reaches the running `fleet up`; --no-vllm-check skips the parser as validate's does."""
    from fleet.engines import vllm_args

    sent = []
    monkeypatch.setattr("fleet.cli.rollout._running", lambda store: True)
    monkeypatch.setattr("fleet.cli.rollout.submit", lambda root, request, alive: sent.append(request) or
                        {"ok": True, "lines": ["chat: replaced"]})  # fmt: skip
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(vllm_args, "vllm_installed", lambda: True)
    monkeypatch.setattr(vllm_args, "_ask_vllm", lambda args: ["unrecognized arguments: --swap-space 4 (vLLM 0.32.0's "
                        "vllm serve parser)"] if "--swap-space" in args else [])  # fmt: skip
    runner = CliRunner()
    state = ["--state-dir", str(tmp_path / "s")]
    flag = write(tmp_path, args=["--swap-space", "4"])
    result = runner.invoke(app, ["apply", str(flag), *state])
    assert result.exit_code == 2, result.output
    assert "nothing applied" in result.output
    assert "chat.yaml[0] spec.engine.args: unrecognized arguments: --swap-space 4" in result.output
    assert sent == []
    result = runner.invoke(app, ["apply", "--no-vllm-check", str(flag), *state])
    assert result.exit_code == 0 and "chat: replaced" in result.output and len(sent) == 1

    model = tmp_path / "models" / "m"
    (model / "config.json").write_text((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    doc = yaml.safe_load(write(tmp_path, args=["--max-model-len", "65536"]).read_text())
    doc["spec"]["resources"] = {"accelerator": "gpu", "tensorParallelSize": 1}
    long = tmp_path / "long.yaml"
    long.write_text(yaml.safe_dump(doc))
    result = runner.invoke(app, ["apply", str(long), *state])
    assert result.exit_code == 2, result.output
    assert "long.yaml[0] spec.engine.args: --max-model-len 65,536 is above the model's maximum 32,768" in result.output
    assert len(sent) == 1
