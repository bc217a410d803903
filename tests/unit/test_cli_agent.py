"""`fleet cache ls|pull|rm|verify|manifest` and `fleet node-agent --once` through the CLI,
in-process, against the local hub server (in a thread). The hub server and the node agent's
loop as real processes are in tests/integration/test_cli_agent.py."""

from __future__ import annotations

import json
import os

import pytest
import typer
from typer.testing import CliRunner

from fleet.cli import app
from fleet.cli.agent import parse_size
from fleet.testing.hub_server import HubRepo, HubServer

runner = CliRunner()
FILES = {"config.json": b'{"a": 1}', "model.safetensors": os.urandom(300_000)}


@pytest.fixture()
def hub(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with HubServer({"org/tiny": HubRepo(FILES)}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


def test_pull_ls_verify_rm(hub, tmp_path):
    root = str(tmp_path / "cache")
    r = runner.invoke(app, ["cache", "pull", "hf://org/tiny", "--root", root])
    assert r.exit_code == 0, r.output
    path = r.stdout.strip().splitlines()[-1]
    assert open(os.path.join(path, "model.safetensors"), "rb").read() == FILES["model.safetensors"]
    r = runner.invoke(app, ["cache", "ls", "--root", root, "--json"])
    [entry] = json.loads(r.stdout)
    assert entry["source"] == "hf://org/tiny" and entry["files"] == 2 and entry["size_bytes"] == 300_008
    r = runner.invoke(app, ["cache", "ls", "--root", root])
    assert entry["key"] in r.stdout and "1 model(s)" in r.stdout
    blob = os.path.realpath(os.path.join(path, "model.safetensors"))
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.write(b"\0" * 8)
    r = runner.invoke(app, ["cache", "verify", "--root", root])
    assert r.exit_code == 1 and "corrupt: model.safetensors" in r.stdout
    r = runner.invoke(app, ["cache", "rm", entry["key"], "--root", root])
    assert r.exit_code == 0 and "removed" in r.stdout
    r = runner.invoke(app, ["cache", "rm", entry["key"], "--root", root])
    assert r.exit_code == 1 and "no cached model" in r.output


def test_pull_errors_name_the_model(hub, tmp_path):
    r = runner.invoke(app, ["cache", "pull", "hf://org/absent", "--root", str(tmp_path)])
    assert r.exit_code == 2 and "org/absent" in r.output
    r = runner.invoke(app, ["cache", "pull", "ftp://x/y", "--root", str(tmp_path)])
    assert r.exit_code == 2 and "unsupported scheme" in r.output


def test_manifest_command(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    r = runner.invoke(app, ["cache", "manifest", str(tmp_path / "m")])
    assert r.exit_code == 0
    doc = json.loads((tmp_path / "m" / "fleet-manifest.json").read_text())
    assert doc["files"] == [{"path": "config.json", "size": 2,
                             "sha256": "44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"}]


def test_node_agent_once_without_nvml_reports_the_cache(hub, tmp_path, monkeypatch):
    import fleet.inventory.nvml as inv

    def no_nvml(self):
        raise RuntimeError("NVML unavailable: NVML Shared Library Not Found")
    monkeypatch.setattr(inv.PynvmlReader, "snapshot", no_nvml)
    root = str(tmp_path / "cache")
    assert runner.invoke(app, ["cache", "pull", "hf://org/tiny", "--root", root]).exit_code == 0
    r = runner.invoke(app, ["node-agent", "--once", "--root", root, "--node-name", "n1"])
    assert r.exit_code == 0, r.output
    status = json.loads(r.stdout[r.stdout.index("{"):])
    assert status["node"] == "n1" and status["health_checks"] is False
    assert [c["source"] for c in status["cache"]] == ["hf://org/tiny"]
    assert "GPU health checks are off" in r.output


def test_parse_size():
    assert parse_size("200GiB") == 200 * 1024**3 and parse_size("1.5TB") == 1_500_000_000_000
    assert parse_size("4096") == 4096
    with pytest.raises(typer.BadParameter, match="not a size"):
        parse_size("lots")
