"""Prices per GPU product (USD per GPU-hour) from a small YAML file, and what a fleet costs.

Owns `GpuPrices` (the file's schema, pydantic), `load_prices(path)`, `prices_from_json` and
`replica_cost_usd`. Read by `fleet simulate --prices FILE` (fleet/cli/simulate.py), which prints
cost beside SLO attainment, by `fleet up --prices FILE` and by `fleet operator` from
$FLEET_PRICES_JSON (the chart's ``prices`` value, same keys), which export the prices for the
dashboard's cost row. The file says where its prices came from (``source``), and the simulator prints it:
a cost figure without its price's origin is not a figure.

File shape (docs/autoscaling.md#cost)::

    source: "on-demand list prices, provider X, region Y, 2026-11"   # required, non-empty
    gpuHourUsd:                      # product name (as `spec.resources.gpuProduct` names it) -> USD/GPU-hour
      NVIDIA H100 80GB HBM3: 2.99
      NVIDIA L40S: 1.10

Errors: `PricesError` naming the file and the field (unreadable file, not YAML, unknown key,
a negative or non-numeric price, no prices at all).
"""

from __future__ import annotations

from pathlib import Path

import json

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from fleet.base.yaml_text import yaml_problem


class PricesError(ValueError):
    """A prices file that cannot be used; the message names the file and the field."""


class GpuPrices(BaseModel):
    """USD per GPU-hour by GPU product, and where the prices came from."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    source: str = Field(..., min_length=1, description="Where the prices came from (provider, region, date).")
    gpu_hour_usd: dict[str, float] = Field(..., alias="gpuHourUsd", min_length=1,
                                           description="GPU product -> USD per GPU-hour (>= 0).")

    @field_validator("gpu_hour_usd")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        for product, usd in v.items():
            if not product.strip():
                raise ValueError("an empty product name")
            if usd < 0:
                raise ValueError(f"{product}: {usd} USD/GPU-hour is negative")
        return v

    def per_gpu_hour(self, products: tuple[str, ...]) -> tuple[str, float]:
        """(product, USD/GPU-hour) of the first of ``products`` (most preferred first, as
        `ResourcesSpec.gpu_products`) that has a price; with ``products`` empty (any product),
        the only product priced. Raises PricesError naming what is missing."""
        for product in products:
            if product in self.gpu_hour_usd:
                return product, self.gpu_hour_usd[product]
        if not products and len(self.gpu_hour_usd) == 1:
            return next(iter(self.gpu_hour_usd.items()))
        if not products:
            raise PricesError(f"the deployment names no gpuProduct and the prices file prices "
                              f"{len(self.gpu_hour_usd)} products: name one in spec.resources.gpuProduct")
        raise PricesError(f"gpuHourUsd has no price for {', '.join(products)} "
                          f"(priced: {', '.join(sorted(self.gpu_hour_usd))})")


def load_prices(path: Path) -> GpuPrices:
    """The prices in ``path`` (YAML, module docstring). Raises PricesError naming the file and field."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as err:
        raise PricesError(f"{path}: cannot read: {err.strerror or err}") from None
    except yaml.YAMLError as err:
        raise PricesError(yaml_problem(str(path), err)) from None
    if not isinstance(data, dict):
        raise PricesError(f"{path}: expected a mapping with source and gpuHourUsd, got {type(data).__name__}")
    try:
        return GpuPrices.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise PricesError(f"{path}: {field}: {first['msg']}") from None


def prices_from_json(text: str, what: str = "FLEET_PRICES_JSON") -> GpuPrices:
    """The prices in ``text``: JSON of the file's shape (the chart's ``prices`` value rendered
    with toJson). Raises PricesError naming ``what`` and the field."""
    try:
        data = json.loads(text)
    except ValueError as err:
        raise PricesError(f"{what}: not JSON: {err}") from None
    if not isinstance(data, dict):
        raise PricesError(f"{what}: expected an object with source and gpuHourUsd, got {type(data).__name__}")
    try:
        return GpuPrices.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise PricesError(f"{what}: {field}: {first['msg']}") from None


def replica_cost_usd(replica_hours: float, gpus_per_replica: float, usd_per_gpu_hour: float) -> float:
    """USD for ``replica_hours`` of replicas of ``gpus_per_replica`` GPUs each (GPU-hours x price).
    ``gpus_per_replica``: the tensor parallel size, or below 1 for a MIG instance (its compute
    share of the GPU, `fleet.inventory.mig.mig_gpu_fraction`: 3/7 for 3g.40gb). Standby replicas
    count: they hold their GPUs. Raises ValueError for negative hours or price, or no GPUs."""
    if replica_hours < 0 or gpus_per_replica <= 0 or usd_per_gpu_hour < 0:
        raise ValueError(f"replica_hours {replica_hours}, gpus_per_replica {gpus_per_replica}, "
                         f"usd_per_gpu_hour {usd_per_gpu_hour}: expected >= 0, > 0, >= 0")
    return replica_hours * gpus_per_replica * usd_per_gpu_hour
