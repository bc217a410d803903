"""`fleet plan` and `fleet inventory` (fleet.cli) on the example files and on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from typer.testing import CliRunner

from fleet.cli import app
from fleet.inventory.file import parse_inventory
from fleet.inventory.nvml import PynvmlReader
from tests.support.fake_nvml import partial_nvlink_8gpu, real_h100_snapshot

ROOT = Path(__file__).resolve().parents[2]
MIXED = str(ROOT / "examples" / "inventories" / "small-mixed.yaml")
runner = CliRunner()


def run(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


def test_plan_places_the_gpu_example_on_the_mixed_cluster():
    result = run("plan", str(ROOT / "examples" / "gpu-tp2.yaml"), "--inventory", MIXED)
    assert result.exit_code == 0, result.output
    assert "llama-8b" in result.output and "all placed" in result.output
    # Warm node first (it caches the image and the weights), GPUs pinned by UUID.
    assert "replica 0: h100-sxm-1 nvlink0 gpu:0,1 (warm) CUDA_VISIBLE_DEVICES=GPU-h100-sxm-1-0,GPU-h100-sxm-1-1" in result.output
    assert "mig:3g.40gb@gpu" in result.output


def test_plan_demo_explains_what_does_not_fit_and_exits_1():
    result = run("plan", str(ROOT / "examples" / "placement-demo.yaml"), "--inventory", MIXED, "--json")
    assert result.exit_code == 1
    plans = {p["deployment"]: p for p in json.loads(result.output)}
    gang = plans["big-tp16"]
    assert gang["gang"] == {"nodes": 2, "gpusPerNode": 8} and gang["placed"] == 1
    assert sorted(m["node"] for m in gang["replicas"][0]["members"]) == ["h100-sxm-1", "h100-sxm-3"]
    assert plans["small-tp2"]["replicas"][0]["members"][0]["node"] == "h100-sxm-2"    # the partly used node
    assert plans["any-tp4"]["product"] == "NVIDIA A100-SXM4-80GB" and plans["any-tp4"]["placed"] == 2
    mig = plans["chat-mig"]
    assert (mig["placed"], mig["requested"]) == (3, 5)
    assert any("3g.40gb@4" in a["plan"] for a in mig["migAdvice"])
    l40s = plans["l40s-tp2"]
    assert l40s["placed"] == 0
    assert {"reason": "at most 1 GPU in one NVLink domain, need 2", "nodes": ["l40s-pcie-1"]} in l40s["reasons"]


def test_plan_first_fit_and_replicas_override():
    result = run("plan", str(ROOT / "examples" / "gpu-tp2.yaml"), "-i", MIXED, "--replicas", "3", "--strategy", "first-fit", "--json")
    plans = {p["deployment"]: p for p in json.loads(result.output)}
    assert plans["llama-8b"]["placed"] == 3
    assert plans["llama-8b"]["replicas"][0]["members"][0]["devices"] == ["GPU-h100-sxm-1-0", "GPU-h100-sxm-1-1"]


def test_plan_rejects_bad_inventory_and_unknown_strategy(tmp_path):
    bad = tmp_path / "inv.yaml"
    bad.write_text(yaml.safe_dump({"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "Inventory",
                                   "nodes": [{"name": "gpu-node-3", "gpus": [{"index": 0, "memoryMib": 1}]}]}))
    result = run("plan", str(ROOT / "examples" / "gpu-tp2.yaml"), "-i", str(bad))
    assert result.exit_code == 2
    assert "nodes[0] (gpu-node-3).gpus[0].product: required" in result.output
    result = run("plan", str(ROOT / "examples" / "gpu-tp2.yaml"), "-i", MIXED, "--strategy", "best")
    assert result.exit_code == 2 and "known: first-fit, fleet" in result.output


def test_inventory_summarizes_a_file():
    result = run("inventory", MIXED)
    assert result.exit_code == 0
    assert "6 node(s), 44 GPU(s): valid" in result.output
    assert "a100-quads-1 [zone-a/rack-1]: 8x NVIDIA A100-SXM4-80GB; NVLink {0,1,2,3} {4,5,6,7}" in result.output
    assert "unhealthy: GPU4 (uncorrected ECC errors)" in result.output


def test_inventory_discover_prints_a_document_plan_accepts(monkeypatch):
    monkeypatch.setattr(PynvmlReader, "snapshot", lambda self: partial_nvlink_8gpu())
    result = run("inventory", "--discover", "--node-name", "box-1")
    assert result.exit_code == 0, result.output
    inv = parse_inventory(yaml.safe_load(result.output)).inventory
    assert inv.nodes[0].name == "box-1" and len(inv.nodes[0].gpus) == 8
    assert inv.nodes[0].nvlink_domains == ((0, 1, 2, 3), (4, 5, 6, 7))


def test_inventory_discover_raw_prints_the_readings(monkeypatch):
    monkeypatch.setattr(PynvmlReader, "snapshot", lambda self: real_h100_snapshot())
    result = run("inventory", "--discover", "--raw")
    assert json.loads(result.output)["devices"][0]["uuid"] == "GPU-23799156-4034-6e68-7504-67db2b8cf438"


def test_inventory_discover_without_nvml_lists_no_gpu(monkeypatch):
    def unavailable(self):
        raise RuntimeError("NVML unavailable: NVML Shared Library Not Found")

    monkeypatch.setattr(PynvmlReader, "snapshot", unavailable)
    result = run("inventory", "--discover", "--node-name", "cpu-box")
    assert result.exit_code == 0
    assert "NVML unavailable" in result.output
    doc = yaml.safe_load(result.output[result.output.index("apiVersion"):])
    assert parse_inventory(doc).inventory.nodes[0].gpus == ()


def test_inventory_needs_a_file_or_discover():
    assert run("inventory").exit_code == 2
