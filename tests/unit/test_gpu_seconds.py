"""GPU-seconds allocated per deployment, revision, product and state, and the price gauge, as the
controller exports them (fleet/observability/discovery.py `gpus_held`, `ControllerStateCollector`);
the same collector serves `fleet up --prices` and the operator."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from prometheus_client import CollectorRegistry

import pytest

from fleet.inventory.mig import mig_gpu_fraction
from fleet.observability.discovery import ControllerStateCollector, LocalObservability, gpus_held
from fleet.placement import PlacementRequest, ReplicaShape, get_strategy
from tests.support.inventories import cluster, node
from tests.unit.test_observability_discovery import _scrape

H100 = "NVIDIA H100 80GB HBM3"


def rep(rid: str, status: str, devices: list[str], product: str | None = H100, revision: str = "v1",
        deployment: str = "chat") -> dict:
    return {"id": rid, "deployment": deployment, "revision": revision, "status": status,
            "placement": {"product": product, "members": [{"node": "n", "devices": devices}]}}  # fmt: skip


def snapshot(clock_s: float, *replicas: dict) -> dict:
    return {"clock_s": clock_s, "deployments": {}, "replicas": list(replicas)}


def test_gpus_held_counts_whole_gpus_of_replicas_holding_them_by_state() -> None:
    held = gpus_held(snapshot(
        0.0,
        rep("chat-0", "READY", ["GPU-a", "GPU-b"]),            # TP=2 serving
        rep("chat-1", "DRAINING", ["GPU-c"]),                   # still holds it: serving
        rep("chat-2", "WARMING", ["GPU-d"], revision="v2"),     # starting
        rep("chat-3", "CACHING", ["GPU-e"], revision="v2"),     # starting: placed, devices held
        rep("chat-4", "TERMINATED", ["GPU-f"]),                 # gone
        rep("chat-5", "FAILED_START", ["GPU-g"]),               # gone
        rep("chat-6", "PENDING", []),                           # not placed
        rep("cpu-0", "READY", ["cpu:0", "cpu:1"], product=None, deployment="tiny"),   # CPU: no GPU
        rep("mig-0", "READY", ["MIG-0-1"], deployment="small"),     # MIG without its profile label: 0, left out
        {"id": "old-0", "deployment": "chat", "revision": "v1", "status": "READY", "placement": None},
    ))
    assert held == {("chat", "v1", H100, "serving"): 3, ("chat", "v2", H100, "starting"): 2}


def test_gpu_seconds_integrate_what_each_snapshot_held_until_the_next_and_prices_are_exported() -> None:
    registry = CollectorRegistry()
    obs = LocalObservability(Path("/nonexistent-dir"), "http://127.0.0.1:8080", None, registry=registry,
                             prices={H100: 4.916})
    collector: ControllerStateCollector = obs.collector
    collector.update(snapshot(100.0, rep("chat-0", "STARTING", ["GPU-a", "GPU-b"])))
    collector.update(snapshot(160.0, rep("chat-0", "READY", ["GPU-a", "GPU-b"])))      # 60 s starting x 2 GPUs
    collector.update(snapshot(190.0, rep("chat-0", "READY", ["GPU-a", "GPU-b"]),
                              rep("chat-1", "STARTING", ["GPU-c"])))                       # 30 s serving x 2
    collector.update(snapshot(190.0, rep("chat-0", "READY", ["GPU-a", "GPU-b"])))      # no time passed
    collector.update(snapshot(200.0))                                                   # 10 s serving x 2
    m = _scrape(registry)

    def gpu_s(state: str) -> float:
        return m[("fleet_gpu_seconds_allocated_total",
                  (("deployment", "chat"), ("product", H100), ("revision", "v1"), ("state", state)))]

    assert gpu_s("starting") == 120.0 and gpu_s("serving") == 80.0
    assert m[("fleet_gpu_price_usd_per_hour", (("product", H100),))] == 4.916
    collector.update(snapshot(150.0, rep("chat-0", "READY", ["GPU-a"])))    # a clock that went back: no credit
    collector.update(snapshot(160.0))
    assert _scrape(registry)[("fleet_gpu_seconds_allocated_total",
                              (("deployment", "chat"), ("product", H100), ("revision", "v1"), ("state", "serving")))] == 90.0


def test_without_prices_there_is_no_price_series() -> None:
    registry = CollectorRegistry()
    LocalObservability(Path("/nonexistent-dir"), "http://127.0.0.1:8080", None, registry=registry)
    assert not [k for k in _scrape(registry) if k[0] == "fleet_gpu_price_usd_per_hour"]


def test_a_mig_instance_counts_as_its_compute_share_of_the_gpu() -> None:
    # NVIDIA's MIG user guide, "Supported MIG Profiles": 7 compute slices on A100 / H100; Ng takes N.
    assert [mig_gpu_fraction(p) for p in ("1g.10gb", "1g.10gb+me", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")] == [
        1 / 7, 1 / 7, 2 / 7, 3 / 7, 4 / 7, 1.0]
    for bad in ("3g", "g.40gb", "8g.80gb", "0g.1gb"):
        with pytest.raises(ValueError, match="not a MIG profile"):
            mig_gpu_fraction(bad)
    # Placed by Fleet's own placement: the snapshot carries the assignment's label, mig:3g.40gb@gpu0.
    n = node("m", n=2, mig={0: [("3g.40gb", 0), ("3g.40gb", 4)]})
    plan = get_strategy("fleet").place_replicas(PlacementRequest(ReplicaShape(mig_profile="3g.40gb"), count=2),
                                                cluster(n), Counter())  # fmt: skip
    replicas = [{"id": f"small-{i}", "deployment": "small", "revision": "v1", "status": status,
                 "placement": p.to_dict()} for i, (p, status) in enumerate(zip(plan.placements, ("READY", "STANDBY")))]
    product = plan.placements[0].product
    assert product
    assert gpus_held(snapshot(0.0, *replicas)) == {("small", "v1", product, "serving"): 3 / 7,
                                                   ("small", "v1", product, "standby"): 3 / 7}
    collector = ControllerStateCollector()
    collector.update(snapshot(0.0, *replicas))
    collector.update(snapshot(700.0, *replicas))
    registry = CollectorRegistry()
    registry.register(collector)  # type: ignore[arg-type]
    assert _scrape(registry)[("fleet_gpu_seconds_allocated_total", (("deployment", "small"), ("product", product),
                                                                    ("revision", "v1"), ("state", "serving")))] == pytest.approx(300.0)


async def test_the_operator_exports_the_prices_the_chart_gives_it() -> None:
    from fleet.k8s.operator import Operator, OperatorSettings
    from tests.unit.test_k8s_operator import NS, Env

    env = Env()
    try:
        op = Operator(env.kube, OperatorSettings(engine_image="fleet:1", prices=((H100, 4.916),)), namespace=NS,
                      identity="op-a", engine_api=env.engines, pool_sink=env.pools)  # fmt: skip
        registry = CollectorRegistry()
        registry.register(op.plane.metrics.controller_state)  # type: ignore[arg-type]
        assert _scrape(registry)[("fleet_gpu_price_usd_per_hour", (("product", H100),))] == 4.916
    finally:
        await env.close()
