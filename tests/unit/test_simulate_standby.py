"""Standby replicas in the trace simulator (fleet/tracesim/engine.py): a pool filled at the start,
a burst served by waking sleepers in the wake-up time instead of a start-up, the pool refilled at
once after a wake (the controller's lifecycle: tests/unit/test_standby_parity.py), standby time
counted in replica-hours, the pool sized by the policy's target, and no standby for fixed fleets
or with the allowance off."""

from __future__ import annotations

import pytest

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.controller.lifecycle import ReplicaStatus
from fleet.tracesim.compare import contender
from fleet.tracesim.config import SimConfig
from tests.unit.test_simulate import ONE_TO_SIX, config, fleet_spec, simulate


def standby_config(policy: str = "fleet", standby_max: int = 2, **kw: object) -> SimConfig:
    return config(fleet_spec(policy=policy), ONE_TO_SIX, standby_max=standby_max, wake_s=1.0, **kw)


def test_the_pool_fills_at_the_start_and_a_burst_wakes_it_in_the_wake_up_time() -> None:
    sim, result = simulate(standby_config())
    first = result.ticks[0]
    assert first.desired == 1 and first.starting == 2          # two refills start beside the one serving
    second = result.ticks[1]
    assert second.starting == 2 and second.decision.inputs["starting"] == 0   # refills are not in the target
    asleep = [t for t in result.ticks if t.standby == 2]
    assert asleep and asleep[0].at_s == pytest.approx(10.0, abs=2.0)   # READY after the warm start-up, then asleep
    assert result.wakes, "the burst must wake a standby replica"
    assert {seconds for _, seconds in result.wakes} == {1.0}
    woke_at = min(t.at_s for t in result.ticks if t.decision.desired > t.decision.previous)
    ready_after = min(t.at_s for t in result.ticks if t.at_s > woke_at and t.ready >= 2)
    assert ready_after - woke_at <= 2.0 + 1e-9                # one tick: far less than the 10 s start-up
    assert all(seconds == 10.0 for _, _, seconds in result.startups)


def test_standby_time_is_counted_in_replica_hours_and_a_wake_refills_the_pool_at_once() -> None:
    sim, result = simulate(standby_config())
    s = result.summary()
    assert s.standby_hours > 0 and s.wakes == len(result.wakes)
    total_s = sum(r.cost_s(result.horizon_s) for r in sim.replicas)
    assert s.replica_hours == pytest.approx(total_s / 3600)
    assert s.standby_hours == pytest.approx(sum(r.standby_s(result.horizon_s) for r in sim.replicas) / 3600)
    woke_at_s = min(r.woke_s for r in sim.replicas if r.woke_s is not None)
    refills = [r for r in sim.replicas if r.created_s == woke_at_s and r.standby_spans]
    assert refills, "a wake refills the pool at once, as the controller's trim_and_refill does"
    assert all(r.standby_spans[0][0] == r.ready_at_s for r in refills)   # asleep once READY, never serving first
    assert all(r.stopped_s is None for r in refills if r.status is ReplicaStatus.STANDBY)
    last = result.ticks[-1]
    assert last.standby == 2 and last.desired + last.standby == sum(
        1 for r in sim.replicas if r.status in (ReplicaStatus.READY, ReplicaStatus.STANDBY))
    assert s.failed == 0


def test_the_standby_policy_sizes_the_pool_and_the_allowance_caps_it() -> None:
    _, result = simulate(standby_config("standby", standby_max=1))
    assert max(t.standby for t in result.ticks) <= 1
    targets = [t.decision.standby for t in result.ticks]
    assert targets[0] == 2   # the starting pool (StandbyPoolSpec.initialReplicas), capped at 1 by the allowance


def test_no_standby_when_the_allowance_is_off_or_the_fleet_is_fixed() -> None:
    for cfg in (standby_config(standby_max=0), contender(standby_config(), "fixed-2")):
        sim, result = simulate(cfg)
        assert cfg.standby_max == 0
        assert not result.wakes and result.summary().standby_hours == 0
        assert all(not r.standby_spans for r in sim.replicas)


def test_bad_standby_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="standby_max and wake_s"):
        SimConfig(standby_config().profile, AutoscalingSpec(), ReplicaBounds(1, 2, 1), standby_max=-1)


def test_the_deployments_standby_spec_sizes_the_simulated_pool() -> None:
    """`fleet simulate` without --standby-max keeps what the deployment declares."""
    from fleet.enginesim.profiles import get_profile
    from fleet.spec import parse_document
    from fleet.tracesim.compare import config_from_deployment

    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "d"},
           "spec": {"model": {"name": "m", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"},
                    "standby": {"maxReplicas": 2}}}  # fmt: skip
    profile = get_profile("h100-llama-8b")
    assert config_from_deployment(parse_document(doc), profile).standby_max == 2
    del doc["spec"]["standby"]
    assert config_from_deployment(parse_document(doc), profile).standby_max == 0
    assert config_from_deployment(parse_document(doc), profile, standby_max=3).standby_max == 3
