"""The scale step: how many replicas to add for a target, and which to drain first.

Owns `scale_step`, the one decision the reconcile step (`fleet.controller.reconcile`) makes per
revision every tick and the trace simulators (`fleet.tracesim.engine`, `fleet.tracesim.rollout`)
make at every scaling decision, written once: below the target, add the difference; above it,
drain the least advanced replicas first (PENDING before PLACED before STARTING ... before READY,
in `ReplicaStatus` order: the ones that cost the least to give up), the newest first among equals.
Pure; no clock.
"""

from __future__ import annotations

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


def scale_step(active: Sequence[R], want: int, created: Callable[[R], float]) -> ScaleStep[R]:
    """The step from ``active`` replicas (those that count toward the target: not draining,
    terminated or failed) to ``want``. ``created(r)`` orders replicas by creation (a larger value
    is newer). Raises ValueError for a negative ``want``."""
    if want < 0:
        raise ValueError(f"want must be >= 0, got {want}")
    if len(active) < want:
        return ScaleStep(create=want - len(active))
    if len(active) == want:
        return ScaleStep()
    victims = sorted(active, key=lambda r: (_ORDER[r.status], -created(r)))
    return ScaleStep(drain=victims[: len(active) - want])
