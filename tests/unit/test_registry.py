"""One registry helper for every kind of named implementation (fleet/base/registry.py), and the five
kinds that use it: unknown names are refused naming the kind and the known names, a name is taken
once, and an unnamed intermediate class is not registered."""

from __future__ import annotations

import pytest

from autoscaler.spec import SCALING_POLICIES
from fleet.engines.kinds import ENGINE_KINDS
from fleet.placement.strategies import PLACEMENT_STRATEGIES
from fleet.rollout.judges import JUDGES
from router.pools.policies import ROUTING_POLICIES
from fleet.base.registry import Registered, Registry


def test_names_register_once_and_unnamed_classes_stay_out() -> None:
    shapes: Registry = Registry("shape")

    class Shape(Registered, registry=shapes):
        pass

    class Round(Shape):   # an intermediate: no name, not registered
        pass

    class Circle(Round, name="circle"):
        pass

    assert shapes.names() == ["circle"] and shapes.get("circle") is Circle and Circle.name == "circle"
    with pytest.raises(ValueError, match="shape 'circle' is already registered by"):
        class Other(Shape, name="circle"):   # noqa: F841 - the class statement is the test
            pass
    with pytest.raises(KeyError, match="unknown shape 'square'; known: circle"):
        shapes.get("square")
    with pytest.raises(ValueError, match="unknown shape 'square'; known: circle"):
        shapes.check("square")
    assert shapes.check("circle") == "circle"


@pytest.mark.parametrize("registry, names", [
    (ROUTING_POLICIES, {"cache-aware", "kv-aware", "latency-aware", "least-outstanding", "round-robin"}),
    (SCALING_POLICIES, {"fleet", "fixed", "keda-queue", "kpa", "standby"}),  # complete without importing autoscaler.baselines
    (PLACEMENT_STRATEGIES, {"fleet", "first-fit"}),
    (ENGINE_KINDS, {"vllm", "sim"}),
    (JUDGES, {"fleet", "abs-p99", "success-rate"}),
])
def test_every_kind_holds_its_built_in_implementations(registry: Registry, names: set[str]) -> None:
    assert set(registry.names()) == names
