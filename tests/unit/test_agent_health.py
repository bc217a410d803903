"""GPU health checks over the stand-in NVML (tests/support/fake_nvml.py, built from the real H100
readings) with injected faults: the checker's findings, Xid classification, NUMA cores."""

from __future__ import annotations

import pytest

from fleet.agent.health import GpuHealthChecker, Severity, classify, local_cores
from fleet.agent.nvml_health import NvmlHealthReader, cores_from_mask
from fleet.agent.xid import XidClass, classify_xid
from fleet.inventory.nvml import node_from_nvml
from tests.support.fake_nvml import FakePynvml, mig_h100, nvswitch_8gpu, real_h100_snapshot
from tests.support.fakes import FakeClock


def _checker(snapshot: dict):
    fake = FakePynvml(snapshot)
    domains = node_from_nvml(snapshot, "n").nvlink_domains
    checker = GpuHealthChecker(NvmlHealthReader(fake, nvlink_domains=domains), FakeClock())
    return fake, checker


def _by_check(findings):
    return {(f.target, f.check): f for f in findings}


def test_the_real_h100_reading_is_healthy():
    fake, checker = _checker(real_h100_snapshot())
    assert checker.check() == []
    [gpu] = checker.targets()
    assert gpu == "GPU-23799156-4034-6e68-7504-67db2b8cf438"
    assert checker.cpu_affinity()[gpu] == tuple(range(16))   # nvidia-smi topo on that VM: CPU affinity 0-15


def test_the_checks_read_on_a_real_h200_found_nothing_and_classify_agrees():
    """The health checks ran on a real H200 (fleet/testing/data/h200-health.json): no finding at
    any of three checks; classifying the very reading it returned finds nothing either, and the
    same reading with one volatile uncorrected ECC error is a fault on that GPU."""
    import copy
    import json
    from pathlib import Path

    import fleet.testing

    real = json.loads((Path(fleet.testing.__file__).parent / "data" / "h200-health.json").read_text())
    assert [c["findings"] for c in real["checks"]] == [[], [], []]
    reading = real["reading"]
    assert classify(reading, [], None, 0.0) == []
    sick = copy.deepcopy(reading)
    sick["devices"][0]["ecc_volatile_uncorrected"] = 1
    [finding] = classify(sick, [], reading, 1.0)
    assert finding.target == reading["devices"][0]["uuid"] and finding.severity.quarantines()


def test_a_healthy_hgx_node_has_no_findings_and_reads_p2p_inside_its_nvlink_domain():
    fake, checker = _checker(nvswitch_8gpu())
    assert checker.check() == []
    reading = checker.last_reading["devices"][0]
    assert set(reading["p2p_nvlink"]) == {str(i) for i in range(1, 8)}
    assert set(reading["nvlink_errors"]) == {str(i) for i in range(18)}


@pytest.mark.parametrize("readings, check, severity, detail", [
    ({"ecc_volatile_uncorrected": 2}, "ecc_uncorrected", Severity.FAULT, "2 uncorrected"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 1, "pending": 1, "failure": 0}},
     "row_remap_pending", Severity.FAULT, "needs a reset"),
    ({"remapped_rows": {"correctable": 0, "uncorrectable": 9, "pending": 0, "failure": 1}},
     "row_remap_failure", Severity.FAULT, "cannot be repaired"),
    ({"retired_pages_pending": 1}, "retired_pages_pending", Severity.FAULT, "pending"),
    ({"pcie": {"gen_current": 5, "gen_max": 5, "width_current": 8, "width_max": 16}},
     "pcie_link", Severity.DEGRADED, "x8 of x16"),
    ({"pcie": {"gen_current": 4, "gen_max": 5, "width_current": 16, "width_max": 16}, "clocks_event_reasons": 0},
     "pcie_link", Severity.DEGRADED, "Gen4 of Gen5"),
    ({"clocks_event_reasons": 0x40 | 0x4}, "throttle", Severity.DEGRADED, "hw_thermal_slowdown"),
    ({"clocks_event_reasons": 0x80}, "throttle", Severity.DEGRADED, "hw_power_brake_slowdown"),
    ({"clocks_event_reasons": 0x8}, "throttle", Severity.DEGRADED, "hw_slowdown"),
    ({"p2p_nvlink": {"0": 4}}, "p2p", Severity.DEGRADED, "GPU 0 not available"),
    ({"lost": True}, "gpu_lost", Severity.FAULT, "is lost"),
])
def test_an_injected_fault_is_found_on_that_gpu_only(readings, check, severity, detail):
    fake, checker = _checker(nvswitch_8gpu())
    checker.check()
    fake.inject(3, **readings)
    findings = checker.check()
    assert [(f.target, f.check, f.severity) for f in findings] == [(fake.snap["devices"][3]["uuid"], check, severity)]
    assert detail in findings[0].detail
    fake.heal(3)
    assert checker.check() == []


def test_idle_pcie_speed_drop_and_power_cap_are_not_faults():
    fake, checker = _checker(real_h100_snapshot())
    # An idle GPU (clock event reason GpuIdle) may run its link at a lower generation; SW power
    # cap is the normal state of a busy GPU.
    fake.inject(0, pcie={"gen_current": 1, "gen_max": 5, "width_current": 16, "width_max": 16},
                clocks_event_reasons=0x1 | 0x4)
    assert checker.check() == []


def test_nvlink_counters_count_by_their_growth():
    fake, checker = _checker(nvswitch_8gpu())
    fake.inject(2, nvlink_errors={"5": {"replay": 1000, "crc_flit": 7}})
    assert checker.check() == []                                   # first reading: the baseline
    fake.inject(2, nvlink_errors={"5": {"replay": 1050, "crc_flit": 9}})
    assert checker.check() == []                                   # a trickle of corrected errors
    fake.inject(2, nvlink_errors={"5": {"replay": 1050, "crc_flit": 9, "recovery": 1}})
    [f] = checker.check()
    assert f.check == "nvlink_errors" and "link 5 recovery +1" in f.detail and f.severity is Severity.DEGRADED
    fake.inject(2, nvlink_errors={"5": {"replay": 1500, "crc_flit": 9, "recovery": 1}})
    [f] = checker.check()
    assert "replay +450" in f.detail


def test_xid_events_are_classified_by_the_catalogue():
    fake, checker = _checker(nvswitch_8gpu())
    checker.check()
    for index, xid in [(0, 13), (1, 31), (2, 48), (3, 79), (4, 45), (5, 63), (6, 4242)]:
        fake.inject_xid(index, xid)
    found = {f.xid: f for f in checker.check()}
    assert found[13].severity is Severity.APPLICATION and found[31].severity is Severity.APPLICATION
    assert found[45].severity is Severity.APPLICATION
    assert found[48].severity is Severity.FAULT and "Double bit ECC" in found[48].detail
    assert found[79].severity is Severity.FAULT
    assert found[63].severity is Severity.FAULT   # a remap waits for a GPU reset: certain
    assert found[48].certain and found[79].certain and found[63].certain and not found[4242].certain
    assert found[4242].severity is Severity.SUSPECT
    assert found[48].target == fake.snap["devices"][2]["uuid"] and found[48].event
    assert checker.check() == []                                   # events are drained once


def test_an_xid_on_a_mig_instance_targets_that_instance():
    snap = mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)]])
    fake, checker = _checker(snap)
    checker.check()
    fake.inject_xid(0, 94, gpu_instance_id=2)
    [f] = checker.check()
    assert f.target == "MIG-0-1" and f.gpu == snap["devices"][0]["uuid"] and f.severity is Severity.FAULT
    targets = checker.targets()
    assert targets["MIG-0-1"] == (snap["devices"][0]["uuid"], 0.5)


def test_nvml_failing_altogether_is_one_node_wide_finding():
    class Broken(NvmlHealthReader):
        def read(self):
            raise RuntimeError("NVML Shared Library Not Found")

    checker = GpuHealthChecker(Broken(FakePynvml(real_h100_snapshot())), FakeClock())
    [f] = checker.check()
    assert (f.target, f.check, f.severity) == ("node", "nvml", Severity.FAULT)


def test_classify_is_pure_and_stamps_the_time():
    reading = {"devices": [{"index": 0, "uuid": "GPU-a", "ecc_volatile_uncorrected": 1}]}
    [f] = classify(reading, [], None, 123.0)
    assert f.observed_s == 123.0 and reading == {"devices": [{"index": 0, "uuid": "GPU-a",
                                                             "ecc_volatile_uncorrected": 1}]}


def test_xid_table_follows_the_device_plugin_for_application_xids():
    for xid in (13, 31, 43, 45, 68, 109):
        assert classify_xid(xid).cls is XidClass.APPLICATION
    for xid in (48, 64, 74, 95, 119, 120):
        assert classify_xid(xid).cls is XidClass.GPU_FAULT
    assert classify_xid(79).cls is XidClass.GPU_LOST
    assert classify_xid(100000).cls is XidClass.UNKNOWN


def test_numa_local_cores():
    assert cores_from_mask([0b1011, 1]) == (0, 1, 3, 64)
    aff = {"GPU-a": (0, 1, 2, 3), "GPU-b": (2, 3, 4), "GPU-c": (8, 9)}
    assert local_cores(aff, ["GPU-a", "GPU-b"]) == (2, 3)
    assert local_cores(aff, ["GPU-a", "GPU-c"]) == (0, 1, 2, 3, 8, 9)   # across NUMA nodes: the union
    assert local_cores(aff, ["GPU-x"]) == ()


def test_xid_events_polled_between_checks_keep_their_time():
    fake, checker = _checker(nvswitch_8gpu())
    checker.check()
    fake.inject_xid(4, 48)
    checker.clock.advance(7)
    assert checker.poll_events() == 1
    checker.clock.advance(23)
    [f] = checker.check()
    assert f.xid == 48 and f.observed_s == 1007.0        # when it was drained, not at the check
    assert checker.check() == []
