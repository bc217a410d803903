"""Quarantine that is never withheld when the fault is certain, and that survives an agent
restart: the pure policy on a fake clock, the state's JSON form, and `NodeAgent` over the stand-in
NVML (fleet/testing/fake_nvml.py) with its state file."""

from __future__ import annotations

import json

import pytest

from fleet.agent.health import Finding, GpuHealthChecker, Severity
from fleet.agent.nvml_health import NvmlHealthReader
from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy, QuarantineState, TargetState
from fleet.agent.runner import NodeAgent, load_state, save_state
from fleet.agent.xid import CERTAIN_XIDS, XidClass, classify_xid
from fleet.testing.fake_nvml import FakePynvml, nvswitch_8gpu, pcie_4gpu
from tests.support.fakes import FakeClock

CFG = QuarantineConfig()   # the defaults: 25% cap, 600 s hold-off, Xids evidence for 3600 s


def _gpus(n: int) -> dict[str, tuple[str, float]]:
    return {f"GPU-{i}": (f"GPU-{i}", 1.0) for i in range(n)}


def _f(clock, target, check="ecc_uncorrected", severity=Severity.FAULT, certain=False, event=False, xid=None):
    return Finding(target, target, check, severity, check, clock(), event=event, xid=xid, certain=certain)


@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_a_certain_fault_is_quarantined_on_a_small_node_past_the_cap(gpus):
    clock = FakeClock()
    policy = QuarantinePolicy(CFG, clock)
    state, ds = policy.decide(QuarantineState(), [_f(clock, "GPU-0", certain=True)], _gpus(gpus), gpus)
    [d] = ds
    assert (d.target, d.action) == ("GPU-0", "quarantine")
    assert "past the cap" in d.reason and "certain hardware fault" in d.reason
    assert set(state.quarantined()) == {"GPU-0"}


def test_on_a_small_node_an_uncertain_fault_and_a_degraded_gpu_are_still_capped():
    clock = FakeClock()
    policy = QuarantinePolicy(CFG, clock)
    gsp = _f(clock, "GPU-1", "xid", event=True, xid=119)   # GSP timeout: may be the driver's, fleet-wide
    state, ds = policy.decide(QuarantineState(), [gsp], _gpus(2), 2)
    assert [(d.target, d.action) for d in ds] == [("GPU-1", "withheld")]
    hot = [_f(clock, "GPU-0", "throttle", Severity.DEGRADED)]
    state, _ = policy.decide(state, hot, _gpus(2), 2)
    clock.advance(60)
    state, ds = policy.decide(state, hot, _gpus(2), 2)
    assert [(d.target, d.action) for d in ds] == [("GPU-0", "withheld")] and state.quarantined() == {}


def test_certain_faults_take_their_places_first_and_count_against_the_cap():
    clock = FakeClock()
    policy = QuarantinePolicy(CFG, clock)
    findings = [_f(clock, "GPU-0", "xid", event=True, xid=74),        # NVLink: a fault, not certain
                _f(clock, "GPU-1", certain=True), _f(clock, "GPU-2", certain=True), _f(clock, "GPU-3", certain=True)]
    state, ds = policy.decide(QuarantineState(), findings, _gpus(8), 8)   # the cap: 2 of 8
    assert sorted((d.target, d.action) for d in ds) == [
        ("GPU-0", "withheld"), ("GPU-1", "quarantine"), ("GPU-2", "quarantine"), ("GPU-3", "quarantine")]


def test_a_certain_xid_stays_certain_for_its_evidence_window_after_being_withheld_by_nothing():
    """A certain Xid seen once keeps quarantining past the cap while it is evidence, e.g. after a
    lift-and-retry: here the state is restored (restart) before the decision."""
    clock = FakeClock()
    policy = QuarantinePolicy(CFG, clock)
    xid79 = _f(clock, "GPU-1", "xid", certain=True, event=True, xid=79)
    state, _ = policy.decide(QuarantineState(), [xid79], _gpus(2), 2)
    assert state.targets["GPU-1"].certain_xid_s == clock()
    # Wipe the quarantine but keep the evidence: the next step quarantines again, past the cap.
    state = QuarantineState({"GPU-1": TargetState(xid_fault_s=clock(), certain_xid_s=clock())})
    clock.advance(1800)
    state, ds = policy.decide(state, [], _gpus(2), 2)
    assert [(d.target, d.action) for d in ds] == [("GPU-1", "quarantine")]


def test_the_catalogue_marks_hardware_faults_certain_and_firmware_faults_not():
    for xid in (48, 63, 64, 79, 94, 95, 140):
        info = classify_xid(xid)
        assert info.certain and info.cls in (XidClass.GPU_FAULT, XidClass.GPU_LOST), xid
    for xid in (13, 31, 43, 45, 61, 62, 74, 92, 119, 120, 4242):
        assert not classify_xid(xid).certain, xid
    assert CERTAIN_XIDS <= set(range(1, 200))


def test_the_state_round_trips_through_json():
    clock = FakeClock()
    policy = QuarantinePolicy(CFG, clock)
    state, _ = policy.decide(QuarantineState(), [
        _f(clock, "GPU-0", "xid", certain=True, event=True, xid=48),
        _f(clock, "GPU-1", "xid", Severity.SUSPECT, event=True, xid=4242),
        _f(clock, "GPU-2", "throttle", Severity.DEGRADED)], _gpus(8), 8)
    doc = json.loads(json.dumps(state.to_json()))
    assert doc["format"] == 1 and doc["targets"]["GPU-1"]["suspect_s"] == [clock()]
    assert QuarantineState.from_json(doc) == state


@pytest.mark.parametrize("doc, message", [
    ([], "not a quarantine state"),
    ({"format": 9, "targets": {}}, "format 9"),
    ({"format": 1, "targets": {"GPU-0": 3}}, "GPU-0"),
    ({"format": 1, "targets": {"GPU-0": {"xid_fault_s": "soon"}}}, "GPU-0"),
])
def test_a_bad_state_document_is_refused_naming_the_problem(doc, message):
    with pytest.raises(ValueError, match=message):
        QuarantineState.from_json(doc)


def test_load_state_sets_a_broken_file_aside_and_starts_empty(tmp_path):
    path = tmp_path / "quarantine.json"
    assert load_state(path) == QuarantineState()                      # no file: nothing quarantined
    path.write_text("{not json")
    assert load_state(path) == QuarantineState()
    assert not path.exists() and (tmp_path / "quarantine.json.bad").read_text() == "{not json"
    state = QuarantineState({"GPU-0": TargetState(quarantined_since_s=5.0, reason="ecc")})
    save_state(path, state)
    assert load_state(path) == state and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _agent(fake, clock, state_path, **kw):
    checker = GpuHealthChecker(NvmlHealthReader(fake), clock)
    return NodeAgent("node-a", checker, QuarantinePolicy(CFG, clock), clock, state_path=state_path, **kw)


def test_an_agent_restart_keeps_the_quarantine_and_lifts_it_on_the_same_schedule(tmp_path):
    clock = FakeClock(1_764_000_000.0)
    state_path = tmp_path / ".agent" / "quarantine.json"
    fake = FakePynvml(pcie_4gpu())
    agent = _agent(fake, clock, state_path)
    agent.step()
    assert not state_path.exists()                                    # nothing decided, nothing written
    uuid = fake.snap["devices"][1]["uuid"]
    fake.inject_xid(1, 79)
    [d] = agent.step()
    assert (d.target, d.action) == (uuid, "quarantine")               # 4 GPUs: the cap is 1; certain anyway
    saved = json.loads(state_path.read_text())
    assert saved["targets"][uuid]["quarantined_since_s"] == clock()
    since = clock()
    # The process dies; a new one starts over a fresh NVML (the Xid event is not delivered again).
    clock.advance(120)
    restarted = _agent(FakePynvml(pcie_4gpu()), clock, state_path)
    assert restarted.step() == []
    [q] = restarted.status()["quarantined"]
    assert q["gpu"] == uuid and q["since_s"] == since and "Xid 79" in q["reason"]
    clock.advance(3600 + 600 - 120 - 1)
    assert restarted.step() == []                                     # still evidence + hold-off
    clock.advance(1)
    [d] = restarted.step()
    assert d.action == "lift" and json.loads(state_path.read_text())["targets"] == {}


def test_a_healthy_node_writes_no_state_and_a_fault_writes_it_at_once(tmp_path):
    clock = FakeClock()
    state_path = tmp_path / "q.json"
    fake = FakePynvml(nvswitch_8gpu())
    agent = _agent(fake, clock, state_path)
    agent.step()
    clock.advance(10)
    agent.step()
    assert not state_path.exists()
    fake.inject(2, ecc_volatile_uncorrected=1)
    [d] = agent.step()
    assert d.action == "quarantine" and load_state(state_path) == agent.state


def test_status_carries_no_credentials_of_cached_sources(tmp_path):
    class Cache:
        def entries(self):
            from types import SimpleNamespace
            return [SimpleNamespace(key="k", source="https://u:secret@h.example/m/?X-Amz-Signature=abc",
                                    revision="r", size_bytes=1, pinned_by=(), last_used_s=0.0)]

        def blob_bytes(self):
            return 1

        budget_bytes = None

        def verify(self, key):
            return []

    clock = FakeClock()
    agent = NodeAgent("node-a", None, QuarantinePolicy(CFG, clock), clock, cache=Cache())
    agent.step()
    text = json.dumps(agent.last_status)
    assert "secret" not in text and "Signature" not in text
    assert agent.last_status["cache"][0]["source"] == "https://h.example/m/"
