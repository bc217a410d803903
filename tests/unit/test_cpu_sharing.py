"""CPU replicas past a node's cores share them, and Fleet says so where it happens: `fleet plan`,
`fleet up`'s progress lines and `fleet status` (fleet/placement/cpu.py `cpu_sharing_notes`)."""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console
from typer.testing import CliRunner

from fleet.cli import app
from fleet.cli.local import _cpu_sharing
from fleet.controller.lifecycle import ReplicaStatus
from fleet.inventory.model import Inventory, NodeInventory
from fleet.local.progress import ProgressPrinter
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from fleet.placement.cpu import cpu_sharing_notes
from tests.support.inventories import cluster, node

REPO = Path(__file__).resolve().parents[2]
LAPTOP = Inventory((NodeInventory("laptop", cpu_cores=(0, 1)),))


def cpu_plan(count: int, inventory: Inventory = LAPTOP, cores: int = 1):
    return get_strategy("fleet").place_replicas(PlacementRequest(ReplicaShape(accelerator="cpu", cpu_cores=cores),
                                                                 count=count), inventory, Counter())  # fmt: skip


def test_replicas_past_the_cores_are_said_to_share_them_and_replicas_within_them_are_not():
    assert cpu_sharing_notes(cpu_plan(5).placements) == [
        "cpu (shared) on laptop: 5 replicas on 2 cores, they share CPU time"]
    assert cpu_sharing_notes(cpu_plan(2).placements) == []
    assert cpu_sharing_notes(cpu_plan(2, cores=2).placements) == ["cpu (shared) on laptop: 2 replicas on 2 cores, "
                                                                 "they share CPU time"]  # fmt: skip
    gpu = get_strategy("fleet").place_replicas(PlacementRequest(ReplicaShape(), count=2), cluster(node("a")),
                                               Counter())  # fmt: skip
    assert gpu.complete and cpu_sharing_notes(gpu.placements) == []


def test_fleet_up_says_it_when_sharing_starts_and_again_when_it_changes():
    out = io.StringIO()
    printer = ProgressPrinter(Console(file=out, width=200), clock=lambda: 0.0)
    placements = cpu_plan(4).placements
    replicas = {f"r{i}": SimpleNamespace(placement=p.to_dict(), status=ReplicaStatus.STARTING)
                for i, p in enumerate(placements)}  # fmt: skip
    controller = SimpleNamespace(replicas={k: replicas[k] for k in ("r0", "r1")})
    printer.sharing(controller)
    assert "shared" not in out.getvalue()                                   # two replicas, two cores
    controller.replicas = dict(replicas)
    printer.sharing(controller)
    printer.sharing(controller)                                             # said once
    assert out.getvalue().count("cpu (shared) on laptop: 4 replicas on 2 cores, they share CPU time") == 1
    replicas["r3"].status = ReplicaStatus.TERMINATED
    printer.sharing(controller)
    assert "cpu (shared) on laptop: 3 replicas on 2 cores" in out.getvalue()


def test_fleet_status_and_fleet_plan_say_it(tmp_path: Path):
    placements = cpu_plan(3).placements
    states = ("READY", "READY", "WARMING")
    state_replicas = [{"placement": p.to_dict(), "status": s} for p, s in zip(placements, states)]
    assert _cpu_sharing(state_replicas) == ["cpu (shared) on laptop: 3 replicas on 2 cores, they share CPU time"]
    state_replicas[2]["status"] = "FAILED_CRASHED"
    assert _cpu_sharing(json.loads(json.dumps(state_replicas))) == []

    (tmp_path / "inventory.yaml").write_text("apiVersion: fleet.inference.dev/v1alpha1\nkind: Inventory\n"
                                             "metadata: {name: laptop}\nnodes:\n  - {name: laptop, cpuCores: 2}\n")
    spec = tmp_path / "quickstart.yaml"
    spec.write_text((REPO / "examples" / "quickstart.yaml").read_text())
    result = CliRunner().invoke(app, ["plan", str(spec), "-i", str(tmp_path / "inventory.yaml"), "--replicas", "3"])
    assert result.exit_code == 0, result.output
    assert "cpu (shared) on laptop: 3 replicas on 2 cores, they share CPU time" in result.output
    two = CliRunner().invoke(app, ["plan", str(spec), "-i", str(tmp_path / "inventory.yaml"), "--replicas", "2"])
    assert two.exit_code == 0 and "shared" not in two.output, two.output
