"""Which replica to give up first on a scale-down, so that NVLink domains free up whole.

Owns `whole_domains_first`: the order in which to drain replicas of one deployment version so
that the GPUs they give back join the free GPUs already beside them. Removing the newest
replica (what the scale step did alone) frees GPUs wherever that replica happened to land,
often in a domain that stays busy; a later replica that needs a whole 8-GPU domain then finds
none. Here each step drains the replica whose NVLink domain will have the most free GPUs once
it is gone, as a share of the domain's healthy GPUs (a domain left entirely free first), then the
most free GPUs, then the newest (the caller's order). The steps are greedy: after each, the
drained replica's GPUs count as free. Gang members count per member domain (the least freed
member decides); MIG replicas and replicas on nodes the inventory no longer has keep the
caller's order, after the others. Called by `PlacementStrategy.drain_order`
(`fleet.placement.strategies`); measured in loadtests/bench_placement.py. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fleet.inventory.model import Inventory
from fleet.placement.shapes import ReplicaPlacement


def whole_domains_first(placements: Sequence[ReplicaPlacement], count: int, inventory: Inventory,
                        in_use: Mapping[str, int]) -> list[int]:
    """Indexes into ``placements`` (newest last) of the ``count`` replicas to drain, in order.

    ``in_use``: device id -> replicas holding it (the placements' own devices included).
    O(count x replicas x GPUs per domain).
    """
    # Each member's domain: (its healthy whole GPUs' UUIDs); None where it is not one.
    domains: list[list[tuple[frozenset[str], tuple[str, ...]]] | None] = []
    for p in placements:
        members: list[tuple[frozenset[str], tuple[str, ...]]] | None = []
        for m in p.members:
            node = inventory.by_name.get(m.node)
            dom = None
            if node is not None and m.devices:
                first = m.devices[0]
                for d in node.domains:
                    if any(g.uuid == first and not g.mig_enabled for g in d):
                        dom = frozenset(g.uuid for g in d if g.health.healthy and not g.mig_enabled)
                        break
            if dom is None or members is None:
                members = None
                continue
            members.append((dom, m.devices))
        domains.append(members)
    freed: set[str] = set()          # devices of replicas already in the order

    def free_after(dom: frozenset[str], devices: tuple[str, ...]) -> int:
        return sum(1 for u in dom if u in freed or u in devices or not in_use.get(u))

    order: list[int] = []
    left = [i for i, d in enumerate(domains) if d]
    while left and len(order) < count:
        def score(i: int) -> tuple:
            members = domains[i]
            assert members
            shares = [(free_after(dom, dev) / max(1, len(dom)), free_after(dom, dev)) for dom, dev in members]
            return (*min(shares), i)
        best = max(left, key=score)
        left.remove(best)
        order.append(best)
        freed.update(placements[best].devices)
    rest = [i for i, d in enumerate(domains) if not d]
    return (order + sorted(rest, reverse=True))[:count]
