"""`fleet plan` with priorities (fleet/placement/fleet_plan.py, fleet/cli/placement.py): replicas
placed as the controller places them, lower-priority replicas preempted for a deployment below
its minimum by the controller's own `PreemptionPolicy`, each named with its reason, and the
listed GPU products passed over explained."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from typer.testing import CliRunner

from fleet.cli import app
from fleet.models import EngineMemorySettings, MemoryNeed, facts_from_config
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from fleet.placement.fleet_plan import PlanItem, plan_fleet
from fleet.placement.preemption import PreemptionPolicy
from tests.support.inventories import H100, L40S, cluster, node

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
INV = cluster(node("h100-1", n=4))


def item(name: str, count: int, priority: int, minimum: int, preemptible: bool = False) -> PlanItem:
    request = PlacementRequest(ReplicaShape(gpu_product=H100, tensor_parallel_size=1), count=count, deployment=name)
    return PlanItem(name, request, priority, preemptible, minimum)


def devices(item_plan) -> set[str]:
    return {d for p in item_plan.plan.placements for d in p.devices}


def test_a_higher_priority_below_its_minimum_preempts_and_is_listed_first():
    chat, batch = plan_fleet([item("batch", 4, 0, 1), item("chat", 2, 100, 2)], INV, Counter(), get_strategy())
    assert (chat.item.name, batch.item.name) == ("chat", "batch") and chat.plan.complete   # highest priority first
    assert [v.replica_id for v in chat.preempts] == [v.replica_id for v in batch.preempted]
    assert {v.deployment for v in chat.preempts} == {"batch"} and len(chat.preempts) == 2
    assert all(v.reason.startswith("preempted for chat (priority 100 > 0)") for v in chat.preempts)
    assert len(batch.plan.placements) == 2 and not batch.plan.complete
    assert not devices(batch) & devices(chat) and len(devices(batch) | devices(chat)) == 4


def test_the_plan_asks_the_controllers_preemption_policy(monkeypatch):
    calls = []
    decide = PreemptionPolicy.decide

    def spy(self, request, claimant, *args, **kwargs):
        calls.append(claimant.name)
        return decide(self, request, claimant, *args, **kwargs)

    monkeypatch.setattr(PreemptionPolicy, "decide", spy)
    plan_fleet([item("batch", 4, 0, 1), item("chat", 2, 100, 2)], INV, Counter(), get_strategy())
    assert calls == ["chat"]


def test_no_preemption_above_the_minimum_or_of_a_deployment_at_its_own_minimum():
    # chat's replicas are above its minimum (0): they wait for free capacity.
    chat = plan_fleet([item("batch", 4, 0, 1), item("chat", 2, 100, 0)], INV, Counter(), get_strategy())[0]
    assert chat.preempts == () and chat.plan.placements == ()
    # batch is at its minimum and not preemptible: nothing is taken, and the plan says why.
    chat = plan_fleet([item("batch", 4, 0, 4), item("chat", 1, 100, 1)], INV, Counter(), get_strategy())[0]
    assert chat.preempts == () and "at their minimum and not preemptible: batch (4/4)" in chat.decision
    # Preemptible: taken below its minimum.
    chat = plan_fleet([item("batch", 4, 0, 4, preemptible=True), item("chat", 1, 100, 1)], INV, Counter(),
                      get_strategy())[0]
    assert len(chat.preempts) == 1 and chat.plan.complete


def test_equal_priorities_never_preempt():
    a, b = plan_fleet([item("a", 4, 0, 1), item("b", 1, 0, 1)], INV, Counter(), get_strategy())
    assert a.preempts == b.preempts == () and not b.plan.placements


def _files(tmp_path: Path) -> tuple[Path, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((CONFIGS / "mistral-small-3.1-24b-instruct-2503.json").read_text())
    inv = tmp_path / "inv.yaml"
    inv.write_text(f"""apiVersion: fleet.inference.dev/v1alpha1
kind: Inventory
metadata: {{name: t}}
nodes:
  - {{name: l40s-1, gpuCount: 4, gpuProduct: {L40S}, gpuMemoryMib: 46068}}
  - {{name: h100-1, gpuCount: 4, gpuProduct: {H100}, gpuMemoryMib: 81559, nvswitch: true}}
""")
    deps = tmp_path / "deps.yaml"
    doc = """apiVersion: fleet.inference.dev/v1alpha1
kind: InferenceDeployment
metadata: {{name: {name}}}
spec:
  model: {{name: {name}, source: ./model}}
  engine: {{args: [--max-model-len, "8192"]}}
  resources: {{gpuProduct: [{products}], tensorParallelSize: 1}}
  replicas: {{min: {min}, initial: {initial}, max: 4}}
  priority: {priority}
"""
    deps.write_text(doc.format(name="batch", products=f"{L40S}, {H100}", min=1, initial=4, priority=0) + "---\n"
                    + doc.format(name="chat", products=H100, min=2, initial=2, priority=100))
    return deps, inv


def test_fleet_plan_previews_the_preemption_and_explains_the_product_passed_over(tmp_path):
    deps, inv = _files(tmp_path)
    result = CliRunner().invoke(app, ["plan", str(deps), "-i", str(inv)], terminal_width=400)
    assert result.exit_code == 1, result.output   # batch keeps 2 of its 4
    out = result.output
    assert out.index("chat (") < out.index("batch (")
    assert "would preempt batch-3: preempted for chat (priority 100 > 0)" in out
    assert "batch-3 would be preempted: preempted for chat" in out
    # Mistral Small 24B in bf16 (44 GiB of weights) cannot load on a 46,068 MiB L40S.
    assert (f"skipped {L40S}: model does not fit {L40S} (46068 MiB): needs 47.66 GiB per GPU at TP=1" in out
            and f"; used {H100}" in out)
    [chat, batch] = json.loads(CliRunner().invoke(app, ["plan", str(deps), "-i", str(inv), "--json"]).output)
    assert chat["priority"] == 100 and len(chat["preempts"]) == 2 and len(batch["preemptedBy"]) == 2
    assert batch["productsSkipped"][0].startswith(f"{L40S}: model does not fit")


def test_a_memory_need_is_what_rules_the_l40s_out():
    facts = facts_from_config(json.loads((CONFIGS / "mistral-small-3.1-24b-instruct-2503.json").read_text()))
    need = MemoryNeed(facts, EngineMemorySettings(max_model_len=8192), 1)
    assert need.fits(46068) is not None and need.fits(81559) is None
