"""NVML discovery (fleet.inventory.nvml): the real H100 readings, synthetic NVSwitch, partial
NVLink and PCIe nodes, MIG, health, and the real reader run against a stand-in pynvml."""

from __future__ import annotations

import copy

import pynvml
import pytest

from fleet.inventory.mig import MIG_MODELS, mig_model_for
from fleet.inventory.model import CLOCK_EVENT_BITS
from fleet.inventory.nvml import PynvmlReader, discover_local, node_from_nvml
from tests.support.fake_nvml import (
    FakeNvml,
    FakePynvml,
    device,
    mig_h100,
    nvswitch_8gpu,
    partial_nvlink_8gpu,
    pcie_4gpu,
    real_h100_snapshot,
)


def test_real_h100_reading_becomes_one_healthy_unlinked_gpu():
    node = node_from_nvml(real_h100_snapshot(), "h100-vm", cpu_cores=(0, 1))
    (gpu,) = node.gpus
    assert gpu.uuid == "GPU-23799156-4034-6e68-7504-67db2b8cf438"
    assert gpu.product == "NVIDIA H100 80GB HBM3"
    assert gpu.memory_mib == 81559
    assert (gpu.pcie_gen, gpu.pcie_width) == (5, 16)
    assert gpu.pci_bus_id == "00000000:00:06.0"
    assert not gpu.mig_enabled and gpu.mig_instances == ()
    # clocks_event_reasons = 1 is "GPU idle": ordinary, not a health problem.
    assert gpu.health.clock_event_reasons == CLOCK_EVENT_BITS["gpuIdle"]
    assert gpu.health.temperature_c == 44
    assert gpu.health.healthy
    # NVLink answered NotSupported on that VM: the topology is known, and there is no domain.
    assert node.topology_known and node.nvlink_domains == ()
    assert [len(d) for d in node.domains] == [1]


def test_h100_mig_table_matches_the_real_profile_list():
    real = real_h100_snapshot()["devices"][0]
    model = mig_model_for(real["name"], real["memory_total_mib"])
    assert model is MIG_MODELS["h100-80gb"]
    for row in real["gpu_instance_profiles"]:
        p = model.profile(row["name"])
        assert p is not None, row["name"]
        assert p.profile_id == row["profile_id"]
        assert p.memory_mib == row["memory_mib"]
        assert p.max_instances == row["instances"]
        # "slices" in NVML's profile info is the GPU (compute) slice count.
        assert p.compute_slices == row["slices"]
    assert sorted(model.profile_names()) == sorted(r["name"] for r in real["gpu_instance_profiles"])


@pytest.mark.parametrize("snapshot, domains", [
    (nvswitch_8gpu(), ((0, 1, 2, 3, 4, 5, 6, 7),)),
    (partial_nvlink_8gpu(), ((0, 1, 2, 3), (4, 5, 6, 7))),
    (pcie_4gpu(), ()),
])
def test_nvlink_domains_are_the_components_of_the_nvlink_graph(snapshot, domains):
    node = node_from_nvml(snapshot, "n")
    assert node.nvlink_domains == domains
    assert sum(len(d) for d in node.domains) == len(snapshot["devices"])


def test_mig_instances_keep_profile_uuid_and_start():
    node = node_from_nvml(mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)], [("1g.10gb", s) for s in range(7)]]), "m")
    g0, g1 = node.gpus
    assert g0.mig_enabled and [(m.profile, m.start, m.uuid) for m in g0.mig_instances] == [
        ("3g.40gb", 0, "MIG-0-0"), ("3g.40gb", 4, "MIG-0-1")]
    assert [m.profile for m in g1.mig_instances] == ["1g.10gb"] * 7
    assert all(m.parent_uuid == g1.uuid for m in g1.mig_instances)


@pytest.mark.parametrize("overrides, problem", [
    ({"ecc_volatile_uncorrected": 2}, "uncorrected ECC errors"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 1, "pending": 1, "failure": 0}}, "row remap pending"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 9, "pending": 0, "failure": 1}}, "row remap failure"),
    ({"clocks_event_reasons": CLOCK_EVENT_BITS["hwThermalSlowdown"] | 1}, "hardware thermal slowdown"),
    ({"clocks_event_reasons": CLOCK_EVENT_BITS["hwPowerBrakeSlowdown"]}, "hardware power brake slowdown"),
    ({"temperature_c": 91, "temperature_slowdown_c": 90}, "at slowdown temperature"),
])
def test_health_problems_make_a_gpu_unhealthy(overrides, problem):
    node = node_from_nvml({"devices": [device(0, **overrides)]}, "n")
    assert not node.gpus[0].health.healthy
    assert any(p.startswith(problem) for p in node.gpus[0].health.problems())


def test_software_power_cap_is_not_a_health_problem():
    node = node_from_nvml({"devices": [device(0, clocks_event_reasons=CLOCK_EVENT_BITS["swPowerCap"])]}, "n")
    assert node.gpus[0].health.healthy


def test_completed_multi_node_fabric_names_the_nvlink_fabric():
    snap = nvswitch_8gpu()
    for d in snap["devices"]:
        d["fabric"] = {"cluster_uuid": "7b968a6dc8aa45e19e07e1e51be99c31", "clique_id": 1, "completed": True}
    assert node_from_nvml(snap, "n").nvlink_fabric == "7b968a6dc8aa45e19e07e1e51be99c31.1"
    # Read through the real reader from a stand-in pynvml, too.
    assert node_from_nvml(PynvmlReader(FakePynvml(snap)).snapshot(), "n").nvlink_fabric == "7b968a6dc8aa45e19e07e1e51be99c31.1"
    for d in snap["devices"]:
        d["fabric"]["completed"] = False
    assert node_from_nvml(snap, "n").nvlink_fabric is None


@pytest.mark.parametrize("snapshot", [
    real_h100_snapshot(), nvswitch_8gpu(), partial_nvlink_8gpu(), pcie_4gpu(),
    mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)], [("2g.20gb", 0), ("2g.20gb", 2), ("2g.20gb", 4), ("1g.10gb", 6)]]),
])
def test_the_real_reader_over_a_stand_in_pynvml_reads_what_the_snapshot_holds(snapshot):
    fake = FakePynvml(copy.deepcopy(snapshot))
    read = PynvmlReader(fake).snapshot()
    assert fake.initialized == 0   # nvmlInit and nvmlShutdown paired
    assert node_from_nvml(read, "n") == node_from_nvml(snapshot, "n")


def test_every_nvml_name_the_reader_uses_exists_in_nvidia_ml_py():
    used = [n for n in vars(FakePynvml) if n.startswith(("nvml", "NVML", "c_nvml", "byref"))]
    assert len(used) > 25
    missing = [n for n in used if not hasattr(pynvml, n)]
    assert missing == []


def test_discover_local_without_nvml_lists_no_gpu_but_the_cpu_cores():
    nvml = FakeNvml(None)
    node = discover_local(nvml, node_name="cpu-box")
    assert nvml.calls == 1
    assert node.name == "cpu-box" and node.gpus == ()
    assert len(node.cpu_cores) >= 1


def test_discover_local_uses_the_reader():
    node = discover_local(FakeNvml(partial_nvlink_8gpu()))
    assert len(node.gpus) == 8 and node.nvlink_domains == ((0, 1, 2, 3), (4, 5, 6, 7))
