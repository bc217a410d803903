"""What the router reads from a request body before routing it (router.kv.prompt_blocks). That the
hashes are the same in every process is in tests/integration/test_prompt_blocks.py."""

from __future__ import annotations

import pytest

from router.kv.prompt_blocks import (
    DEFAULT_OUTPUT_TOKENS,
    MAX_SESSION_KEY_CHARS,
    ROUTER_BLOCK_TOKENS,
    TEXT_BLOCK_BYTES,
    RouteRequest,
    route_request,
    text_block_hashes,
    token_id_block_hashes,
)


def test_token_id_blocks_are_chained_and_a_partial_tail_has_none() -> None:
    a = list(range(1000, 1000 + 3 * ROUTER_BLOCK_TOKENS + 5))
    b = a[: 2 * ROUTER_BLOCK_TOKENS] + [7] * ROUTER_BLOCK_TOKENS
    ha, hb = token_id_block_hashes(a), token_id_block_hashes(b)
    assert len(ha) == 3 and len(hb) == 3
    assert ha[:2] == hb[:2] and ha[2] != hb[2]
    # Chained: the same block after a different prefix hashes differently.
    c = [5] * ROUTER_BLOCK_TOKENS + a[ROUTER_BLOCK_TOKENS: 2 * ROUTER_BLOCK_TOKENS]
    assert token_id_block_hashes(c)[1] != ha[1]
    assert token_id_block_hashes(a[: ROUTER_BLOCK_TOKENS - 1]) == []


def test_text_blocks_share_a_common_prefix_only() -> None:
    common = b"x" * (2 * TEXT_BLOCK_BYTES)
    h1 = text_block_hashes(common + b"a" * TEXT_BLOCK_BYTES)
    h2 = text_block_hashes(common + b"b" * TEXT_BLOCK_BYTES)
    assert h1[:2] == h2[:2] and h1[2] != h2[2]
    assert all(0 <= h < 2**64 for h in h1)


def test_completion_prompts_text_ids_and_batches() -> None:
    ids = list(range(10, 10 + 2 * ROUTER_BLOCK_TOKENS + 3))
    r = route_request({"prompt": ids, "max_tokens": 12})
    assert r.prompt_tokens == len(ids) and len(r.block_hashes) == 2 and r.output_tokens == 12
    text = "word " * 400   # 2,000 bytes
    t = route_request({"prompt": text})
    assert t.prompt_tokens == 2000 // 4 + 1 and len(t.block_hashes) == 2000 // TEXT_BLOCK_BYTES
    assert t.output_tokens == DEFAULT_OUTPUT_TOKENS
    batch = route_request({"prompt": [ids, ids[:10]], "max_completion_tokens": 3, "max_tokens": 9})
    assert batch.block_hashes == r.block_hashes and batch.prompt_tokens == len(ids) + 10 and batch.output_tokens == 3
    texts = route_request({"prompt": [text, "hi"]})
    assert texts.block_hashes == t.block_hashes


def test_the_next_chat_turn_starts_with_the_previous_turns_blocks() -> None:
    system = {"role": "system", "content": "You are a careful assistant. " * 40}
    turn1 = [system, {"role": "user", "content": "Summarize the attached report. " * 20}]
    turn2 = [*turn1, {"role": "assistant", "content": "Here is the summary."},
             {"role": "user", "content": [{"type": "text", "text": "Shorter please."}]}]  # fmt: skip
    r1, r2 = route_request({"messages": turn1}), route_request({"messages": turn2})
    assert len(r1.block_hashes) >= 4
    assert r2.block_hashes[: len(r1.block_hashes)] == r1.block_hashes
    other = route_request({"messages": [{"role": "system", "content": "Another bot. " * 100}]})
    assert other.block_hashes[0] != r1.block_hashes[0]


def test_session_key_from_header_else_user_field() -> None:
    assert route_request({"prompt": "hi", "user": "u1"}).session_key == "u1"
    assert route_request({"prompt": "hi", "user": "u1"}, "s9").session_key == "s9"
    assert route_request({"prompt": "hi"}).session_key is None
    assert len(route_request({"prompt": "hi"}, "k" * 10_000).session_key or "") == MAX_SESSION_KEY_CHARS
    with_session = RouteRequest(block_hashes=(5,), session_key="s")
    assert with_session.affinity_key() != RouteRequest(block_hashes=(5,)).affinity_key() == 5
    assert RouteRequest().affinity_key() is None


@pytest.mark.parametrize("doc", [
    {"prompt": {}}, {"prompt": [None, 1]}, {"prompt": [1, "a", 2.5]}, {"prompt": [[1, "a"]]}, {"prompt": []},
    {"messages": "text"}, {"messages": [1, None, {"role": 3, "content": [1, {"image_url": 5}, {"text": 7}]}]},
    {"prompt": "x", "max_tokens": -3, "user": 12}, {"prompt": "x", "max_tokens": True},
])  # fmt: skip


def test_odd_bodies_give_a_request_without_raising(doc: dict) -> None:
    r = route_request(doc)
    assert isinstance(r, RouteRequest) and r.prompt_tokens >= 0
    assert r.output_tokens == DEFAULT_OUTPUT_TOKENS      # no valid max_tokens in any of them


def test_prefill_tokens_follow_the_policys_cache_estimate() -> None:
    r = RouteRequest(prompt_tokens=1000)
    assert r.prefill_tokens == 1000
    r.cached_tokens = 640
    assert r.prefill_tokens == 360
    r.cached_tokens = 5000
    assert r.prefill_tokens == 0


def test_without_block_hashing_the_counts_stay_and_no_hash_is_made(monkeypatch):
    import router.kv.prompt_blocks as pb
    from router.pools.policies import make_policy

    doc = {"prompt": "x" * 5000, "max_tokens": 7, "user": "u"}
    full = pb.route_request(doc)
    assert full.block_hashes
    monkeypatch.setattr(pb, "text_block_hashes", lambda data: (_ for _ in ()).throw(AssertionError("hashed")))
    lean = pb.route_request(doc, hash_blocks=False)
    assert lean.block_hashes == () and (lean.prompt_tokens, lean.output_tokens, lean.session_key) == (
        full.prompt_tokens, full.output_tokens, full.session_key)
    assert make_policy("kv-aware").uses_prompt_blocks and not make_policy("latency-aware").uses_prompt_blocks
