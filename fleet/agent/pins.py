"""Weight-cache pins of engine pods that are gone, released.

On Kubernetes an engine pod's init container pins the model it fetched for the pod
(`fleet cache pull --holder $(POD_UID)`, fleet/k8s/pod_weights.py), so eviction never takes weights a
running engine reads. Nothing in the pod unpins when it goes (the engine's image has no Fleet),
so the node agent does: `DepartedPodPins.step` compares the pins whose holder is a pod UID with
the pods the kubelet's PodResources API lists now with NVIDIA devices (`fleet.agent.pod_devices`,
each pod's uid got by `fleet.k8s.node_facts.PodUids`).

A holder is released when the kubelet answered and does not list it, and either this agent
saw it listed before (the pod held GPUs and left), or its pin is older than
``orphan_after_s`` (a pod that left while no agent ran). An engine pod without GPUs never
appears there: its pin lasts ``orphan_after_s`` (the model is then only evictable,
fetched again if needed). Pure apart from the cache it is given; time from the injected clock.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from fleet.agent.cache import WeightCache

POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
ORPHAN_AFTER_S = 24 * 3600.0


class DepartedPodPins:
    def __init__(self, clock: Callable[[], float], orphan_after_s: float = ORPHAN_AFTER_S) -> None:
        self.clock = clock
        self.orphan_after_s = orphan_after_s
        self.seen: set[str] = set()

    def step(self, cache: WeightCache, allocations: Mapping[str, object] | None) -> list[tuple[str, str]]:
        """Release the pins of departed pods; returns ``[(cache key, pod uid)]`` released.
        ``allocations``: ``{pod uid: devices}`` of the pods holding GPUs now, None when the
        kubelet gave no answer or a pod's uid is unknown (then nothing is released)."""
        if allocations is None:
            return []
        current = set(allocations)
        self.seen |= current
        now, released = self.clock(), []
        for entry in cache.entries():
            for holder in entry.pinned_by:
                if not POD_UID.match(holder) or holder in current:
                    continue
                if holder in self.seen or now - cache.pinned_at(entry.key, holder) >= self.orphan_after_s:
                    cache.unpin(entry.key, holder)
                    released.append((entry.key, holder))
        self.seen &= current
        return released
