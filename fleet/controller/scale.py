"""The scale step: how many replicas to add for a target, and which to drain first.

Owns `scale_step`, the one decision the reconcile step (`fleet.controller.reconcile`) makes per
revision every tick and the trace simulators (`fleet.tracesim.engine`, `fleet.tracesim.rollout`)
make at every scaling decision, written once: below the target, add the difference; above it,
drain the least advanced replicas first (PENDING before PLACED before STARTING ... before READY,
in `ReplicaStatus` order: the ones that cost the least to give up); among equals, the newest
first, or the order ``prefer`` gives (the controller asks placement which replicas free NVLink
domains whole: `fleet.placement.strategies.PlacementStrategy.drain_order`). Pure; no clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from fleet.controller.lifecycle import ReplicaStatus


class HasStatus(Protocol):
    @property
    def status(self) -> ReplicaStatus: ...


R = TypeVar("R", bound=HasStatus)

_ORDER = {s: i for i, s in enumerate(ReplicaStatus)}


@dataclass(frozen=True)
class ScaleStep(Generic[R]):
    """``create``: replicas to add; ``drain``: replicas to drain, in the order to drain them."""

    create: int = 0
    drain: list[R] = field(default_factory=list)


def scale_step(active: Sequence[R], want: int, created: Callable[[R], float],
               prefer: Callable[[list[R], int], list[R]] | None = None) -> ScaleStep[R]:
    """The step from ``active`` replicas (those that count toward the target: not draining,
    terminated or failed) to ``want``. ``created(r)`` orders replicas by creation (a larger value
    is newer). ``prefer(equals, n)``: the ``n`` of ``equals`` (replicas of one status, newest
    first, of which only some drain) to drain, best first. Raises ValueError for a negative ``want``."""
    if want < 0:
        raise ValueError(f"want must be >= 0, got {want}")
    if len(active) < want:
        return ScaleStep(create=want - len(active))
    if len(active) == want:
        return ScaleStep()
    victims = sorted(active, key=lambda r: (_ORDER[r.status], -created(r)))
    n = len(active) - want
    if prefer is not None:
        chosen: list[R] = []
        for _, group in itertools.groupby(victims, key=lambda r: r.status):
            equals = list(group)
            if len(chosen) + len(equals) <= n:
                chosen += equals
            else:
                chosen += prefer(equals, n - len(chosen))[: n - len(chosen)]
            if len(chosen) >= n:
                break
        victims = chosen
    return ScaleStep(drain=victims[:n])
