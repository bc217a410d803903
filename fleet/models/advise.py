"""Shape advice: which replica shapes can hold a model, how many sequences each serves, and
which is cheapest for a target.

Owns `GpuProductInfo` and `COMMON_GPU_PRODUCTS` (memory of GPU products as NVML reports them,
for advice without an inventory), `products_of` (the products and MIG profiles an inventory
offers), `advise` (every shape: TP 1, 2, 4, 8 of each product and each MIG profile, with the
`fleet.models.memory.MemoryNeed` verdict and concurrency) and `cheapest` (the shape whose
replicas reach a target concurrency for the least GPUs, or the least money when prices are
given). Pure. Called by `fleet plan --advise` and `fleet validate`.

"Cheapest": a shape costs its GPUs per replica (a MIG instance of ``Ng`` costs ``N/7`` of its
GPU: its share of the 7 compute slices) times the GPU's price per hour when one is given, else
1 (with prices given, shapes of unpriced products are listed but never cheapest); a target of T concurrent full-context sequences needs ``ceil(T / concurrency)`` replicas
(``concurrency`` rounded down). Ties go to the higher concurrency, then fewer GPUs per replica.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fleet.inventory.mig import mig_model_for
from fleet.inventory.model import Inventory, product_key
from fleet.models.facts import MIB, tp_problem
from fleet.models.memory import MemoryNeed

TP_SIZES = (1, 2, 4, 8)


@dataclass(frozen=True)
class GpuProductInfo:
    """A GPU product: NVML's name, memory of one GPU, GPUs per node (the widest TP on one node)."""

    product: str
    memory_mib: int
    gpus_per_node: int = 8


COMMON_GPU_PRODUCTS: tuple[GpuProductInfo, ...] = (
    GpuProductInfo("NVIDIA H100 80GB HBM3", 81559),   # fleet/testing/data/h100-80gb-hbm3.json (NVML)
    GpuProductInfo("NVIDIA H200", 143771),            # fleet/testing/data/h200.json (NVML, a real H200)
    GpuProductInfo("NVIDIA B200", 183359),
    GpuProductInfo("NVIDIA A100-SXM4-80GB", 81920),
    GpuProductInfo("NVIDIA A100-SXM4-40GB", 40960),
    GpuProductInfo("NVIDIA L40S", 46068),
    GpuProductInfo("NVIDIA L4", 23034),
    GpuProductInfo("NVIDIA A10G", 23028),
    GpuProductInfo("Tesla T4", 15360),
)
"""Memory as ``nvidia-smi --query-gpu=memory.total`` reports it for each product; an inventory's
own ``memory_mib`` takes precedence (`products_of`)."""


def common_product(name: str) -> GpuProductInfo | None:
    """The entry of `COMMON_GPU_PRODUCTS` for ``name`` (compared as `product_key`), or None."""
    key = product_key(name)
    return next((p for p in COMMON_GPU_PRODUCTS if product_key(p.product) == key), None)


def mig_memory_mib(product: str, memory_mib: int, profile: str) -> int | None:
    """Memory of one MIG instance of ``profile`` on ``product``: NVML's measured size where
    `fleet.inventory.mig` has it, else the size the profile's name says (``3g.40gb``: 40 GB, as
    MiB: 38,147; smaller than what NVML reports, so never optimistic). None when the product has no
    MIG table or no such profile."""
    model = mig_model_for(product, memory_mib)
    p = model.profile(profile) if model else None
    if p is None:
        return None
    if p.memory_mib:
        return p.memory_mib
    gb = int(profile.split(".")[1].split("gb")[0])
    return gb * 1000 ** 3 // MIB


def products_of(inventory: Inventory) -> tuple[GpuProductInfo, ...]:
    """The GPU products of an inventory: the smallest memory a product's GPUs report, and the
    most GPUs of it one node holds."""
    memory: dict[str, int] = {}
    names: dict[str, str] = {}
    per_node: dict[str, int] = {}
    for node in inventory.nodes:
        count: dict[str, int] = {}
        for g in node.gpus:
            k = g.product_key
            names.setdefault(k, g.product)
            memory[k] = min(memory.get(k, g.memory_mib), g.memory_mib)
            count[k] = count.get(k, 0) + 1
        for k, n in count.items():
            per_node[k] = max(per_node.get(k, 0), n)
    return tuple(GpuProductInfo(names[k], memory[k], per_node[k]) for k in names)


@dataclass(frozen=True)
class ShapeAdvice:
    """One replica shape and what the model does on it."""

    product: str
    tensor_parallel_size: int
    mig_profile: str | None
    device_memory_mib: int
    gpus: float                     # GPUs one replica takes (a MIG instance: its compute share)
    problem: str | None             # why it does not fit; None when it does
    concurrency: float              # full-context sequences at once (0 when it does not fit)
    kv_cache_bytes: int             # per GPU (negative: short by that much)
    price_per_hour: float | None = None
    verdict: str = ""               # in a few words: "fits", "weights do not fit", "context: ~32,768 tokens fit"

    @property
    def fits(self) -> bool:
        return self.problem is None

    @property
    def label(self) -> str:
        return f"MIG {self.mig_profile}" if self.mig_profile else f"TP={self.tensor_parallel_size}"

    def replicas_for(self, target_concurrency: float) -> int:
        """Replicas of this shape that hold ``target_concurrency`` full-context sequences."""
        per = math.floor(self.concurrency)
        return math.ceil(target_concurrency / per) if per >= 1 else 0

    def cost_for(self, target_concurrency: float) -> float:
        """GPUs (or money per hour, with a price) of the replicas reaching the target."""
        return self.replicas_for(target_concurrency) * self.gpus * (self.price_per_hour or 1.0)


def advise(need: MemoryNeed, products: tuple[GpuProductInfo, ...] = COMMON_GPU_PRODUCTS,
           prices: dict[str, float] | None = None, tp_sizes: tuple[int, ...] = TP_SIZES,
           mig: bool = True) -> list[ShapeAdvice]:
    """Every shape of ``products``: TP ``tp_sizes`` up to the GPUs of one node, and TP=1 on each
    MIG profile the product's MIG table has (``mig``). ``prices``: product name -> price per GPU
    per hour (matched as `product_key`)."""
    by_key = {product_key(k): v for k, v in (prices or {}).items()}
    rows = []
    for p in products:
        price = by_key.get(product_key(p.product))
        for tp in tp_sizes:
            if tp > p.gpus_per_node:
                continue
            rows.append(_row(need.at_tp(tp), p.product, p.memory_mib, tp, None, float(tp), price))
        model = mig_model_for(p.product, p.memory_mib) if mig else None
        for prof in model.profiles if model else ():
            mem = mig_memory_mib(p.product, p.memory_mib, prof.name)
            if mem is not None:
                rows.append(_row(need.at_tp(1), p.product, mem, 1, prof.name, prof.compute_slices / 7, price))
    return rows


def _row(need: MemoryNeed, product: str, memory_mib: int, tp: int, profile: str | None, gpus: float,
         price: float | None) -> ShapeAdvice:
    problem = need.fits(memory_mib)
    return ShapeAdvice(product, tp, profile, memory_mib, gpus, problem,
                       need.concurrency(memory_mib) if problem is None else 0.0,
                       need.kv_cache_bytes(memory_mib), price, _verdict(need, memory_mib, problem))


def _verdict(need: MemoryNeed, memory_mib: int, problem: str | None) -> str:
    if problem is None:
        return "fits"
    if tp_problem(need.facts, need.tensor_parallel_size) is not None:
        return f"TP {need.tensor_parallel_size} does not divide the heads"
    longest = need.longest_context(memory_mib)
    if longest <= 0:
        return "weights do not fit"
    return f"only ~{longest:,} tokens of context fit"


def cheapest(rows: list[ShapeAdvice], target_concurrency: float = 1.0) -> ShapeAdvice | None:
    """The fitting shape whose replicas reach ``target_concurrency`` at the least cost (module
    docstring), or None when none fits."""
    ok = [r for r in rows if r.fits and r.concurrency >= 1]
    if any(r.price_per_hour for r in rows):   # prices given: a product without one has no comparable cost
        ok = [r for r in ok if r.price_per_hour]
    if not ok:
        return None
    return min(ok, key=lambda r: (r.cost_for(target_concurrency), -r.concurrency, r.gpus))


__all__ = ["COMMON_GPU_PRODUCTS", "GpuProductInfo", "ShapeAdvice", "advise", "cheapest",
           "common_product", "mig_memory_mib", "products_of"]
