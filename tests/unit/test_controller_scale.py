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
