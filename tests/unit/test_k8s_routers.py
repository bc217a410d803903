"""Every router pod gets every pool; the autoscaler's router statistics are merged over them
(fleet/k8s/routers.py)."""

from __future__ import annotations

import pytest

from fleet.k8s.routers import RouterFanout, merge_router_stats
from tests.unit.test_autoscaler_wiring import router_stats


def test_merge_adds_counts_weights_means_and_bounds_percentiles():
    a = router_stats(queue_s=1.0, ttft_s=2.0, in_flight=3, rate=4.0)
    b = router_stats(queue_s=3.0, ttft_s=1.0, in_flight=5, rate=6.0)
    b["queue_time_s"]["samples"] = 150
    b["covered_s"] = 20.0
    m = merge_router_stats([{"m": a}, {"m": b, "other": a}])
    assert set(m) == {"m", "other"}
    s = m["m"]
    assert (s["arrivals"], s["arrival_rate_per_s"], s["in_flight"], s["covered_s"]) == (60, 10.0, 8, 20.0)
    q = s["queue_time_s"]
    assert q["samples"] == 200 and q["mean"] == pytest.approx((1.0 * 50 + 3.0 * 150) / 200)
    assert q["p99"] == 3.0 and s["ttft_s"]["p99"] == 2.0      # the largest: never below the true p99
    assert merge_router_stats([{"m": a}]) == {"m": a}           # one router: exact


def test_merge_with_no_samples_is_unmeasured():
    a = router_stats(queue_s=1.0, ttft_s=2.0, in_flight=0)
    for key in ("queue_time_s", "ttft_s", "e2e_s"):
        a[key] = {"samples": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    m = merge_router_stats([{"m": a}, {"m": a}])
    assert m["m"]["queue_time_s"] == {"samples": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_router_pods_that_run_are_the_targets_and_a_new_one_is_noticed():
    pods = [
        {"metadata": {"name": "r1"}, "status": {"phase": "Running", "podIP": "10.0.0.1"}},
        {"metadata": {"name": "r2"}, "status": {"phase": "Pending"}},
        {"metadata": {"name": "r3", "deletionTimestamp": "x"}, "status": {"phase": "Running", "podIP": "10.0.0.3"}},
    ]
    fan = RouterFanout(lambda: pods, 9090, "t")
    assert fan.urls() == ["http://10.0.0.1:9090"]
    assert fan.routers_changed()
    assert fan.new_routers() == ["http://10.0.0.1:9090"] and fan.new_routers() == []
    assert not fan.routers_changed()
    pods[1]["status"] = {"phase": "Running", "podIP": "10.0.0.2"}
    assert fan.new_routers() == ["http://10.0.0.2:9090"]
    assert fan.urls() == ["http://10.0.0.1:9090", "http://10.0.0.2:9090"]


def test_a_restarted_router_container_is_new_again_and_a_failed_sync_is_retried():
    """kill -9 of a router process: same pod, same IP, restartCount + 1; it knows no pool."""
    pod = {"metadata": {"name": "r1", "uid": "u1"}, "status": {"phase": "Running", "podIP": "10.0.0.1",
                                                              "containerStatuses": [{"restartCount": 0}]}}
    fan = RouterFanout(lambda: [pod], 9090, "t")
    assert fan.new_routers() == ["http://10.0.0.1:9090"]
    pod["status"]["containerStatuses"][0]["restartCount"] = 1
    assert fan.routers_changed()
    assert fan.new_routers() == ["http://10.0.0.1:9090"]
    fan.forget(["http://10.0.0.1:9090"])   # its pools were not all written: named again
    assert fan.new_routers() == ["http://10.0.0.1:9090"]


async def test_no_router_means_a_failed_publish():
    from fleet.controller.router_admin import RouterAdminError
    from router.pools.spec import PoolSpec

    fan = RouterFanout(lambda: [], 9090, "t")
    with pytest.raises(RouterAdminError, match="no router pod"):
        await fan.put_pool("m", PoolSpec(endpoints=[]))
