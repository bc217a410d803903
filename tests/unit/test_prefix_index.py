"""The router's approximate view of each endpoint's prefix cache (router.kv.prefix_index)."""

from __future__ import annotations

import pytest

from router.kv.prefix_index import PrefixIndex


def test_match_counts_leading_blocks_per_endpoint() -> None:
    index = PrefixIndex(100)
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2, 9])
    index.record("c", [7, 8])
    assert index.match([1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
    assert index.match([1, 2, 9]) == {"a": 2, "b": 3}
    assert index.match([7, 2, 3]) == {"c": 1}
    assert index.match([5, 1, 2]) == {}          # a prefix must start at the first block
    assert index.match([]) == {}
    # A hole breaks the prefix even if later blocks are held.
    index.remove("a", [2])
    assert index.match([1, 2, 3, 4]) == {"a": 1, "b": 2}


def test_eviction_is_lru_and_takes_a_prompts_tail_before_its_head() -> None:
    index = PrefixIndex(capacity_blocks=5)
    index.record("e", [1, 2, 3])          # LRU order after: 3, 2, 1 (head most recent)
    index.record("e", [10, 11])           # 5 blocks: full
    index.record("e", [20])               # evicts 3, the tail of the oldest prompt
    assert index.match([1, 2, 3]) == {"e": 2}
    index.record("e", [1, 2])             # refreshed: now 10, 11 ... are older
    index.record("e", [30, 31])           # evicts 11 then 10 (tail first)
    assert index.match([10, 11]) == {}
    assert index.match([1, 2]) == {"e": 2}
    assert index.blocks("e") == 5


def test_memory_stays_bounded_over_a_million_distinct_blocks() -> None:
    index = PrefixIndex(capacity_blocks=1000)
    for i in range(25_000):               # 25,000 distinct prompts of 40 blocks on 4 endpoints
        index.record(f"e{i % 4}", range(i * 40, i * 40 + 40))
    assert len(index) == 4 * 1000
    assert index.distinct_blocks() == 4 * 1000
    last = list(range(24_999 * 40, 25_000 * 40))
    assert index.match(last) == {"e3": 40}


def test_forget_and_retain_drop_departed_endpoints_and_reuse_their_slot() -> None:
    index = PrefixIndex(100)
    index.record("old", [1, 2])
    index.record("keep", [1, 5])
    index.retain({"keep", "new"})
    assert index.endpoints() == ["keep"]
    assert index.match([1, 2]) == {"keep": 1}
    index.record("new", [8])               # takes the freed slot and none of its blocks
    assert index.match([1, 2]) == {"keep": 1} and index.match([8]) == {"new": 1}
    index.forget("keep")
    assert index.match([1]) == {} and index.distinct_blocks() == 1
    index.forget("unknown")                # no error


def test_exact_view_records_without_eviction() -> None:
    index = PrefixIndex(capacity_blocks=2)
    index.record("e", [1, 2, 3, 4], evict=False)   # what KV events say the engine holds
    assert index.match([1, 2, 3, 4]) == {"e": 4}
    index.remove("e", [3])
    assert index.match([1, 2, 3, 4]) == {"e": 2}


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_blocks must be >= 1"):
        PrefixIndex(0)
