"""Per-inventory product tables (fleet.placement.slots.product_table): derived once per
`Inventory` object, never served for another inventory or a changed in-use map."""

from __future__ import annotations

import gc
from collections import Counter

from fleet.inventory.model import GpuHealth, product_key
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from fleet.placement.slots import _TABLES, product_table
from tests.support.inventories import H100, busy, cluster, node

PK = product_key(H100)
TP2 = ReplicaShape(gpu_product=H100, tensor_parallel_size=2)


def place(inv, in_use=None, count=1):
    return get_strategy().place_replicas(PlacementRequest(TP2, count=count), inv, in_use or Counter())


def test_a_table_is_derived_once_per_inventory_object_and_product():
    inv = cluster(node("a"), node("b", mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]}))
    table = product_table(inv, PK)
    assert product_table(inv, PK) is table
    assert table.mig("3g.40gb") is table.mig("3g.40gb")
    assert (table.widest_node, table.largest_domain) == (8, 8)
    assert [(d.node.name, d.name, d.size, len(d.healthy)) for d in table.domains] == [("a", "nvlink0", 8, 8),
                                                                                   ("b", "nvlink0", 7, 7)]
    # An equal but distinct inventory object gets a table of its own.
    assert product_table(cluster(*inv.nodes), PK) is not table


def test_the_in_use_map_is_read_on_every_call():
    inv = cluster(node("a"))
    assert place(inv).placements[0].devices == ("GPU-a-0", "GPU-a-1")
    assert place(inv, busy(inv.nodes[0], 0, 1)).placements[0].devices == ("GPU-a-2", "GPU-a-3")
    assert place(inv, busy(inv.nodes[0], *range(8))).placements == ()
    assert place(inv).placements[0].devices == ("GPU-a-0", "GPU-a-1")


def test_a_new_inventory_with_a_gpu_gone_unhealthy_is_not_served_the_old_table():
    healthy = cluster(node("a", n=2))
    assert place(healthy).complete
    sick = cluster(node("a", n=2, sick={0: GpuHealth(ecc_uncorrected=1)}))   # same names and UUIDs
    assert place(sick).placements == ()
    assert place(healthy).complete


def test_a_table_goes_with_its_inventory():
    inv = cluster(node("a"))
    product_table(inv, PK)
    key = id(inv)
    assert key in _TABLES
    del inv
    gc.collect()
    assert key not in _TABLES
