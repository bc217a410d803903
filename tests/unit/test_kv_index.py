"""The exact block index (router.kv.exact_index.ExactIndex): keys chained over token ids match a prompt's
ids, removal, AllBlocksCleared, the per-endpoint bound, stream states, what is left out; and
`kv-aware` routing on it (router.pools.policies.KvAware) where an endpoint's stream is live.

Every test runs twice: with the index's compiled per-block loops (router/kv/_kvindex.c) and with
the Python ones (router.kv.index_ops), selected as the index would select them at import."""

from __future__ import annotations

import hashlib

import pytest

from router.pools.endpoint import EndpointState
from router.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.kv import index_ops
from router.kv.exact_index import ExactIndex, StreamState
from router.pools.policies import KvAware
from router.pools.pool import Pool
from router.kv.prompt_blocks import route_request

BS = 16


@pytest.fixture(autouse=True, params=["compiled", "python"])
def index_loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> index_ops.IndexOps:
    """The per-block loops every `ExactIndex` of the test runs (and `prompt_keys` chains with)."""
    ops = index_ops.IMPLEMENTATIONS.get(request.param)
    if ops is None:
        pytest.skip("router.kv._kvindex is not built here (`pip install -e .` builds it where gcc is)")
    monkeypatch.setattr(index_ops, "SELECTED", ops)
    return ops


class Engine:
    """Engine-like block hashes (sha256 chained over parent and tokens, as vLLM's default) for prompts."""

    def __init__(self, ints: bool = False) -> None:
        self.ints = ints

    def hashes(self, ids: list[int]) -> list[bytes | int]:
        out: list[bytes | int] = []
        parent = b"none"
        for start in range(0, len(ids) - BS + 1, BS):
            parent = hashlib.sha256(parent + repr(ids[start:start + BS]).encode()).digest()
            out.append(int.from_bytes(parent, "big") & (2**64 - 1) if self.ints else parent)
        return out

    def stored(self, ids: list[int], first_block: int = 0, **extra) -> BlockStored:
        """BlockStored of the full blocks of `ids` from `first_block` on (its parent the block before)."""
        hashes = self.hashes(ids)
        parent = hashes[first_block - 1] if first_block else None
        return BlockStored(hashes[first_block:], parent, ids[first_block * BS:len(hashes) * BS], BS, **extra)


def batch(*events) -> EventBatch:
    return EventBatch(0.0, list(events))


def prompt(n_blocks: int, base: int = 0, tail: int = 5) -> list[int]:
    return [base + i for i in range(n_blocks * BS + tail)]


def test_stored_blocks_match_a_prompts_token_ids_in_whole_blocks() -> None:
    engine, index = Engine(), ExactIndex()
    index.open("a")
    ids = prompt(4)
    index.apply("a", batch(engine.stored(ids[:2 * BS])), seq=0)
    index.apply("a", batch(engine.stored(ids, first_block=2)), seq=1)      # parent from the earlier event
    assert index.blocks("a") == 4 and index.last_seq("a") == 1 and index.block_tokens("a") == BS
    assert index.match(ids) == {"a": 4 * BS}
    assert index.match(ids[:3 * BS + 2]) == {"a": 3 * BS}
    assert index.match(prompt(4, base=7)) == {}                           # another prefix
    other = ids[:BS] + [999] * BS + ids[2 * BS:]
    assert index.match(other) == {"a": BS}                                # diverges in block 2


@pytest.mark.parametrize("ints", [False, True])
def test_removal_by_bytes_or_int_hashes(ints: bool) -> None:
    engine, index = Engine(ints), ExactIndex()
    index.open("a")
    ids = prompt(3)
    index.apply("a", batch(engine.stored(ids)))
    index.apply("a", batch(BlockRemoved([engine.hashes(ids)[2]], medium="GPU")))
    assert index.match(ids) == {"a": 2 * BS}
    index.apply("a", batch(BlockRemoved([engine.hashes(ids)[0]])))
    assert index.match(ids) == {} and index.blocks("a") == 1   # the orphan child stays until evicted


def test_all_blocks_cleared_empties_the_view_and_makes_it_complete() -> None:
    engine, index = Engine(), ExactIndex()
    index.stream_up("a")
    index.reset("a", known_empty=False)
    ids = prompt(2)
    index.apply("a", batch(engine.stored(ids)))
    assert index.state("a") is StreamState.REBUILDING and index.match(ids) == {}
    assert index.match(ids, rebuilding=True) == {"a": 2 * BS}   # asked for: what was stored since
    assert not index.any_live() and index.any_live(rebuilding=True)
    index.apply("a", batch(AllBlocksCleared(), engine.stored(ids[:BS])))
    assert index.state("a") is StreamState.LIVE and index.match(ids) == {"a": BS}


def test_two_endpoints_and_which_are_live() -> None:
    engine, index = Engine(), ExactIndex()
    for e in ("a", "b", "c"):
        index.open(e)
    long, short = prompt(6), prompt(2)
    index.apply("a", batch(engine.stored(long)))
    index.apply("b", batch(engine.stored(short)))
    index.apply("c", batch(engine.stored(long)))
    assert index.match(long) == {"a": 6 * BS, "b": 2 * BS, "c": 6 * BS}
    index.stream_down("c")
    assert index.state("c") is StreamState.DOWN and index.match(long) == {"a": 6 * BS, "b": 2 * BS}
    index.stream_up("c")
    index.reset("c", known_empty=False)
    assert index.state("c") is StreamState.REBUILDING and index.blocks("c") == 0
    index.rebuilt("c")
    assert index.live("c") and index.state("unknown") is StreamState.UNKNOWN


def test_memory_is_bounded_per_endpoint_oldest_stored_dropped_first() -> None:
    engine, index = Engine(), ExactIndex(max_blocks_per_endpoint=10)
    index.open("a")
    for n in range(50):
        index.apply("a", batch(engine.stored(prompt(4, base=1000 * n))))
        assert index.blocks("a") <= 10
    assert len(index) == 10 and index.distinct_blocks() == 10
    assert index.match(prompt(4, base=49_000)) == {"a": 4 * BS}
    assert index.match(prompt(4, base=0)) == {}
    index.forget("a")
    assert len(index) == 0 and index.distinct_blocks() == 0 and index.endpoints() == []


def test_blocks_a_prompts_token_ids_cannot_match_are_left_out() -> None:
    engine, index = Engine(), ExactIndex()
    index.open("a")
    ids = prompt(3)
    for event in (engine.stored(ids, medium="CPU"), engine.stored(ids, group_idx=1), engine.stored(ids, lora_id=2),
                  engine.stored(ids, lora_name="x"), engine.stored(ids, first_block=1)):  # fmt: skip
        index.apply("a", batch(event))
    assert index.blocks("a") == 0 and index.skipped_blocks("a") == 3 * 4 + 2
    salted = engine.stored(ids, extra_keys=[None, ("salt",), None])
    index.apply("a", batch(salted))
    assert index.match(ids) == {"a": BS} and index.skipped_blocks("a") == 3 * 4 + 2 + 2
    bad = BlockStored(engine.hashes(ids), None, ids[:BS], BS)   # token ids do not fill the blocks
    index.apply("a", batch(bad))
    assert index.skipped_blocks("a") == 3 * 4 + 2 + 2 + 3


def test_retain_and_slots_are_reused() -> None:
    engine, index = Engine(), ExactIndex()
    ids = prompt(2)
    for e in ("a", "b"):
        index.open(e)
        index.apply(e, batch(engine.stored(ids)))
    index.retain({"b"})
    index.open("c")
    index.apply("c", batch(engine.stored(ids)))
    assert index.endpoints() == ["b", "c"] and index.match(ids) == {"b": 2 * BS, "c": 2 * BS}


def test_blocks_sent_for_prefill_count_until_the_engine_reports_them_stored() -> None:
    """`expect`: a prompt the router sent is held there (with `now_s`) until its BlockStored
    arrives; from then on the engine's account answers, so a later eviction is seen."""
    engine, index = Engine(), ExactIndex()
    index.open("a")
    index.apply("a", batch(engine.stored(prompt(1, base=5000))))   # the block size becomes known
    ids = prompt(6)
    claimed = index.expect("a", ids, until_s=10.0, now_s=0.0)
    assert len(claimed) == 6 and index.expected_blocks() == 6
    assert index.match(ids, now_s=1.0) == {"a": 6 * BS}
    assert index.match(ids) == {}                                  # the engines' account alone
    assert index.match(ids, now_s=10.5) == {}                      # the claim expired
    index.apply("a", batch(engine.stored(ids[:4 * BS])))           # the engine stored 4 of the 6
    assert index.expected_blocks() == 2
    assert index.match(ids, now_s=1.0) == {"a": 6 * BS}
    index.apply("a", batch(BlockRemoved(engine.hashes(ids)[2:4])))  # ... and evicted 2 of those
    assert index.match(ids, now_s=1.0) == {"a": 2 * BS}            # the claim does not cover them


def test_claims_are_dropped_with_the_view_and_swept_when_expired() -> None:
    engine, index = Engine(), ExactIndex()
    for e in ("a", "b"):
        index.open(e)
        index.apply(e, batch(engine.stored(prompt(1, base=5000))))
    ids = prompt(3)
    index.expect("a", ids, until_s=10.0, now_s=0.0)
    index.expect("b", ids, until_s=10.0, now_s=0.0)
    assert index.match(ids, now_s=0.0) == {"a": 3 * BS, "b": 3 * BS}
    index.apply("a", batch(AllBlocksCleared()))                    # the engine's cache was reset
    index.forget("b")
    assert index.match(ids, now_s=0.0) == {} and index.expected_blocks() == 0
    assert index.expect("c", ids, until_s=10.0, now_s=0.0) == []    # block size not known yet
    index.expect("a", ids, until_s=1.0, now_s=0.0)
    for _ in range(256):                                           # every 256th call sweeps
        index.expect("a", prompt(0), until_s=99.0, now_s=5.0)
    assert index.expected_blocks() == 0


def test_token_ids_holding_something_unhashable_match_and_claim_nothing() -> None:
    """A client's token-id prompt is passed on as parsed: a list inside it must not raise out of
    the policy (a router 500 where the engine answers 400)."""
    engine, index = Engine(), ExactIndex()
    index.open("a")
    ids = prompt(3)
    index.apply("a", batch(engine.stored(ids)))
    bad = ids[:5] + [[1]] + ids[6:]
    assert index.match(bad) == {} and index.match(bad, rebuilding=True, now_s=0.0) == {}
    assert index.expect("a", bad + prompt(2, base=900), until_s=10.0, now_s=0.0) == []
    assert index.expected_blocks() == 0 and index.placed_blocks("a") == 3   # no claim half-made
    assert index.match(ids) == {"a": 3 * BS}


def test_a_claim_is_taken_by_key_and_skips_what_the_view_holds() -> None:
    """`expect` returns the keys it claimed (the ones the view did not hold); another index
    takes them with `expect_keys` and matches the prompt there, until the engine stores it."""
    engine = Engine()
    sender, receiver = ExactIndex(), ExactIndex()
    ids = prompt(6)
    for index in (sender, receiver):
        index.open("a")
        index.apply("a", batch(engine.stored(ids[:2 * BS])))      # the prompt's first 2 blocks are held
    claimed = sender.expect("a", ids, until_s=10.0, now_s=0.0)
    assert len(claimed) == 4
    assert receiver.match(ids, now_s=0.0) == {"a": 2 * BS}
    assert receiver.expect_keys("a", claimed, until_s=10.0, now_s=0.0) == claimed
    assert receiver.match(ids, now_s=0.0) == {"a": 6 * BS} and receiver.match(ids) == {"a": 2 * BS}
    assert receiver.expect_keys("z", claimed, until_s=10.0, now_s=0.0) == []   # an endpoint it has not seen
    receiver.apply("a", batch(engine.stored(ids, first_block=2)))
    assert receiver.expected_blocks() == 0 and receiver.match(ids) == {"a": 6 * BS}


def claimed(index: ExactIndex, endpoint_id: str) -> int:
    """Blocks claimed at the endpoint and not stored: what `placed_blocks` adds to the stored ones."""
    return index.placed_blocks(endpoint_id) - index.store_counts(endpoint_id)[0]


def test_placed_blocks_are_the_blocks_stored_plus_the_claims_not_yet_stored() -> None:
    """`placed_blocks`: every block the engine reported stored (evictions do not take it back)
    and every claim, made here or taken as keys (`expect_keys`, as the picker moves a late pick's
    claim), until it is stored, cleared or swept."""
    engine, index = Engine(), ExactIndex()
    for e in ("a", "b"):
        index.open(e)
    index.apply("a", batch(engine.stored(prompt(2, base=5000))))
    index.apply("b", batch(engine.stored(prompt(1, base=6000))))
    assert (index.placed_blocks("a"), index.placed_blocks("b"), index.placed_blocks("z")) == (2, 1, 0)
    ids = prompt(6)
    index.expect("b", ids, until_s=10.0, now_s=0.0)
    assert index.placed_blocks("b") == 7 and claimed(index, "b") == 6
    index.expect("b", ids, until_s=12.0, now_s=1.0)                 # claimed again: not counted twice
    assert index.placed_blocks("b") == 7
    index.apply("b", batch(engine.stored(ids[:4 * BS])))            # 4 of the 6 stored: claim to store
    assert index.placed_blocks("b") == 7 and claimed(index, "b") == 2
    index.apply("b", batch(BlockRemoved(engine.hashes(ids)[:4])))   # evicted: still placed there
    assert index.placed_blocks("b") == 7
    elsewhere = prompt(3, base=9000)
    other = ExactIndex()                                            # a claim made elsewhere arrives as keys
    other.open("a")
    other.apply("a", batch(engine.stored(prompt(1, base=5000))))
    keys = other.expect("a", elsewhere, until_s=5.0, now_s=0.0)
    assert index.expect_keys("a", keys, until_s=5.0, now_s=0.0) == keys
    assert index.placed_blocks("a") == 5 and claimed(index, "a") == 3
    for _ in range(256):                                            # expired claims go at the sweep
        index.expect("a", prompt(0), until_s=99.0, now_s=6.0)
    assert claimed(index, "a") == 0 and index.placed_blocks("a") == 2
    index.apply("b", batch(AllBlocksCleared()))                     # a cleared view drops its claims
    assert claimed(index, "b") == 0 and index.placed_blocks("b") == 5


# ----- kv-aware on the exact index -----------------------------------------------------------------


def test_kv_aware_sends_a_shared_prefix_where_it_is_being_prefilled() -> None:
    """Two requests sharing a prompt, the second before the engine reported the first's blocks:
    it follows the first (which will have stored them), though that endpoint is busier; with
    `pending_s=0` it goes to the idle one and computes the prefix again."""
    engine = Engine()
    for pending_s, follows in ((10.0, True), (0.0, False)):
        index = ExactIndex()
        policy = KvAware(affinity_slack=0.0, pending_s=pending_s)
        a, b = (EndpointState(i, f"http://127.0.0.1/{i}") for i in ("a", "b"))
        for e in ("a", "b"):
            index.open(e)
            index.apply(e, batch(engine.stored(prompt(1, base=5000))))
        ids = prompt(40)
        first = route_request({"prompt": ids, "max_tokens": 4})
        where = policy.choose([a, b], first, 0.0, index)
        where.start(first.prefill_tokens)                           # as the proxy does
        second = route_request({"prompt": ids + [7, 8, 9], "max_tokens": 4})
        chosen = policy.choose([a, b], second, 0.5, index)
        assert (chosen is where) is follows
        assert second.cached_tokens == (40 * BS if follows else 0)
        if follows:   # the first request's claim, kept with its pick; the second's prompt is claimed already
            assert first.claim is not None and first.claim.endpoint_id == where.id
            assert len(first.claim.keys) == 40 and first.claim.until_s == 10.0
            assert second.claim is None
        else:
            assert first.claim is None and second.claim is None


def test_kv_aware_routes_by_the_engines_events_where_the_stream_is_live() -> None:
    engine, index = Engine(), ExactIndex()
    policy = KvAware(affinity_slack=0.0)
    a, b = (EndpointState(i, f"http://127.0.0.1/{i}") for i in ("a", "b"))
    ids = prompt(40)
    for e in ("a", "b"):
        index.open(e)
    index.apply("b", batch(engine.stored(ids)))            # b's engine says it holds the prompt
    r = route_request({"prompt": ids, "max_tokens": 4})
    assert r.token_ids is ids
    assert policy.choose([a, b], r, 0.0, index) is b and r.cached_tokens == 40 * BS
    # b's stream goes down: its approximate view (what this policy routed there) applies again.
    index.stream_down("b")
    r2 = route_request({"prompt": ids, "max_tokens": 4})
    assert policy.choose([a, b], r2, 0.0, index) is b and r2.cached_tokens == (40 * BS // 64) * 64
    # The engine evicted the blocks: with the stream live, the exact view wins over the routing history.
    index.stream_up("b")
    index.apply("b", batch(AllBlocksCleared()))
    index.apply("a", batch(engine.stored(ids[:10 * BS])))
    r3 = route_request({"prompt": ids, "max_tokens": 4})
    assert policy.choose([a, b], r3, 0.0, index) is a and r3.cached_tokens == 10 * BS


def test_kv_aware_takes_the_larger_of_a_rebuilding_view_and_its_own_history() -> None:
    """After a resync the view holds what the engine stored since (a lower bound): where it knows
    more than this router's routing history (the other router's placements) it wins; where it
    knows less (a prefix cached before the resync), the history does. (No claims of prompts sent
    and not yet stored, `pending_s=0`: this test sends the same prompt at one instant.)"""
    engine, index = Engine(), ExactIndex()
    policy = KvAware(affinity_slack=0.0, pending_s=0.0)
    a, b = (EndpointState(i, f"http://127.0.0.1/{i}") for i in ("a", "b"))
    for e in ("a", "b"):
        index.open(e)
        index.reset(e, known_empty=False)   # both resynced: REBUILDING
    ids = prompt(40)
    index.apply("b", batch(engine.stored(ids)))            # stored since: another router's placement
    r = route_request({"prompt": ids, "max_tokens": 4})
    assert Pool("m", policy, [a, b], 0.0, kv_view=index).wants_token_ids()
    assert policy.choose([a, b], r, 0.0, index) is b and r.cached_tokens == 40 * BS
    # b's view loses the prompt's tail (evicted), the head stays: 10 blocks in the view; this
    # router's history (it just sent the prompt to b) believes the whole prompt is there.
    index.apply("b", batch(BlockRemoved(engine.hashes(ids)[10:])))
    r2 = route_request({"prompt": ids, "max_tokens": 4})
    assert policy.choose([a, b], r2, 0.0, index) is b and r2.cached_tokens == (40 * BS // 64) * 64
    # Once b's view is LIVE again it is exact: 10 blocks, not the history's 40.
    index.rebuilt("b")
    r3 = route_request({"prompt": ids, "max_tokens": 4})
    assert policy.choose([a, b], r3, 0.0, index) is b and r3.cached_tokens == 10 * BS


def test_kv_aware_without_token_ids_uses_the_approximate_index() -> None:
    index = ExactIndex()
    index.open("a")
    policy = KvAware()
    a, b = (EndpointState(i, f"http://127.0.0.1/{i}") for i in ("a", "b"))
    text = "x" * 4096
    first = policy.choose([a, b], route_request({"prompt": text}), 0.0, index)
    again = route_request({"prompt": text})
    assert again.token_ids is None
    assert policy.choose([a, b], again, 0.0, index) is first and again.cached_tokens > 0


def _new_conversation_pool(stored: dict[str, int]) -> tuple[ExactIndex, list[EndpointState]]:
    """An exact index whose endpoints' engines stored `stored[e]` blocks of unrelated prompts."""
    engine, index = Engine(), ExactIndex()
    for n, (e, blocks) in enumerate(stored.items()):
        index.open(e)
        index.apply(e, batch(engine.stored(prompt(blocks, base=100_000 * (n + 1), tail=0))))
    return index, [EndpointState(e, f"http://127.0.0.1/{e}") for e in stored]


def test_kv_aware_starts_a_new_conversation_where_the_engines_stored_least() -> None:
    """With the events live, a prompt no endpoint holds goes to the endpoint whose engine has
    taken the fewest blocks (among those near the cheapest), whatever its hash; every router
    reading the same events chooses alike; its claim counts at once, so the next new
    conversation goes elsewhere."""
    ids = prompt(20)
    chosen = []
    for _ in range(2):   # two routers, each with its own index of the same events
        index, endpoints = _new_conversation_pool({"a": 9, "b": 3, "c": 6})
        policy = KvAware()
        chosen.append(policy.choose(endpoints, route_request({"prompt": ids, "max_tokens": 4}), 0.0, index).id)
    assert chosen == ["b", "b"]
    assert index.placed_blocks("b") == 3 + 20
    nxt = policy.choose(endpoints, route_request({"prompt": prompt(20, base=50_000), "max_tokens": 4}), 0.0, index)
    assert nxt.id == "c"


def test_kv_aware_new_conversation_keeps_load_and_session_and_needs_live_views() -> None:
    """The fewest-blocks choice is only among endpoints within `new_prefix_slack` of the
    cheapest; a session key keeps the rendezvous choice; an endpoint without a live view
    makes the rendezvous choice decide."""
    ids = prompt(20)
    index, (a, b) = _new_conversation_pool({"a": 9, "b": 3})
    policy = KvAware()
    b.start(20 * BS)      # b holds less but has a whole prompt queued: outside the slack
    assert policy.choose([a, b], route_request({"prompt": ids, "max_tokens": 4}), 0.0, index) is a

    def rendezvous(endpoints: list[EndpointState], request) -> str:
        return KvAware().choose(endpoints, request, 0.0).id   # no exact view: the rendezvous choice

    sessions = {f"user-{i}": prompt(20, base=1000 * i) for i in range(1, 40)}
    index, endpoints = _new_conversation_pool({"a": 9, "b": 3})
    policy = KvAware()
    picks = [policy.choose(endpoints, route_request({"prompt": p, "max_tokens": 4}, s), 0.0, index).id for s, p in sessions.items()]
    expected = [rendezvous(endpoints, route_request({"prompt": p, "max_tokens": 4}, s)) for s, p in sessions.items()]
    assert picks == expected and set(picks) == {"a", "b"}   # by session hash, not by the blocks stored
    index, endpoints = _new_conversation_pool({"a": 9, "b": 3})
    index.stream_down("b")
    policy = KvAware()
    firsts = [prompt(20, base=1000 * i) for i in range(1, 40)]
    picks = [policy.choose(endpoints, route_request({"prompt": p, "max_tokens": 4}), 0.0, index).id for p in firsts]
    expected = [rendezvous(endpoints, route_request({"prompt": p, "max_tokens": 4})) for p in firsts]
    assert picks == expected and set(picks) == {"a", "b"}   # by hash of the first block, as before
