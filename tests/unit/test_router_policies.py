"""Routing policies on hand-built endpoint states: no I/O, no clock (router.pools.policies)."""

from __future__ import annotations

import pytest

from router.pools.policies import DEFAULT_POLICY, DEFAULT_STALE_AFTER_S, RoutingPolicy, make_policy, policy_names
from router.pools.endpoint import EndpointState
from router.kv.prompt_blocks import RouteRequest


def endpoint(id_: str, in_flight: int = 0, ewma_first_byte_s: float | None = None, last_sample_s: float | None = None
             ) -> EndpointState:  # fmt: skip
    state = EndpointState(id_, f"http://127.0.0.1/{id_}")
    state.in_flight = in_flight
    state.ewma_first_byte_s = ewma_first_byte_s
    state.last_sample_s = last_sample_s if last_sample_s is not None else (None if ewma_first_byte_s is None else 100.0)
    return state


def choices(policy: RoutingPolicy, candidates: list[EndpointState], n: int, now_s: float = 100.0) -> list[str]:
    return [policy.choose(candidates, RouteRequest(), now_s).id for _ in range(n)]


def test_registry_lists_builtin_policies_and_default() -> None:
    assert policy_names() == ["cache-aware", "kv-aware", "latency-aware", "least-outstanding", "round-robin"]
    assert DEFAULT_POLICY == "kv-aware"
    for name in policy_names():
        policy = make_policy(name)
        assert isinstance(policy, RoutingPolicy) and policy.name == name
    assert make_policy("round-robin") is not make_policy("round-robin")  # one instance per pool


def test_unknown_policy_name_lists_known_ones() -> None:
    with pytest.raises(KeyError) as info:
        make_policy("random")
    message = str(info.value)
    assert "random" in message
    for name in policy_names():
        assert name in message


def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):

        class Again(RoutingPolicy, name="round-robin"):
            pass


def test_round_robin_rotates_over_all_candidates() -> None:
    a, b, c = endpoint("a", in_flight=5), endpoint("b"), endpoint("c", ewma_first_byte_s=0.001)
    picks = choices(make_policy("round-robin"), [a, b, c], 6)
    assert sorted(picks[:3]) == ["a", "b", "c"]
    assert picks[3:] == picks[:3]


def test_least_outstanding_picks_fewest_in_flight() -> None:
    a, b, c = endpoint("a", in_flight=3), endpoint("b", in_flight=1), endpoint("c", in_flight=2)
    assert choices(make_policy("least-outstanding"), [a, b, c], 4) == ["b"] * 4


def test_least_outstanding_rotates_ties() -> None:
    a, b, c = endpoint("a", in_flight=1), endpoint("b", in_flight=1), endpoint("c", in_flight=4)
    picks = choices(make_policy("least-outstanding"), [a, b, c], 4)
    assert sorted(picks) == ["a", "a", "b", "b"]
    assert picks[0] != picks[1]


def test_latency_aware_in_flight_comes_before_latency() -> None:
    fast_busy = endpoint("fast", in_flight=2, ewma_first_byte_s=0.01)
    slow_idle = endpoint("slow", in_flight=0, ewma_first_byte_s=0.5)
    assert choices(make_policy("latency-aware"), [fast_busy, slow_idle], 3) == ["slow"] * 3


def test_latency_aware_breaks_ties_by_lowest_ewma() -> None:
    a = endpoint("a", in_flight=1, ewma_first_byte_s=0.30)
    b = endpoint("b", in_flight=1, ewma_first_byte_s=0.05)
    c = endpoint("c", in_flight=1, ewma_first_byte_s=0.10)
    assert choices(make_policy("latency-aware"), [a, b, c], 3) == ["b"] * 3


def test_latency_aware_tries_unmeasured_endpoint_first() -> None:
    measured = endpoint("measured", ewma_first_byte_s=0.01)
    new = endpoint("new")
    assert make_policy("latency-aware").choose([measured, new], RouteRequest(), 100.0).id == "new"


def test_latency_aware_treats_stale_sample_as_unknown() -> None:
    now_s = 1000.0
    fresh = endpoint("fresh", ewma_first_byte_s=0.01, last_sample_s=now_s - 1.0)
    stale = endpoint("stale", ewma_first_byte_s=0.50, last_sample_s=now_s - DEFAULT_STALE_AFTER_S - 0.1)
    policy = make_policy("latency-aware")
    assert policy.choose([fresh, stale], RouteRequest(), now_s).id == "stale"
    # Just inside the window the slow sample still counts, and the fast endpoint wins.
    stale.last_sample_s = now_s - DEFAULT_STALE_AFTER_S + 0.1
    assert policy.choose([fresh, stale], RouteRequest(), now_s).id == "fresh"


def test_latency_aware_rotates_among_unknown_and_equal_endpoints() -> None:
    u1, u2 = endpoint("u1"), endpoint("u2")
    known = endpoint("known", ewma_first_byte_s=0.01)
    assert sorted(choices(make_policy("latency-aware"), [u1, known, u2], 4)) == ["u1", "u1", "u2", "u2"]
    e1, e2 = endpoint("e1", ewma_first_byte_s=0.2), endpoint("e2", ewma_first_byte_s=0.2)
    assert sorted(choices(make_policy("latency-aware"), [e1, e2], 4)) == ["e1", "e1", "e2", "e2"]


def test_single_candidate_is_always_chosen() -> None:
    only = endpoint("only", in_flight=7, ewma_first_byte_s=9.0)
    for name in policy_names():
        assert make_policy(name).choose([only], RouteRequest(), 0.0) is only
