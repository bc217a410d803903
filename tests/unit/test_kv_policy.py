"""The `kv-aware` routing policy: cost scoring, bounded load, rendezvous affinity, two routers
agreeing (router.pools.policies.KvAware). Time is passed in (`now_s`); nothing reads a clock."""

from __future__ import annotations

import pytest

from router.stats.metrics import RouterMetrics
from router.pools.policies import DEFAULT_DECODE_TOKEN_WEIGHT, DEFAULT_MISS_TOKEN_WEIGHT, CacheAware, KvAware, make_policy
from router.pools.endpoint import EndpointState
from router.pools.pool import PoolTable
from router.kv.prompt_blocks import ROUTER_BLOCK_TOKENS, RouteRequest, route_request
from router.pools.spec import PoolSpec

NOW_S = 1000.0


def endpoints(*ids: str) -> list[EndpointState]:
    return [EndpointState(i, f"http://127.0.0.1/{i}") for i in ids]


def prompt(conversation: int, blocks: int, turn: int = 0) -> list[int]:
    """Token ids: `blocks` router blocks shared by every turn of `conversation`, then a tail
    unique to the turn."""
    shared = [conversation * 100_000 + j for j in range(blocks * ROUTER_BLOCK_TOKENS)]
    return shared + [9_000_000 + conversation * 1000 + turn] * (ROUTER_BLOCK_TOKENS // 2)


def request(ids: list[int], session: str | None = None) -> RouteRequest:
    return route_request({"prompt": ids, "max_tokens": 16}, session)


def dispatch(e: EndpointState, r: RouteRequest) -> None:
    e.start(r.prefill_tokens)


def test_kv_aware_is_registered_with_the_shared_signature() -> None:
    policy = make_policy("kv-aware")
    assert isinstance(policy, KvAware) and policy.name == "kv-aware"
    (only,) = endpoints("a")
    r = request(prompt(1, 3))
    assert policy.choose([only], r, NOW_S) is only
    assert r.cached_tokens == 0          # nothing cached yet
    r2 = request(prompt(1, 3, turn=1))
    assert policy.choose([only], r2, NOW_S) is only and r2.cached_tokens == 3 * ROUTER_BLOCK_TOKENS


def test_a_repeated_prefix_goes_where_it_is_cached() -> None:
    policy = KvAware()
    eps = endpoints("a", "b", "c", "d")
    first = policy.choose(eps, request(prompt(7, 20)), NOW_S)
    for turn in range(1, 6):
        r = request(prompt(7, 20, turn))
        assert policy.choose(eps, r, NOW_S) is first
        assert r.cached_tokens == 20 * ROUTER_BLOCK_TOKENS and r.prefill_tokens == len(prompt(7, 20, turn)) - 1280


def test_queued_prefill_outweighs_a_small_cache_hit_but_not_a_large_one() -> None:
    policy = KvAware(affinity_slack=0.0)
    a, b = endpoints("a", "b")
    policy.index.record("a", request(prompt(1, 4)).block_hashes)     # a holds 4 blocks = 256 tokens
    a.start(5000)                                                      # 5,000 prefill tokens queued on a
    b.start(0)
    b.first_byte(0)                                                    # b: one request decoding
    small = request(prompt(1, 4, turn=1))
    assert policy.choose([a, b], small, NOW_S) is b and small.cached_tokens == 0
    policy.index.record("a", request(prompt(2, 120)).block_hashes)   # 7,680 tokens cached on a
    large = request(prompt(2, 120, turn=1))
    assert policy.choose([a, b], large, NOW_S) is a and large.cached_tokens == 120 * ROUTER_BLOCK_TOKENS


def test_a_cached_prefix_keeps_its_conversation_behind_more_queued_work_than_it_saves() -> None:
    """The prefill a request would redo elsewhere is weighed `miss_token_weight` times a queued
    token: the fleet pays for it again, not only this request. With weight 1 (before) the request
    below left its 5,120 cached tokens for an idle endpoint; with the default it stays."""
    assert DEFAULT_MISS_TOKEN_WEIGHT > 1.0
    turn0, turn1 = request(prompt(4, 80)), request(prompt(4, 80, turn=1))
    for weight, stays in ((1.0, False), (DEFAULT_MISS_TOKEN_WEIGHT, True)):
        policy = KvAware(affinity_slack=0.0, miss_token_weight=weight)
        a, b = endpoints("a", "b")
        policy.index.record("a", turn0.block_hashes)                  # a holds 80 blocks = 5,120 tokens
        a.start(6_000)                                                  # 6,000 prefill tokens queued on a
        r = request(prompt(4, 80, turn=1))
        chosen = policy.choose([a, b], r, NOW_S)
        assert (chosen is a) == stays, weight
        assert r.cached_tokens == (80 * ROUTER_BLOCK_TOKENS if stays else 0)
    assert 80 * ROUTER_BLOCK_TOKENS < 6_000 < DEFAULT_MISS_TOKEN_WEIGHT * 80 * ROUTER_BLOCK_TOKENS
    assert turn1.prompt_tokens > 80 * ROUTER_BLOCK_TOKENS


def test_a_cached_prefix_does_not_hold_against_a_deep_queue() -> None:
    """The weight bounds stickiness: queued work beyond the weighted saving moves the request."""
    policy = KvAware(affinity_slack=0.0)
    a, b = endpoints("a", "b")
    policy.index.record("a", request(prompt(5, 80)).block_hashes)    # 5,120 tokens cached on a
    a.start(int(DEFAULT_MISS_TOKEN_WEIGHT * 5_120) + 1_000)
    assert policy.choose([a, b], request(prompt(5, 80, turn=1)), NOW_S) is b


def test_cache_aware_baseline_follows_vllm_router() -> None:
    """vllm-router's `cache_aware` with its defaults (0.1.17): the longest prefix over 30% of the
    prompt wins while loads are balanced, whatever the queue; a new prompt goes to the smallest
    tree; imbalance (diff > 64 and ratio > 1.5) sends to the least loaded."""
    policy = make_policy("cache-aware")
    assert isinstance(policy, CacheAware)
    a, b, c = endpoints("a", "b", "c")
    first = policy.choose([a, b, c], request(prompt(1, 40)), NOW_S)
    for _ in range(60):
        first.start(10_000)                                             # deep queue, balance still within 64
    r = request(prompt(1, 40, turn=1))
    assert policy.choose([a, b, c], r, NOW_S) is first and r.cached_tokens == 40 * ROUTER_BLOCK_TOKENS
    fresh = policy.choose([a, b, c], request(prompt(2, 10)), NOW_S)
    assert fresh is not first                                           # the smallest tree (empty) takes it
    # 40 of 100 blocks held (40%: over the 0.3 threshold, under half) still follows the prefix.
    longer = request(prompt(1, 40, turn=3) + [7_000_000 + j for j in range(60 * ROUTER_BLOCK_TOKENS)])
    assert policy.choose([a, b, c], longer, NOW_S) is first
    for _ in range(10):
        first.start(10_000)                                             # 71 against 0: imbalanced
    assert policy.choose([a, b, c], request(prompt(1, 40, turn=2)), NOW_S) not in (first, fresh)


def test_cache_aware_smallest_tree_counts_what_was_sent_not_what_an_engine_could_hold() -> None:
    """The tree outlives an engine's cache (vllm-router's per-worker budget of 33.5M characters):
    after more distinct prompt tokens than one engine holds, the endpoint sent the most is still
    the larger tree, so new prompts go elsewhere (an engine-sized tree would hold both full,
    tie, and alternate)."""
    policy = CacheAware()
    a, b = endpoints("a", "b")
    for conversation in range(10):                                      # 640k tokens to a, 448k to b:
        policy.index.record("a", request(prompt(100 + conversation, 1000)).block_hashes)
    for conversation in range(7):                                       # both over one H100's 432k
        policy.index.record("b", request(prompt(200 + conversation, 1000)).block_hashes)
    assert policy.index.blocks("a") == 10_000 and policy.index.blocks("b") == 7_000
    assert [policy.choose([a, b], request(prompt(300 + k, 10)), NOW_S) for k in range(2)] == [b, b]


def test_load_counts_prefill_tokens_and_decoding_requests_not_request_counts() -> None:
    policy = KvAware()
    a, b = endpoints("a", "b")
    a.start(20_000)                     # one request, a long prompt still prefilling
    for _ in range(3):                  # three short requests, decoding
        b.start(100)
        b.first_byte(100)
    assert (a.in_flight, a.prefill_tokens, a.prefilling) == (1, 20_000, 1)
    assert (b.in_flight, b.prefill_tokens, b.prefilling) == (3, 0, 0)
    assert 3 * DEFAULT_DECODE_TOKEN_WEIGHT < 20_000
    assert policy.choose([a, b], RouteRequest(prompt_tokens=500), NOW_S) is b
    b.finish(100, got_first_byte=True)
    a.finish(20_000, got_first_byte=False)
    assert (a.in_flight, a.prefill_tokens, a.prefilling) == (0, 0, 0)


def test_bounded_load_spills_a_popular_prefix() -> None:
    """Mirrokni et al.: no endpoint takes more than ceil(c x (in flight + 1) / n) requests (the
    bound for an endpoint holding the prefix set to the same c)."""
    policy = KvAware(load_bound=1.5, prefix_load_bound=1.5)
    eps = endpoints("a", "b", "c", "d")
    hot = prompt(3, 100)
    placed: dict[str, int] = {}
    for turn in range(40):
        r = request(hot[:-1] + [turn])       # the same 6,400-token prefix every time
        e = policy.choose(eps, r, NOW_S)
        total = sum(x.in_flight for x in eps)
        assert e.in_flight < -(-1.5 * (total + 1) // 4)   # the chosen one was under the bound
        dispatch(e, r)
        placed[e.id] = placed.get(e.id, 0) + 1
    assert len(placed) >= 3     # it spilled; spills go where the prefix then is (a 4th copy costs its prefill)
    assert max(placed.values()) <= -(-1.5 * 40 // 4)


def test_an_endpoint_holding_the_prefix_takes_up_to_the_looser_bound_then_it_spills() -> None:
    """Over half the prompt held: left out only from prefix_load_bound x the mean in flight."""
    policy = KvAware(load_bound=1.5, prefix_load_bound=3.0)
    eps = endpoints("a", "b", "c", "d")
    hot = prompt(3, 100)
    choices = []
    for turn in range(40):
        r = request(hot[:-1] + [turn])
        e = policy.choose(eps, r, NOW_S)
        total = sum(x.in_flight for x in eps)
        bound = 3.0 if e.id in choices else 1.5     # a replica it went to before holds the prefix
        assert e.in_flight < -(-bound * (total + 1) // 4), (turn, e.id, e.in_flight, total)
        dispatch(e, r)
        choices.append(e.id)
    home = choices[0]
    assert choices[:3] == [home] * 3           # 1.5x would have spilled at the 2nd (ceil(1.5 x 2 / 4) = 1)
    assert choices.count(home) > -(-1.5 * 40 // 4) and len(set(choices)) >= 2   # past 1.5x, then it spilled
    with pytest.raises(ValueError, match="prefix_load_bound"):
        KvAware(load_bound=2.0, prefix_load_bound=1.5)


@pytest.mark.parametrize(("prefix_share", "stays"), [(0.3, True), (0.5, False)])
def test_the_looser_bound_applies_from_prefix_share_of_the_prompt(prefix_share: float, stays: bool) -> None:
    """An endpoint holding 40% of the prompt keeps its turn past 1.5x the mean at the default
    share (0.3, vllm-router's cache_threshold), and loses it when the share asked is half."""
    policy = KvAware(load_bound=1.5, prefix_load_bound=3.0, prefix_share=prefix_share)
    a, b, c, d = eps = endpoints("a", "b", "c", "d")
    policy.index.record("a", request(prompt(5, 40)).block_hashes)   # 40 of the next prompt's 100 blocks
    a.start(0)
    a.start(0)                                                      # 2 in flight: ceil(1.5 x 3 / 4) = 2
    r = request(prompt(5, 40, turn=1) + [8_000_000 + j for j in range(60 * ROUTER_BLOCK_TOKENS)])
    assert (policy.choose(eps, r, NOW_S) is a) is stays
    with pytest.raises(ValueError, match="prefix_share"):
        KvAware(prefix_share=1.5)


def test_new_conversations_go_by_rendezvous_hash_and_spread() -> None:
    policy = KvAware()
    eps = endpoints(*"abcdefgh")
    counts = dict.fromkeys("abcdefgh", 0)
    for conv in range(400):
        counts[policy.choose(eps, request(prompt(conv, 2)), NOW_S).id] += 1   # loads stay equal (0)
    assert min(counts.values()) >= 25      # ~50 each: no endpoint is starved or hot
    # Removing an endpoint moves only the conversations it had (consistent hashing).
    fresh = KvAware()
    before = {conv: fresh.choose(eps, request(prompt(conv, 2)), NOW_S).id for conv in range(400, 600)}
    fresh2 = KvAware()
    after = {conv: fresh2.choose(eps[1:], request(prompt(conv, 2)), NOW_S).id for conv in range(400, 600)}
    moved = [c for c in before if before[c] != after[c]]
    assert moved and all(before[c] == "a" for c in moved)


def test_two_routers_agree_on_affinity_without_talking() -> None:
    """Each router has its own policy object, its own index and its own endpoint states (its
    own requests in flight). The turns of each conversation alternate between them."""
    routers = [KvAware(), KvAware()]
    views = [endpoints(*"abcdefgh"), endpoints(*"abcdefgh")]
    homes: dict[int, set[str]] = {}
    turn_of: dict[int, int] = {}
    for step in range(600):
        conv = (step * 7) % 150                  # 150 conversations, 4 turns each, interleaved
        turn = turn_of[conv] = turn_of.get(conv, -1) + 1
        k = (conv + turn) % 2                    # the next turn goes to the other router
        r = request(prompt(conv, 10, turn))
        e = routers[k].choose(views[k], r, NOW_S)
        homes.setdefault(conv, set()).add(e.id)
        dispatch(e, r)
        if step >= 8:                            # requests finish: in flight stays small
            for view in views:
                for x in view:
                    if x.in_flight:
                        x.finish(x.prefill_tokens, got_first_byte=False)
                        break
    agreed = sum(1 for ids in homes.values() if len(ids) == 1)
    assert agreed / len(homes) >= 0.9


def test_session_affinity_where_prompts_share_nothing() -> None:
    routers = [KvAware(), KvAware()]
    views = [endpoints(*"abcd"), endpoints(*"abcd")]
    homes: dict[str, set[str]] = {}
    for i in range(200):
        session = f"user-{i % 20}"
        r = route_request({"prompt": f"question {i}", "user": session})
        assert r.block_hashes == ()              # shorter than a block: no prefix to match
        k = i % 2
        homes.setdefault(session, set()).add(routers[k].choose(views[k], r, NOW_S).id)
    assert all(len(ids) == 1 for ids in homes.values())
    assert len({next(iter(ids)) for ids in homes.values()}) == 4   # sessions spread over endpoints


def test_no_key_no_cache_takes_the_least_work_and_rotates_ties() -> None:
    policy = KvAware()
    a, b, c = endpoints("a", "b", "c")
    c.start(300)
    picks = [policy.choose([a, b, c], RouteRequest(prompt_tokens=10), NOW_S).id for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"]


def test_pool_replacement_keeps_the_index_of_kept_endpoints_only() -> None:
    table = PoolTable(RouterMetrics(), wall_clock=lambda: 0.0, clock=lambda: 0.0)
    doc = {"policy": "kv-aware", "endpoints": [{"id": "a", "url": "http://h:1"}, {"id": "b", "url": "http://h:2"}]}
    pool = table.put("m", PoolSpec.model_validate(doc))
    policy = pool.policy
    assert isinstance(policy, KvAware)
    a, b = pool.endpoints
    policy.index.record("a", [1, 2])
    policy.index.record("b", [1, 3])
    doc["endpoints"] = [{"id": "a", "url": "http://h:1"}, {"id": "c", "url": "http://h:3"}]
    pool = table.put("m", PoolSpec.model_validate(doc))
    assert pool.policy is policy
    assert policy.index.endpoints() == ["a"]
    assert pool.pick(request(prompt(1, 2)), NOW_S) is not None


@pytest.mark.parametrize("kwargs, needle", [
    ({"load_bound": 1.0}, "load_bound must be > 1"),
    ({"decode_token_weight": -1}, "must be >= 0"),
    ({"affinity_slack": -0.1}, "must be >= 0"),
    ({"miss_token_weight": 0.5}, "miss_token_weight must be >= 1"),
])  # fmt: skip
def test_bad_parameters_are_refused(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        KvAware(**kwargs)
