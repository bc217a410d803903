"""Placement: where replicas run. Pure policy over an `Inventory` and the devices in use.

Modules: `shapes` (request, plan and their parts), `slots` (free capacity and its index),
`freeindex` (free capacity kept across calls per inventory, and `DeviceUse`, the in-use map
that tells it what changed),
`strategies` (the registry, the shared decision, the ``first-fit`` strategy), `fleet_strategy`
(the default ``fleet`` strategy), `candidates` (the eligible nodes and the GPU product of a request),
`gangs` (replicas wider than a node), `explain` (reasons by node class), `mig_advice`
(repartition plans), `cpu` (CPU replicas), `preemption` (priorities: victims and hold-offs),
`fleet_plan` (several deployments at once with priorities and preemption: `fleet plan`). The
controller, `fleet up` and `fleet plan` call
`get_strategy(name).place_replicas(request, inventory, in_use) -> PlacementPlan`.
"""

from fleet.placement.freeindex import DeviceUse
from fleet.placement.shapes import (
    Assignment,
    MigAdvice,
    NodeClass,
    PlacementPlan,
    PlacementRequest,
    ReplicaPlacement,
    ReplicaShape,
    Unplaceable,
)
from fleet.placement.fleet_strategy import FleetStrategy
from fleet.placement.strategies import (
    DEFAULT_STRATEGY,
    FirstFitStrategy,
    PlacementStrategy,
    get_strategy,
    strategy_names,
)

__all__ = [
    "DEFAULT_STRATEGY", "Assignment", "DeviceUse", "FirstFitStrategy", "FleetStrategy", "MigAdvice", "NodeClass",
    "PlacementPlan", "PlacementRequest", "PlacementStrategy", "ReplicaPlacement", "ReplicaShape",
    "Unplaceable", "get_strategy", "strategy_names",
]
