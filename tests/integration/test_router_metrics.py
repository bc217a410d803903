"""Replacing a pool of thousands of bound endpoints removes exactly its metric series
(router.stats.metrics, router.pools.pool): a scale case, kept out of the unit tier for its run time; the rest
is in tests/unit/test_router_metrics.py."""

from __future__ import annotations

import time

from router.stats.metrics import RouterMetrics
from router.pools.pool import PoolTable
from tests.unit.test_router_metrics import endpoint_samples, spec  # the unit file's helpers


def test_replacing_a_large_bound_pool_removes_exactly_its_series() -> None:
    metrics = RouterMetrics()
    table = PoolTable(metrics, time.time)
    other = table.put("other", spec(2))
    for pool in (table.put("m", spec(2000)), other):
        for endpoint in pool.endpoints:
            assert endpoint.metrics is not None
            endpoint.metrics.bind()
            endpoint.metrics.requests(200).inc()
    assert len(endpoint_samples(metrics, "m")) > 2000
    kept = endpoint_samples(metrics, "other")
    table.put("m", spec(2000, prefix="r"))
    assert endpoint_samples(metrics, "m") == []
    assert endpoint_samples(metrics, "other") == kept
    assert table.delete("other") and endpoint_samples(metrics, "other") == []
