"""Inventory: what the fleet's nodes offer to replicas (GPUs, MIG instances, NVLink domains,
health, failure domains, warm caches), and where that knowledge comes from.

Modules: `model` (the data model), `mig` (MIG profile tables and placement rules), `nvml`
(discovery on this machine), `gfd` (Kubernetes node labels), `file` (the inventory YAML).
Placement (`fleet.placement`) reads the model; nothing here imports placement.
"""

from fleet.inventory.model import (
    CLOCK_EVENT_BITS,
    Gpu,
    GpuHealth,
    Inventory,
    MigInstance,
    NodeInventory,
    product_key,
)
from fleet.inventory.nvml import NvmlReader, PynvmlReader, discover_local, node_from_nvml

__all__ = [
    "CLOCK_EVENT_BITS", "Gpu", "GpuHealth", "Inventory", "MigInstance", "NodeInventory", "NvmlReader",
    "PynvmlReader", "discover_local", "node_from_nvml", "product_key",
]
