"""The scale step the controller and both trace simulators take (fleet/controller/scale.py)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.controller.scale import scale_step


@dataclass
class R:
    name: str
    status: S
    created: int


def test_below_the_target_adds_the_difference_and_drains_nothing() -> None:
    step = scale_step([R("a", S.READY, 0)], 3, lambda r: r.created)
    assert step.create == 2 and step.drain == []
    assert scale_step([R("a", S.READY, 0)], 1, lambda r: r.created).create == 0


def test_above_the_target_drains_the_least_advanced_first_then_the_newest() -> None:
    active = [R("old-ready", S.READY, 0), R("new-ready", S.READY, 3), R("starting", S.STARTING, 1),
              R("pending", S.PENDING, 2), R("warming", S.WARMING, 4)]
    assert [r.name for r in scale_step(active, 2, lambda r: r.created).drain] == ["pending", "starting", "warming"]
    assert [r.name for r in scale_step(active, 0, lambda r: r.created).drain] == [
        "pending", "starting", "warming", "new-ready", "old-ready"]


def test_a_negative_target_is_refused() -> None:
    with pytest.raises(ValueError, match="want must be >= 0"):
        scale_step([], -1, lambda r: 0)


async def test_a_spent_tick_budget_leaves_the_rest_of_the_placements_to_the_next_tick(tmp_path):
    """1,000 deployments appearing at once must not make one tick hold them all (the operator's
    Lease and event loop): with no budget, each tick places one deployment's scale-up; the
    others wait, saying why, and follow tick by tick."""
    from fleet.controller.reconcile import Controller, ControllerSettings
    from fleet.spec import load_deployments
    from tests.support.controller import CPU_NODE, write_deployment
    from tests.support.fakes import FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink

    files = [write_deployment(tmp_path, name=f"d{i}", replicas=1) for i in range(3)]
    clock = FakeClock()
    c = Controller(load_deployments(files), backend=FakeBackend(CPU_NODE), engine_api=FakeEngineAPI(),
                   pool_sink=FakePoolSink(), clock=clock, sleep=clock.sleep,
                   settings=ControllerSettings(tick_budget_s=0.0))  # fmt: skip
    await c.start(None)
    await c.reconcile_once()
    placed = {r.deployment for r in c.replicas.values() if r.placement is not None}
    assert len(placed) == 1
    waiting = [c._waiting[r.id] for r in c.replicas.values() if r.placement is None]
    assert len(waiting) == 2 and all("next tick" in w for w in waiting)
    for _ in range(2):
        await c.reconcile_once()
    assert all(r.placement is not None for r in c.replicas.values())
