"""Pool specs, pool replacement, endpoint stats and candidate filtering (router.pools.spec, router.pools.pool)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.stats.metrics import RouterMetrics
from router.kv.prompt_blocks import RouteRequest
from router.pools.endpoint import EWMA_ALPHA, FAILURE_PENALTY_S, EndpointState
from router.pools.pool import PoolTable
from router.pools.spec import PoolSpec

REQ = RouteRequest()
"""A request with no prompt blocks: the policies route it on load alone."""


def spec(*endpoints: dict[str, object], policy: str = "round-robin") -> PoolSpec:
    return PoolSpec.model_validate({"policy": policy, "endpoints": list(endpoints)})


def table() -> PoolTable:
    return PoolTable(RouterMetrics(), wall_clock=lambda: 1_700_000_000.0)


def test_spec_defaults_and_url_normalisation() -> None:
    parsed = PoolSpec.model_validate({"endpoints": [{"id": "chat-0", "url": "http://127.0.0.1:8101/"}]})
    assert parsed.policy == "kv-aware"
    (ep,) = parsed.endpoints
    assert (ep.url, ep.version, ep.weight, ep.draining) == ("http://127.0.0.1:8101", "", 1.0, False)


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"policy": "fastest"}, "known: cache-aware, kv-aware, latency-aware, least-outstanding, round-robin"),
        ({"endpoints": [{"id": "a", "url": "ftp://h:1"}]}, "url"),
        ({"endpoints": [{"id": "a", "url": "http://h:1/v1"}]}, "no path"),
        ({"endpoints": [{"id": "a", "url": "http://h:1"}, {"id": "a", "url": "http://h:2"}]}, "duplicate endpoint id"),
        ({"endpoints": [{"id": "a", "url": "http://h:1", "weight": -1}]}, "weight"),
        ({"endpoints": [{"id": "a b", "url": "http://h:1"}]}, "id"),
        ({"endpoints": [{"id": "a", "url": "http://h:1", "colour": "red"}]}, "colour"),
    ],
)
def test_spec_rejects_bad_input_naming_the_problem(doc: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError) as info:
        PoolSpec.model_validate(doc)
    assert needle in str(info.value)


def test_ewma_update() -> None:
    state = EndpointState("a", "http://h:1")
    state.record_first_byte(1.0, now_s=5.0)
    assert (state.ewma_first_byte_s, state.last_sample_s) == (1.0, 5.0)
    state.record_first_byte(2.0, now_s=6.0)
    assert state.ewma_first_byte_s == pytest.approx(EWMA_ALPHA * 2.0 + (1 - EWMA_ALPHA) * 1.0)
    state.record_failure(now_s=7.0, cooldown_s=3.0)
    assert state.errors_total == 1 and state.unavailable_until_s == 10.0
    assert state.ewma_first_byte_s is not None and state.ewma_first_byte_s > EWMA_ALPHA * FAILURE_PENALTY_S


def test_put_keeps_stats_of_unchanged_endpoints_only() -> None:
    pools = table()
    first = pools.put("m", spec({"id": "a", "url": "http://h:1"}, {"id": "b", "url": "http://h:2"},
                                {"id": "c", "url": "http://h:3"}))  # fmt: skip
    a, b, c = first.endpoints
    for state in (a, b, c):
        state.requests_total = 7
        state.in_flight = 1
    second = pools.put("m", spec(
        {"id": "a", "url": "http://h:1", "version": "v2", "draining": True},  # same id+url: kept
        {"id": "b", "url": "http://h:9"},  # url changed: fresh
        {"id": "d", "url": "http://h:4"},  # new
    ))  # fmt: skip
    new_a, new_b, d = second.endpoints
    assert new_a is a and a.requests_total == 7 and a.in_flight == 1
    assert (a.version, a.draining) == ("v2", True)
    assert new_b is not b and new_b.requests_total == 0 and new_b.url == "http://h:9"
    assert d.requests_total == 0
    assert second.ready == (new_b, d)
    assert first.policy is second.policy  # same policy name: rotation state kept
    assert c.in_flight == 1  # a removed endpoint's state is untouched; its requests finish against it
    assert pools.get("m") is second and pools.models() == ["m"]


def test_put_with_new_policy_replaces_policy_and_delete_removes_pool() -> None:
    pools = table()
    first = pools.put("m", spec({"id": "a", "url": "http://h:1"}))
    second = pools.put("m", spec({"id": "a", "url": "http://h:1"}, policy="least-outstanding"))
    assert second.policy.name == "least-outstanding" and second.policy is not first.policy
    assert second.created_s == first.created_s
    assert pools.delete("m") is True
    assert pools.delete("m") is False
    assert pools.get("m") is None


def test_pick_skips_draining_tried_and_cooling_endpoints() -> None:
    pools = table()
    pool = pools.put("m", spec({"id": "a", "url": "http://h:1"}, {"id": "b", "url": "http://h:2"},
                               {"id": "c", "url": "http://h:3", "draining": True}))  # fmt: skip
    a, b, _draining = pool.endpoints
    picks = {pool.pick(REQ, 0.0).id for _ in range(10)}  # type: ignore[union-attr]
    assert picks == {"a", "b"}
    assert pool.pick(REQ, 0.0, tried=[a]) is b
    assert pool.pick(REQ, 0.0, tried=[a, b]) is None
    a.record_failure(now_s=10.0, cooldown_s=2.0)
    assert {pool.pick(REQ, 11.0).id for _ in range(10)} == {"b"}  # type: ignore[union-attr]
    assert {pool.pick(REQ, 12.0).id for _ in range(10)} == {"a", "b"}  # type: ignore[union-attr]
    b.record_failure(now_s=20.0, cooldown_s=2.0)
    a.record_failure(now_s=20.0, cooldown_s=2.0)
    assert {pool.pick(REQ, 21.0).id for _ in range(10)} == {"a", "b"}  # type: ignore[union-attr]  # all cooling: all are candidates


def test_empty_pool_has_no_pick() -> None:
    pool = table().put("m", spec())
    assert pool.pick(REQ, 0.0) is None
