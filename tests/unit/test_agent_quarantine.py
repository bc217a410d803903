"""The quarantine policy (pure, fake clock) and the node agent's step over the stand-in NVML:
quarantine, hold-off, lift, the cap, application Xids, metrics and status."""

from __future__ import annotations

import os

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleet.agent.health import Finding, GpuHealthChecker, Severity
from fleet.agent.nvml_health import NvmlHealthReader
from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy, QuarantineState
from fleet.agent.runner import NodeAgent, status_lines
from tests.support.fake_nvml import FakePynvml, mig_h100, nvswitch_8gpu
from tests.support.fakes import FakeClock

GPUS = {f"GPU-{i}": (f"GPU-{i}", 1.0) for i in range(8)}
CFG = QuarantineConfig(hold_off_s=600, degraded_after_s=60, xid_evidence_s=3600, unknown_xid_repeats=3,
                       suspect_window_s=600, max_quarantined_share=0.25)


def _f(clock, target, check="ecc_uncorrected", severity=Severity.FAULT, event=False, xid=None):
    return Finding(target, target, check, severity, check, clock(), event=event, xid=xid)


def _policy(clock, **kw):
    from dataclasses import replace
    return QuarantinePolicy(replace(CFG, **kw), clock)


def test_a_fault_quarantines_at_once_and_lifts_after_the_hold_off_once_clear():
    clock = FakeClock()
    policy = _policy(clock)
    state, ds = policy.decide(QuarantineState(), [_f(clock, "GPU-1")], GPUS, 8)
    assert [(d.target, d.action) for d in ds] == [("GPU-1", "quarantine")]
    assert "ecc_uncorrected" in state.quarantined()["GPU-1"]
    clock.advance(300)
    state, ds = policy.decide(state, [_f(clock, "GPU-1")], GPUS, 8)   # still there: no decision
    assert ds == [] and "GPU-1" in state.quarantined()
    clock.advance(30)
    state, ds = policy.decide(state, [], GPUS, 8)                      # clear from now on
    clock.advance(569)
    state, ds = policy.decide(state, [], GPUS, 8)
    assert ds == [] and "GPU-1" in state.quarantined()                 # 599 s < hold-off
    clock.advance(1)
    state, ds = policy.decide(state, [], GPUS, 8)
    assert [(d.target, d.action) for d in ds] == [("GPU-1", "lift")] and state.quarantined() == {}


def test_a_degraded_condition_must_persist():
    clock = FakeClock()
    policy = _policy(clock)
    hot = lambda: [_f(clock, "GPU-2", "throttle", Severity.DEGRADED)]   # noqa: E731
    state, ds = policy.decide(QuarantineState(), hot(), GPUS, 8)
    clock.advance(30)
    state, ds = policy.decide(state, [], GPUS, 8)                      # it went away: the clock restarts
    clock.advance(30)
    state, ds = policy.decide(state, hot(), GPUS, 8)
    clock.advance(59)
    state, ds = policy.decide(state, hot(), GPUS, 8)
    assert ds == []
    clock.advance(1)
    state, ds = policy.decide(state, hot(), GPUS, 8)
    assert [(d.target, d.action) for d in ds] == [("GPU-2", "quarantine")]


def test_an_application_xid_burst_on_every_gpu_quarantines_nothing():
    clock = FakeClock()
    policy = _policy(clock)
    burst = [_f(clock, g, "xid", Severity.APPLICATION, event=True, xid=45) for g in GPUS for _ in range(20)]
    state, ds = policy.decide(QuarantineState(), burst, GPUS, 8)
    assert ds == [] and state.quarantined() == {}


def test_unknown_xids_quarantine_only_when_they_repeat_within_the_window():
    clock = FakeClock()
    policy = _policy(clock)
    odd = lambda: [_f(clock, "GPU-4", "xid", Severity.SUSPECT, event=True, xid=4242)]   # noqa: E731
    state, _ = policy.decide(QuarantineState(), odd(), GPUS, 8)
    clock.advance(601)
    state, _ = policy.decide(state, odd(), GPUS, 8)                    # the first one fell out of the window
    clock.advance(10)
    state, ds = policy.decide(state, odd(), GPUS, 8)
    assert ds == []
    clock.advance(10)
    state, ds = policy.decide(state, odd(), GPUS, 8)
    assert [(d.target, d.action) for d in ds] == [("GPU-4", "quarantine")]


def test_an_xid_fault_stays_evidence_for_its_window_then_the_hold_off_runs():
    clock = FakeClock()
    policy = _policy(clock)
    state, ds = policy.decide(QuarantineState(), [_f(clock, "GPU-5", "xid", Severity.FAULT, event=True, xid=48)],
                              GPUS, 8)
    assert [d.action for d in ds] == ["quarantine"]
    clock.advance(3600 + 599)
    state, ds = policy.decide(state, [], GPUS, 8)
    assert ds == []
    clock.advance(60)
    state, ds = policy.decide(state, [], GPUS, 8)
    assert [d.action for d in ds] == ["lift"]


def test_the_cap_withholds_beyond_the_share_and_says_so_once():
    clock = FakeClock()
    policy = _policy(clock)
    findings = [_f(clock, "GPU-0", "throttle", Severity.DEGRADED)]
    state, _ = policy.decide(QuarantineState(), findings, GPUS, 8)
    clock.advance(60)
    faults = [_f(clock, g) for g in ("GPU-1", "GPU-2")] + [_f(clock, "GPU-0", "throttle", Severity.DEGRADED)]
    state, ds = policy.decide(state, faults, GPUS, 8)
    # 25% of 8 GPUs = 2: both faults get the places before the degraded GPU.
    assert sorted((d.target, d.action) for d in ds) == [
        ("GPU-0", "withheld"), ("GPU-1", "quarantine"), ("GPU-2", "quarantine")]
    assert "cap is 25%" in next(d.reason for d in ds if d.action == "withheld")
    clock.advance(10)
    state, ds = policy.decide(state, faults, GPUS, 8)
    assert ds == []                                                    # no alert storm
    assert set(state.quarantined()) == {"GPU-1", "GPU-2"} and state.targets["GPU-0"].withheld


def test_mig_instances_weigh_their_share_of_a_gpu():
    clock = FakeClock()
    policy = _policy(clock, max_quarantined_share=0.125)              # one GPU's worth of 8
    targets = dict(GPUS, **{f"MIG-{j}": ("GPU-7", 0.5) for j in range(2)})
    state, ds = policy.decide(QuarantineState(), [_f(clock, "MIG-0"), _f(clock, "MIG-1")], targets, 8)
    assert sorted(d.action for d in ds) == ["quarantine", "quarantine"]
    state, ds = policy.decide(state, [_f(clock, "MIG-0"), _f(clock, "MIG-1"), _f(clock, "GPU-3")], targets, 8)
    assert [(d.target, d.action) for d in ds] == [("GPU-3", "withheld")]


@pytest.mark.parametrize("kw, message", [
    ({"max_quarantined_share": 1.5}, "max_quarantined_share"),
    ({"hold_off_s": -1}, "hold_off_s"),
    ({"unknown_xid_repeats": 0}, "unknown_xid_repeats"),
])
def test_config_errors_name_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        QuarantineConfig(**kw)


def _agent(snapshot, clock, **kw):
    fake = FakePynvml(snapshot)
    checker = GpuHealthChecker(NvmlHealthReader(fake), clock)
    registry = CollectorRegistry()
    agent = NodeAgent("node-a", checker, QuarantinePolicy(CFG, clock), clock, registry=registry, **kw)
    return fake, agent, registry


def _metric(registry, line_start):
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith(line_start)]


def test_node_agent_quarantines_a_faulty_gpu_exports_it_and_lifts_it_after_repair(tmp_path):
    clock = FakeClock()
    events = []
    fake, agent, registry = _agent(nvswitch_8gpu(), clock, status_path=tmp_path / "agent.json",
                                   on_decision=events.append)
    assert agent.step() == []
    uuid = fake.snap["devices"][6]["uuid"]
    assert _metric(registry, f'fleet_gpu_quarantined{{gpu="{uuid}",node="node-a"}}') == [
        f'fleet_gpu_quarantined{{gpu="{uuid}",node="node-a"}} 0.0']
    fake.inject(6, ecc_volatile_uncorrected=1)
    fake.inject_xid(6, 48)
    [d] = agent.step()
    assert (d.target, d.action) == (uuid, "quarantine") and events == [d]
    assert _metric(registry, f'fleet_gpu_quarantined{{gpu="{uuid}",node="node-a"}}')[0].endswith(" 1.0")
    assert _metric(registry, f'fleet_gpu_xid_events_total{{gpu="{uuid}",node="node-a",xid="48"')
    status = agent.status()
    assert status["quarantined"][0]["gpu"] == uuid and "ecc_uncorrected" in status["quarantined"][0]["reason"]
    assert (tmp_path / "agent.json").is_file()
    [line] = status_lines(status)
    assert line.startswith(f"node-a {uuid} quarantined since ") and "ecc_uncorrected" in line
    fake.heal(6)                                   # the GPU was reset
    clock.advance(3600 + 600)
    [d] = agent.step()
    assert d.action == "lift"
    assert _metric(registry, f'fleet_gpu_quarantined{{gpu="{uuid}",node="node-a"}}')[0].endswith(" 0.0")
    assert _metric(registry, 'fleet_gpu_quarantine_decisions_total{action="lift",node="node-a"} 1.0')


def test_node_agent_survives_a_failing_check():
    clock = FakeClock()
    fake, agent, registry = _agent(nvswitch_8gpu(), clock)

    def boom():
        raise ValueError("bad reading")
    agent.checker.check = boom
    assert agent.step() == []
    assert agent.last_error == "health: ValueError: bad reading"
    assert _metric(registry, 'fleet_node_agent_check_errors_total{node="node-a"} 1.0')


def test_node_agent_mig_instance_quarantined_alone():
    clock = FakeClock()
    fake, agent, _ = _agent(mig_h100([[("3g.40gb", 0), ("3g.40gb", 4)]] * 4), clock)
    agent.step()
    fake.inject_xid(2, 94, gpu_instance_id=1)
    [d] = agent.step()
    assert d.target == "MIG-2-0" and d.action == "quarantine"


def test_node_agent_re_hashes_cached_models_in_turn(tmp_path):
    from fleet.agent.cache import WeightCache
    from fleet.sources import write_manifest
    from fleet.testing.hub_server import HubServer

    clock = FakeClock()
    static = tmp_path / "static"
    for name in ("a", "b"):
        (static / name).mkdir(parents=True)
        (static / name / "w.bin").write_bytes(name.encode() * 5000)
        write_manifest(static / name)
    cache = WeightCache(tmp_path / "cache", reserve_bytes=0, clock=clock)
    with HubServer(static_root=static) as server:
        paths = [cache.ensure(f"{server.url}/static/{n}/") for n in ("a", "b")]
    blob = (paths[1] / "w.bin").resolve()
    blob.chmod(0o644)
    st = blob.stat()
    blob.write_bytes(b"x" * 10000)                                  # same size, mtime restored:
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))             # only a re-hash finds it
    registry = CollectorRegistry()
    agent = NodeAgent("node-a", None, QuarantinePolicy(CFG, clock), clock, cache=cache, registry=registry,
                      verify_every_s=60)
    agent.step()                                                    # verifies one model: a
    assert _metric(registry, 'fleet_weight_cache_corrupt_files_total{node="node-a"} 0.0')
    clock.advance(30)
    agent.step()                                                    # not due yet
    assert not [e for e in agent.events if e["action"] == "cache_corrupt"]
    clock.advance(30)
    agent.step()                                                    # b: found and deleted
    assert _metric(registry, 'fleet_weight_cache_corrupt_files_total{node="node-a"} 1.0')
    [event] = [e for e in agent.events if e["action"] == "cache_corrupt"]
    assert event["target"] == paths[1].name and "w.bin" in event["reason"]
    assert not blob.exists()


def test_node_agent_serves_metrics_and_status_over_http():
    import httpx

    from fleet.agent.runner import serve

    clock = FakeClock()
    fake, agent, _ = _agent(nvswitch_8gpu(), clock)
    fake.inject(1, ecc_volatile_uncorrected=3)
    agent.step()
    server = serve(agent, "127.0.0.1", 0)
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        uuid = fake.snap["devices"][1]["uuid"]
        status = httpx.get(f"{base}/status").json()
        assert [q["gpu"] for q in status["quarantined"]] == [uuid]
        assert f'fleet_gpu_quarantined{{gpu="{uuid}",node="node-a"}} 1.0' in httpx.get(f"{base}/metrics").text
        assert httpx.get(f"{base}/healthz").text == "ok\n"
        assert httpx.get(f"{base}/nope").status_code == 404
    finally:
        server.shutdown()
        server.server_close()


def test_a_certain_xid_between_steps_is_acted_on_at_once_an_application_one_waits(monkeypatch):
    """`NodeAgent.run` with a period of an hour: an Xid 79 drained between steps makes the next
    step now (its GPU quarantined), an application Xid (13) waits for the period."""
    import threading

    from fleet.agent import runner
    from tests.support.waits import wait_until

    monkeypatch.setattr(runner, "EVENT_POLL_S", 0.01)
    steps: list[dict] = []
    fake, agent, _ = _agent(nvswitch_8gpu(), FakeClock(), on_step=steps.append)
    stop = threading.Event()
    thread = threading.Thread(target=agent.run, args=(3600.0, stop), daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(steps) == 1, 10, what="the first step")
        fake.inject_xid(2, 13)
        wait_until(lambda: agent.checker.pending_events, 10, what="the application Xid drained")
        assert len(steps) == 1 and not agent.checker.fault_pending()
        fake.inject_xid(5, 79)
        wait_until(lambda: len(steps) == 2, 10, what="a step at once after the Xid 79")
        assert [q["gpu"] for q in steps[-1]["quarantined"]] == [fake.snap["devices"][5]["uuid"]], steps[-1]
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
