"""The exact index's per-block loops (router.kv.index_ops): the compiled ones (router/kv/_kvindex.c)
give the same keys as Python's own hash and the same index as the Python ones on the same events,
refuse the same bad input, and the selection at import falls back to Python when the extension
is missing or disagrees."""

from __future__ import annotations

import random
import types
from collections import OrderedDict

import pytest

from router.kv import index_ops
from router.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.kv.exact_index import ExactIndex
from router.kv.prompt_keys import KEY_ROOT, PromptKeys

BS = 16
compiled_only = pytest.mark.skipif(index_ops.COMPILED is None,
                                   reason="router.kv._kvindex is not built here (`pip install -e .` builds it where gcc is)")  # fmt: skip


def python_chain(key: int, ids: list, size: int, count: int) -> list[int]:
    """The definition the index's keys follow: hash((parent key, tuple(block token ids)))."""
    out = []
    for b in range(count):
        key = hash((key, tuple(ids[b * size:(b + 1) * size])))
        out.append(key)
    return out


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_keys_are_pythons_own_hash_of_parent_and_block(impl: str) -> None:
    ops = index_ops.IMPLEMENTATIONS.get(impl)
    if ops is None:
        pytest.skip("router.kv._kvindex is not built here")
    rng = random.Random(7)
    edges = [KEY_ROOT, 0, -1, -2, 2**61 - 1, 2**61, 2**63 - 1, -(2**63), 2**64 + 3, -(2**70)]
    for n in range(300):
        parent = edges[n] if n < len(edges) else rng.getrandbits(64) - 2**63
        ids = [rng.choice([rng.randrange(32000), -1, 2**61 - 1, 2**62 + rng.randrange(5), -(2**64)]) for _ in range(3 * BS + 5)]
        assert ops.chain_keys(parent, ids, BS, 3) == python_chain(parent, ids, BS, 3)
        assert ops.chain_keys(parent, tuple(ids), 5, 10) == python_chain(parent, ids, 5, 10)
    assert ops.chain_keys(1, [], BS, 0) == []


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_bad_input_is_refused_with_the_same_errors(impl: str) -> None:
    ops = index_ops.IMPLEMENTATIONS.get(impl)
    if ops is None:
        pytest.skip("router.kv._kvindex is not built here")
    with pytest.raises(TypeError, match="unhashable type: 'list'"):
        ops.chain_keys(KEY_ROOT, [[1]] * BS, BS, 1)
    with pytest.raises(ValueError, match="fewer than 1 blocks of 16"):
        ops.chain_keys(KEY_ROOT, [1] * (BS - 1), BS, 1)
    with pytest.raises(ValueError, match="block_tokens must be >= 1"):
        ops.chain_keys(KEY_ROOT, [1] * BS, 0, 1)
    with pytest.raises(TypeError):
        ops.remove_blocks(OrderedDict(), {}, ~1, ["not a hash"])


def random_batches(seed: int, endpoints: list[str], n: int) -> list[tuple[str, EventBatch]]:
    """Stores that share prefixes and continue earlier chains, re-stores of a hash under another
    block, removals of held and unknown hashes (bytes and int), other media, clears."""
    rng = random.Random(seed)
    chains: dict[str, list[tuple[bytes | int, list[int]]]] = {e: [] for e in endpoints}
    out = []
    for _ in range(n):
        e = rng.choice(endpoints)
        held = chains[e]
        roll = rng.random()
        if roll < 0.55:
            blocks = rng.randint(1, 6)
            parent = rng.choice(held)[0] if held and rng.random() < 0.6 else None
            hashes: list[bytes | int] = [rng.getrandbits(64) if rng.random() < 0.5 else rng.randbytes(32)
                                         for _ in range(blocks)]  # fmt: skip
            if held and rng.random() < 0.1:
                hashes[0] = rng.choice(held)[0]   # a hash stored again, perhaps under other tokens
            tokens = [rng.randrange(50) for _ in range(blocks * BS)]   # few token values: shared keys
            held.extend((h, tokens) for h in hashes)
            out.append((e, EventBatch(0.0, [BlockStored(hashes, parent, tokens, BS, medium="GPU")])))
        elif roll < 0.93 and held:
            gone = [held.pop(rng.randrange(len(held)))[0] for _ in range(min(len(held), rng.randint(1, 4)))]
            gone.append(rng.getrandbits(64))   # one the view never held
            medium = "CPU" if rng.random() < 0.05 else None
            out.append((e, EventBatch(0.0, [BlockRemoved([g], medium=medium) for g in gone])))
        elif roll > 0.99:
            held.clear()
            out.append((e, EventBatch(0.0, [AllBlocksCleared()])))
    return out


@compiled_only
@pytest.mark.parametrize("seed", range(6))
def test_compiled_and_python_loops_build_the_same_index(seed: int) -> None:
    endpoints = ["a", "b", "c"]
    indexes = [ExactIndex(max_blocks_per_endpoint=40, ops=ops) for ops in (index_ops.PYTHON, index_ops.COMPILED)]
    for index in indexes:
        for e in endpoints:
            index.open(e)
    rng = random.Random(seed + 100)
    claimed = [rng.randrange(50) for _ in range(4 * BS)]
    for n, (e, batch) in enumerate(random_batches(seed, endpoints, 400)):
        if n % 50 == 0:
            for index in indexes:
                index.expect(e, claimed, until_s=10.0, now_s=0.0)
        for index in indexes:
            index.apply(e, batch)
    python, compiled = indexes
    assert compiled.ops is index_ops.COMPILED and python.ops is index_ops.PYTHON
    assert compiled._holders == python._holders and len(python._holders) > 20
    for e in endpoints:
        assert list(compiled._views[e].blocks.items()) == list(python._views[e].blocks.items())   # LRU order too
        assert compiled.store_counts(e) == python.store_counts(e)
        assert compiled.placed_blocks(e) == python.placed_blocks(e)
    for tokens in [claimed, [rng.randrange(50) for _ in range(3 * BS)]] + [[t % 50 for t in range(k, k + 5 * BS)]
                                                                          for k in range(20)]:  # fmt: skip
        assert compiled.match(tokens, now_s=1.0) == python.match(tokens, now_s=1.0)
        keys = PromptKeys(compiled.ops.chain_keys(KEY_ROOT, tokens, BS, len(tokens) // BS), BS)
        for now_s in (None, 1.0, 11.0):   # the engines' account; with the claims; after they expired
            assert compiled.match(keys, now_s=now_s) == python.match(keys, now_s=now_s)
            assert compiled.match(keys, now_s=now_s, rebuilding=True) == python.match(tokens, now_s=now_s, rebuilding=True)


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_the_walk_reports_where_each_endpoints_match_ends(impl: str) -> None:
    ops = index_ops.IMPLEMENTATIONS.get(impl)
    if ops is None:
        pytest.skip("router.kv._kvindex is not built here")
    holders = {10: 0b111, 11: 0b011, 12: 0b001, 13: 0b001, 2**80: 0b1 << 70}
    assert ops.walk_keys(holders, None, None, [10, 11, 12, 13, 99], 0b111) == [(1, 0b100), (2, 0b010), (4, 0b001)]
    assert ops.walk_keys(holders, None, None, [10, 11], 0b101) == [(1, 0b100), (2, 0b001)]
    assert ops.walk_keys(holders, None, None, [99, 10], 0b111) == []       # nothing matches the first block
    assert ops.walk_keys(holders, None, None, [], 0b111) == []
    claims = {11: {0b100: 5.0, 0b010: 1.0}}   # endpoint 4 claimed block 11 until 5 s
    assert ops.walk_keys(holders, claims, 2.0, [10, 11, 12], 0b111) == [(2, 0b110), (3, 0b001)]
    assert ops.walk_keys(holders, claims, 6.0, [10, 11, 12], 0b111) == [(1, 0b100), (2, 0b010), (3, 0b001)]
    wide = 0b1 << 70   # endpoints beyond 64: the masks are Python ints of any width
    assert ops.walk_keys(holders, None, None, [2**80, 2**80], wide | 1) == [(2, wide)]


@pytest.mark.parametrize("impl", ["python", "compiled"])
def test_a_claim_skips_held_keys_and_extends_its_own(impl: str) -> None:
    ops = index_ops.IMPLEMENTATIONS.get(impl)
    if ops is None:
        pytest.skip("router.kv._kvindex is not built here")
    holders = {10: 0b011, 11: 0b100}
    expected: dict = {12: {0b010: 9.0}, 13: {0b001: 1.0}}
    assert ops.claim_keys(holders, expected, 0b010, 5.0, [10, 11, 12, 13, 14]) == [11, 13, 14]
    assert expected == {12: {0b010: 9.0}, 13: {0b001: 1.0, 0b010: 5.0}, 14: {0b010: 5.0}, 11: {0b010: 5.0}}
    assert ops.claim_keys(holders, expected, 0b010, 7.0, iter([11, 12, 14])) == []   # claimed already: not news
    assert expected[11] == {0b010: 7.0} and expected[12] == {0b010: 9.0} and expected[14] == {0b010: 7.0}
    wide = 0b1 << 70   # endpoints beyond 64: the masks are Python ints of any width
    assert ops.claim_keys({2**80: wide}, expected, wide, 3.0, [2**80, 2**81]) == [2**81]


def test_the_python_loops_are_selected_when_the_extension_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(name: str) -> types.ModuleType:
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(index_ops.importlib, "import_module", missing)
    assert index_ops._compiled() is None


def test_an_extension_older_than_this_module_is_not_selected(monkeypatch: pytest.MonkeyPatch) -> None:
    stale = types.SimpleNamespace(chain_keys=index_ops.chain_keys, store_blocks=index_ops.store_blocks,
                                  remove_blocks=index_ops.remove_blocks,
                                  walk_keys=index_ops.walk_keys)   # built before claim_keys  # fmt: skip
    monkeypatch.setattr(index_ops.importlib, "import_module", lambda name: stale)
    assert index_ops._compiled() is None


def test_an_extension_whose_keys_disagree_is_not_selected(monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    wrong = types.SimpleNamespace(chain_keys=lambda key, ids, size, count: [0] * count, walk_keys=index_ops.walk_keys,
                                  store_blocks=index_ops.store_blocks, remove_blocks=index_ops.remove_blocks,
                                  claim_keys=index_ops.claim_keys)  # fmt: skip
    monkeypatch.setattr(index_ops.importlib, "import_module", lambda name: wrong)
    assert index_ops._compiled() is None
    assert "disagrees" in caplog.text


@compiled_only
def test_where_built_the_compiled_loops_are_what_the_index_runs() -> None:
    assert index_ops.SELECTED is index_ops.COMPILED and ExactIndex().ops is index_ops.COMPILED
