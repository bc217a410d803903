"""Series lifecycle of the router's per-endpoint metrics and the bounded rejection labels
(router.stats.metrics, router.pools.pool): no I/O, a fresh registry per test."""

from __future__ import annotations

import time

from router.stats.metrics import UNKNOWN_MODEL, RouterMetrics
from router.pools.pool import PoolTable
from router.pools.spec import PoolSpec


def endpoint_samples(metrics: RouterMetrics, model: str) -> list[str]:
    """Names of every sample of a per-endpoint family that carries `model`."""
    out = []
    for family in metrics.registry.collect():
        for s in family.samples:
            if "endpoint" in s.labels and s.labels.get("model") == model and "version" in s.labels:
                out.append(f"{s.name}{s.labels}")
    return out


def spec(n: int, prefix: str = "e", version: str = "") -> PoolSpec:
    return PoolSpec.model_validate({"endpoints": [
        {"id": f"{prefix}{i}", "url": f"http://10.0.0.{i % 250}:{8000 + i}", "version": version} for i in range(n)]})


def test_series_appear_at_first_use_and_leave_with_the_endpoint() -> None:
    metrics = RouterMetrics()
    table = PoolTable(metrics, time.time)
    pool = table.put("m", spec(3))
    assert endpoint_samples(metrics, "m") == []  # nothing per endpoint until it serves
    m = pool.endpoints[0].metrics
    assert m is not None
    m.bind()
    m.requests(200).inc()
    m.e2e.observe(0.2)
    assert metrics.registry.get_sample_value(
        "fleet_router_requests_total", {"model": "m", "endpoint": "e0", "version": "", "code": "200"}) == 1
    table.put("m", spec(3, prefix="r"))  # every endpoint replaced
    assert endpoint_samples(metrics, "m") == []
    # A request still in flight on the removed endpoint records nowhere and creates nothing.
    m.requests(200).inc()
    m.requests(503).inc()
    m.e2e.observe(0.1)
    m.error("connect").inc()
    m.bind()
    assert endpoint_samples(metrics, "m") == []


def test_a_version_change_forgets_the_old_versions_series() -> None:
    metrics = RouterMetrics()
    table = PoolTable(metrics, time.time)
    state = table.put("m", spec(1, version="v1")).endpoints[0]
    assert state.metrics is not None
    state.metrics.bind()
    state.metrics.requests(200).inc()
    same = table.put("m", spec(1, version="v2")).endpoints[0]
    assert same is state and state.metrics is not None and state.metrics.labels == ("m", "e0", "v2")
    assert endpoint_samples(metrics, "m") == []


def test_rejections_are_labelled_by_a_bounded_set_of_models() -> None:
    metrics = RouterMetrics()
    metrics.reject("served", 503, known=True)
    for i in range(100):
        metrics.reject(f"random-{i}", 404, known=False)
    metrics.reject("", 400, known=False)
    labels = {s.labels["model"] for f in metrics.registry.collect() for s in f.samples
              if s.name == "fleet_router_rejected_requests_total"}  # fmt: skip
    assert labels == {"served", UNKNOWN_MODEL, ""}
