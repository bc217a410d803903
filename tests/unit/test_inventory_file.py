"""The inventory file (fleet.inventory.file): example files, round trip, and malformed inputs whose
errors name the node and the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fleet.inventory.file import InventoryError, inventory_document, load_inventory, parse_inventory
from fleet.inventory.mig import MigSlot, check_geometry, mig_model_for
from fleet.inventory.nvml import node_from_nvml
from fleet.inventory.model import Inventory
from tests.support.fake_nvml import mig_h100, nvswitch_8gpu, real_h100_snapshot

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "inventories"

GOOD = {
    "apiVersion": "fleet.inference.dev/v1alpha1",
    "kind": "Inventory",
    "nodes": [
        {"name": "gpu-node-0", "gpuCount": 8, "gpuProduct": "NVIDIA H100 80GB HBM3", "gpuMemoryMib": 81559,
         "nvswitch": True},
        {"name": "gpu-node-1", "gpuCount": 4, "gpuProduct": "NVIDIA L40S", "gpuMemoryMib": 46068, "nvlinkDomains": []},
        {"name": "gpu-node-2", "gpus": [
            {"index": 0, "product": "NVIDIA H100 80GB HBM3", "memoryMib": 81559, "migEnabled": True,
             "migInstances": [{"profile": "3g.40gb"}, {"profile": "3g.40gb"}]},
            {"index": 1, "product": "NVIDIA H100 80GB HBM3", "memoryMib": 81559},
            {"index": 2, "product": "NVIDIA H100 80GB HBM3", "memoryMib": 81559},
        ]},
        {"name": "gpu-node-3", "gpuCount": 8, "gpuProduct": "NVIDIA A100-SXM4-80GB", "gpuMemoryMib": 81920,
         "nvlinkDomains": [[0, 1, 2, 3], [4, 5, 6, 7]], "gpus": [{"index": 5, "inUse": True}]},
    ],
}


def with_change(path: list, value) -> dict:
    doc = copy.deepcopy(GOOD)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


def test_good_document_loads_with_defaults_filled_in():
    loaded = parse_inventory(GOOD)
    inv = loaded.inventory
    assert [n.name for n in inv.nodes] == ["gpu-node-0", "gpu-node-1", "gpu-node-2", "gpu-node-3"]
    assert inv.node("gpu-node-0").nvlink_domains == (tuple(range(8)),)
    assert inv.node("gpu-node-1").nvlink_domains == ()
    assert inv.node("gpu-node-2").nvlink_domains is None          # not declared: unknown
    assert inv.node("gpu-node-3").gpus[5].uuid == "GPU-gpu-node-3-5"
    assert loaded.in_use == {"GPU-gpu-node-3-5": 1}
    # MIG instances without a start get valid start slots.
    mig = inv.node("gpu-node-2").gpus[0].mig_instances
    assert sorted(m.start for m in mig) == [0, 4]
    assert check_geometry(mig_model_for("NVIDIA H100 80GB HBM3"), [MigSlot(m.profile, m.start) for m in mig]) is None


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_inventories_are_valid(name):
    loaded = load_inventory(EXAMPLES / name)
    assert loaded.inventory.nodes


def test_the_h100_example_is_the_real_reading():
    example = load_inventory(EXAMPLES / "h100-vm.yaml").inventory.nodes[0]
    read = node_from_nvml(real_h100_snapshot(), "h100-vm")
    assert example.gpus == read.gpus
    assert example.nvlink_domains == read.nvlink_domains
    assert (example.driver_version, example.cuda_driver_version) == ("580.159.04", (13, 0))
    assert (read.driver_version, read.cuda_driver_version) == ("580.159.04", (13, 0))


@pytest.mark.parametrize("snapshot", [real_h100_snapshot(), nvswitch_8gpu(), mig_h100([[("3g.40gb", 0), ("1g.10gb", 4)]])])
def test_discovered_node_round_trips_through_the_document(snapshot):
    inv = Inventory((node_from_nvml(snapshot, "node-a", cpu_cores=(0, 1, 2, 3)),))
    text = yaml.safe_dump(inventory_document(inv, "x"))
    assert parse_inventory(yaml.safe_load(text)).inventory == inv


MALFORMED = [
    (with_change(["nodes", 2, "gpus", 1, "product"], KeyError),
     "nodes[2] (gpu-node-2).gpus[1].product: required (or set gpuProduct on the node)"),
    (with_change(["nodes", 1, "name"], "gpu-node-0"),
     "nodes[1] (gpu-node-0).name: 'gpu-node-0' is also nodes[0]"),
    (with_change(["nodes", 0, "name"], "GPU_Node"),
     "nodes[0] (GPU_Node).name: 'GPU_Node' is not a DNS-1123 subdomain"),
    (with_change(["nodes", 3, "nvlinkDomains"], [[0, 1, 2, 3], [3, 4, 5, 6, 7]]),
     "nodes[3] (gpu-node-3).nvlinkDomains[1]: GPU 3 is also in nvlinkDomains[0]"),
    (with_change(["nodes", 3, "nvlinkDomains"], [[0, 1, 2, 3, 8]]),
     "nodes[3] (gpu-node-3).nvlinkDomains[0]: GPU 8 is not a GPU of this node"),
    (with_change(["nodes", 0, "nvlinkDomains"], [[0, 1]]),
     "nodes[0] (gpu-node-0).nvlinkDomains: set either nvswitch: true or nvlinkDomains, not both"),
    (with_change(["nodes", 2, "gpus", 0, "migInstances", 0, "profile"], "3g.20gb"),
     "nodes[2] (gpu-node-2).gpus[0].migInstances[0].profile: 3g.20gb is not a MIG profile of NVIDIA H100 80GB"),
    (with_change(["nodes", 2, "gpus", 0, "migInstances"], [{"profile": "4g.40gb"}, {"profile": "4g.40gb"}]),
     "nodes[2] (gpu-node-2).gpus[0].migInstances: invalid MIG geometry for NVIDIA H100 80GB"),
    (with_change(["nodes", 2, "gpus", 0, "migInstances"], [{"profile": "3g.40gb", "start": 2}]),
     "nodes[2] (gpu-node-2).gpus[0].migInstances: invalid MIG geometry for NVIDIA H100 80GB: 3g.40gb cannot start at memory slice 2"),
    (with_change(["nodes", 2, "gpus", 0, "migEnabled"], False),
     "nodes[2] (gpu-node-2).gpus[0].migInstances: MIG instances need migEnabled: true"),
    (with_change(["nodes", 2, "gpus", 0, "migInstances", 0, "profile"], "big"),
     "nodes[2] (gpu-node-2).gpus[0].migInstances[0].profile: 'big' is not a MIG profile name"),
    (with_change(["nodes", 3, "gpus", 0, "index"], 9),
     "nodes[3] (gpu-node-3).gpus[0].index: 9 is outside gpuCount 8 (0..7)"),
    (with_change(["nodes", 1, "gpuProduct"], KeyError),
     "nodes[1] (gpu-node-1).gpuProduct: required with gpuCount"),
    (with_change(["nodes", 0, "gpuCount"], -1),
     "nodes[0] (gpu-node-0).gpuCount: Input should be greater than or equal to 0"),
    (with_change(["nodes", 0, "nvLink"], True),
     "nodes[0] (gpu-node-0).nvLink: unknown field"),
    (with_change(["nodes", 2, "gpus", 1, "health"], {"clockEventReasons": ["tooHot"]}),
     "nodes[2] (gpu-node-2).gpus[1].health.clockEventReasons: unknown clock event reason(s) tooHot"),
    (with_change(["nodes", 2, "gpus", 2, "uuid"], "GPU-x"),
     None),  # valid: one explicit UUID
    (with_change(["nodes"], []),
     "nodes: List should have at least 1 item"),
    (with_change(["kind"], "Inventroy"),
     "kind: Input should be 'Inventory'"),
]


@pytest.mark.parametrize("doc, expected", MALFORMED, ids=[str(i) for i in range(len(MALFORMED))])
def test_malformed_inventory_errors_name_node_and_field(doc, expected):
    if expected is None:
        parse_inventory(doc)
        return
    with pytest.raises(InventoryError) as err:
        parse_inventory(doc, "inventory.yaml ")
    assert any(line.startswith(f"inventory.yaml {expected}") for line in err.value.problems), err.value.problems


def test_duplicate_gpu_uuid_across_nodes_is_named():
    doc = copy.deepcopy(GOOD)
    doc["nodes"][2]["gpus"][1]["uuid"] = "GPU-dup"
    doc["nodes"][2]["gpus"][2]["uuid"] = "GPU-dup"
    with pytest.raises(InventoryError, match=r"nodes\[2\] \(gpu-node-2\)\.gpus\[2\]\.uuid: GPU-dup is also nodes\[2\]\.gpus\[1\]"):
        parse_inventory(doc)


def test_file_errors_name_the_file_and_yaml_position(tmp_path):
    f = tmp_path / "inv.yaml"
    f.write_text("apiVersion: fleet.inference.dev/v1alpha1\nkind: Inventory\nnodes: [\n")
    with pytest.raises(InventoryError, match=r"inv.yaml: invalid YAML at line 4, column 1"):
        load_inventory(f)
    with pytest.raises(InventoryError, match="cannot read"):
        load_inventory(tmp_path / "missing.yaml")
