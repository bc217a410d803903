"""The per-request split between revisions (router.pools.split via router.pools.pool.Pool.pick): exact shares
over 10,000 requests for every routing policy, sticky keys that always land on the same revision,
weight 0, fallback, counters kept across pool replacements, the sticky key's sources, and the
whole path through the proxy with a sticky header."""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from router.http.app import create_app
from router.stats.metrics import RouterMetrics
from router.pools.policies import make_policy, policy_names
from router.pools.endpoint import EndpointState
from router.pools.pool import Pool, PoolTable
from router.pools.spec import EndpointSpec, PoolSpec
from router.kv.prompt_blocks import route_request
from router.pools.split import RevisionSplit, sticky_key
from tests.support.router import FakeEngine, running_app

N = 10_000

REQ = route_request({"prompt": "hello"})   # one request; the split does not look at it


def endpoints(weights: dict[str, tuple[int, float]]) -> list[EndpointState]:
    """version -> (endpoints, revision weight): each endpoint carries weight / endpoints."""
    out = []
    for version, (count, weight) in weights.items():
        out += [EndpointState(f"{version}-{i}", f"http://10.0.0.{len(out) + 1}:8000", version, weight / count)
                for i in range(count)]  # fmt: skip
    return out


def shares(pool: Pool, n: int = N, keys: list[str] | None = None) -> dict[str, float]:
    seen: Counter[str] = Counter()
    for i in range(n):
        e = pool.pick(REQ, float(i), key=keys[i] if keys else None)
        seen[e.version] += 1
    return {v: 100.0 * c / n for v, c in seen.items()}


@pytest.mark.parametrize("policy", policy_names())
@pytest.mark.parametrize("weights", [
    {"stable": (9, 95.0), "canary": (1, 5.0)},
    {"stable": (3, 90.0), "canary": (1, 10.0)},
    {"stable": (2, 50.0), "canary": (2, 50.0)},
    {"a": (2, 20.0), "b": (3, 30.0), "c": (1, 50.0)},
])
def test_over_10000_requests_each_revision_gets_its_weight_within_one_point(policy, weights):
    pool = Pool("m", make_policy(policy), endpoints(weights), 0.0)
    observed = shares(pool)
    for version, (_, weight) in weights.items():
        assert abs(observed[version] - weight) <= 1.0, observed
        assert abs(observed[version] * N / 100 - weight * N / 100) <= 1.0   # in fact within one request


def test_the_policy_still_chooses_inside_the_chosen_revision():
    eps = endpoints({"stable": (3, 90.0), "canary": (1, 10.0)})
    pool = Pool("m", make_policy("round-robin"), eps, 0.0)
    per_endpoint = Counter(pool.pick(REQ, 0.0).id for _ in range(1000))
    assert per_endpoint["canary-0"] == 100
    assert sorted(per_endpoint[f"stable-{i}"] for i in range(3)) == [300, 300, 300]


def test_canary_picks_are_spread_evenly_not_bunched():
    pool = Pool("m", make_policy("least-outstanding"), endpoints({"s": (1, 95.0), "c": (1, 5.0)}), 0.0)
    at = [i for i in range(2000) if pool.pick(REQ, 0.0).version == "c"]
    assert len(at) == 100 and max(b - a for a, b in zip(at, at[1:])) == 20


def test_a_sticky_key_always_lands_on_the_same_revision_and_keys_split_by_weight():
    pool = Pool("m", make_policy("latency-aware"), endpoints({"stable": (3, 80.0), "canary": (1, 20.0)}), 0.0)
    keys = [f"session-{i}" for i in range(N)]
    first = {k: pool.pick(REQ, 0.0, key=k).version for k in keys}
    assert abs(100.0 * Counter(first.values())["canary"] / N - 20.0) <= 1.0
    for k in keys[:500]:                      # again and again, interleaved with unsticky requests
        pool.pick(REQ, 0.0)
        assert pool.pick(REQ, 0.0, key=k).version == first[k]
    republished = Pool("m", make_policy("latency-aware"), endpoints({"stable": (3, 80.0), "canary": (1, 20.0)}), 1.0)
    assert all(republished.pick(REQ, 0.0, key=k).version == first[k] for k in keys)


def test_raising_the_canary_weight_moves_only_stable_keys_to_the_canary():
    keys = [f"user-{i}" for i in range(N)]
    before = Pool("m", make_policy("round-robin"), endpoints({"stable": (1, 90.0), "canary": (1, 10.0)}), 0.0)
    after = Pool("m", make_policy("round-robin"), endpoints({"stable": (1, 50.0), "canary": (1, 50.0)}), 0.0)
    moved = Counter((before.pick(REQ, 0.0, key=k).version, after.pick(REQ, 0.0, key=k).version) for k in keys)
    assert moved[("canary", "stable")] == 0                          # a canary user stays on the canary
    assert abs(100.0 * (moved[("canary", "canary")] + moved[("stable", "canary")]) / N - 50.0) <= 1.0


def test_a_revision_of_weight_zero_gets_no_new_requests():
    eps = endpoints({"stable": (2, 100.0), "canary": (2, 0.0)})
    pool = Pool("m", make_policy("least-outstanding"), eps, 0.0, limit=1)
    assert shares(pool, 1000) == {"stable": 100.0}
    assert {pool.pick(REQ, 0.0, key=f"k{i}").version for i in range(1000)} == {"stable"}
    # Not even as a fall-back: with the stable endpoints full or tried the request waits or fails
    # rather than go to a rolled-back canary.
    eps[0].in_flight = eps[1].in_flight = 1
    assert pool.pick(REQ, 0.0) is None
    assert pool.pick(REQ, 0.0, tried=eps[:2], within_limit=False) is None


def test_one_version_or_all_weights_zero_is_not_split():
    assert Pool("m", make_policy("round-robin"), endpoints({"v1": (3, 3.0)}), 0.0).split is None
    assert RevisionSplit.of(endpoints({"v1": (1, 0.0), "v2": (1, 0.0)})) is None
    legacy = [EndpointState("a", "http://a:1", "v1"), EndpointState("b", "http://b:1", "v1", 0.0)]
    pool = Pool("m", make_policy("round-robin"), legacy, 0.0)      # weights of a single version are ignored
    assert Counter(pool.pick(REQ, 0.0).id for _ in range(10)) == {"a": 5, "b": 5}


def test_a_full_or_tried_revision_falls_back_to_the_others():
    eps = endpoints({"stable": (1, 50.0), "canary": (1, 50.0)})
    pool = Pool("m", make_policy("round-robin"), eps, 0.0, limit=1)
    eps[1].in_flight = 1                                             # the canary's only endpoint is full
    assert {pool.pick(REQ, 0.0).version for _ in range(10)} == {"stable"}
    assert pool.pick(REQ, 0.0, tried=[eps[0]], within_limit=False).version == "canary"


def test_the_split_counters_carry_over_pool_replacements():
    table = PoolTable(RouterMetrics(CollectorRegistry()), wall_clock=lambda: 0.0, clock=lambda: 0.0)
    spec = PoolSpec(policy="round-robin", endpoints=[
        EndpointSpec(id="s", url="http://10.0.0.1:1", version="v1", weight=97.0),
        EndpointSpec(id="c", url="http://10.0.0.2:1", version="v2", weight=3.0)])
    seen: Counter[str] = Counter()
    for i in range(N):
        if i % 7 == 0:                       # the controller republishes often (a replica's state changes)
            table.put("m", spec)
        seen[table.get("m").pick(REQ, 0.0).version] += 1
    assert seen["v2"] == 300


def test_sticky_key_sources():
    headers = [(b"content-type", b"application/json"), (b"x-session-id", b"abc")]
    assert sticky_key("header:X-Session-Id", headers, {}) == "abc"
    assert sticky_key("header:x-other", headers, {}) is None
    assert sticky_key(None, headers, {}) is None
    assert sticky_key("body:user", [], {"model": "m", "user": "u-7"}) == "u-7"
    assert sticky_key("body:user", [], {"model": "m", "user": 7}) is None
    assert sticky_key("body:user", [], [1, 2]) is None


def test_the_pool_document_validates_the_sticky_key():
    with pytest.raises(ValueError, match="sticky_key"):
        PoolSpec(sticky_key="cookie:session")
    assert PoolSpec(sticky_key="header:x-session-id").sticky_key == "header:x-session-id"


async def test_through_the_router_a_sticky_header_keeps_a_session_on_one_revision():
    token = "t"
    async with FakeEngine("stable") as stable, FakeEngine("canary") as canary:
        app = create_app(token)
        timeout = aiohttp.ClientTimeout(total=10.0)
        async with running_app(app) as base, aiohttp.ClientSession(base, timeout=timeout) as client:
            doc = {"policy": "least-outstanding", "sticky_key": "header:x-session-id", "endpoints": [
                {"id": "s-0", "url": stable.url, "version": "v1", "weight": 50},
                {"id": "c-0", "url": canary.url, "version": "v2", "weight": 50}]}
            async with client.put("/admin/v1/pools/m", json=doc, headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == 200, await r.text()

            async def ask(session: str | None) -> str:
                headers = {"x-session-id": session} if session else {}
                async with client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                                       headers=headers) as resp:  # fmt: skip
                    assert resp.status == 200
                    return (await resp.json())["served_by"]

            for session in ("alice", "bob", "carol", "dave"):
                served = await asyncio.gather(*(ask(session) for _ in range(6)))
                assert len(set(served)) == 1, (session, served)
            unsticky = Counter([await ask(None) for _ in range(20)])
            assert unsticky == {"stable": 10, "canary": 10}
