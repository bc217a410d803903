"""What a placement strategy's ranking hooks read while one request is placed.

Owns `Context`: the request, the warmth of every node, and the spread counts (replicas of the
deployment per node, zone, rack and gang block) that start from the version's existing replicas
and grow with every replica the batch places. Built by `fleet.placement.strategies`; read by the
strategies' hooks and by the gang loop (`fleet.placement.gangs`). Pure data.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field

from fleet.inventory.model import NodeInventory
from fleet.placement.shapes import PlacementRequest


@dataclass
class Context:
    """What a strategy's hooks may read while one request is placed. Spread counts start from
    the version's existing replicas and grow with every replica the batch places."""

    request: PlacementRequest
    warm: dict[str, int]              # node -> PlacementRequest.warmth (WARM: image and weights)
    node_free: Counter[str] = field(default_factory=Counter)     # free units of the kind, per node
    node_count: Counter[str] = field(default_factory=Counter)    # replicas of the deployment, per node
    zone_count: Counter[str | None] = field(default_factory=Counter)
    rack_count: Counter[tuple] = field(default_factory=Counter)
    block_count: Counter[Hashable] = field(default_factory=Counter)
    replicas: int = 0                                             # of the version, existing and placed

    def record(self, node: NodeInventory, block: Hashable = None, first: bool = True) -> None:
        """One more replica of the deployment on ``node``. A gang records each member, with
        ``first`` (and its ``block``) only on the first."""
        self.node_count[node.name] += 1
        self.zone_count[node.zone] += 1
        self.rack_count[(node.zone, node.rack)] += 1
        if block is not None:
            self.block_count[block] += 1
        self.replicas += first
