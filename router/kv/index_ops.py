"""The exact index's per-block loops, in two implementations of one behaviour: compiled and Python.

Owns `IndexOps` (the five loops: `chain_keys`, `store_blocks`, `remove_blocks`, `walk_keys`, `claim_keys`), `PYTHON` (this
module's own functions), `COMPILED` (the same loops in C, `router/kv/_kvindex.c`; None when the
extension was not built or fails its check) and `SELECTED` (the compiled one when present, else
Python), chosen once at import. `router.kv.exact_index.ExactIndex` applies every `BlockStored` and
`BlockRemoved`, matches a prompt's keys and claims them at an endpoint (the endpoint picker's picks)
through `SELECTED` (or the `IndexOps` it is given);
`router.kv.prompt_keys` chains a prompt's keys with it. Pure: no I/O.

Why compiled: applying a batch is a loop per block (chain a key, look the engine hash up, set
the holder mask), and the profile of the picker's ingest (docs/routing.md, "What the index
costs") puts most of its CPU in that loop's bytecode, not in the dict operations it calls. The
extension is built by the package's own build (pyproject.toml, ``[tool.setuptools]``
``ext-modules``, optional: a machine without a C compiler installs the package all the same and
runs the Python loops). Before it is selected, its keys are checked against Python's own
``hash((parent, block))`` (`_agrees`): a Python whose hashes differ (another int or tuple hash)
gets the Python loops, so both give the same index everywhere.
"""

from __future__ import annotations

import importlib
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

log = logging.getLogger(__name__)


class IndexOps(NamedTuple):
    """One implementation of the index's per-block loops (`PYTHON` or `COMPILED`); `name` says which."""

    name: str
    chain_keys: Callable[[int, Sequence[int], int, int], list[int]]
    store_blocks: Callable[[OrderedDict, dict, int, Sequence, Sequence[int]], None]
    remove_blocks: Callable[[OrderedDict, dict, int, Sequence], None]
    walk_keys: Callable[[dict, dict | None, float | None, Sequence[int], int], list[tuple[int, int]]]
    claim_keys: Callable[[dict, dict, int, float, Iterable[int]], list[int]]


def chain_keys(key: int, token_ids: Sequence[int], block_tokens: int, count: int) -> list[int]:
    """The router keys of the first `count` blocks of `block_tokens` tokens of `token_ids`, chained
    from parent `key`: ``key_i = hash((key_{i-1}, tuple(block_i)))`` (`router.kv.prompt_keys.chain_key`).

    Raises:
        ValueError: `block_tokens` < 1, `count` < 0, or `token_ids` shorter than `count` blocks.
        TypeError: a token id that is unhashable (a list, a dict).
    """
    if block_tokens < 1 or count < 0:
        raise ValueError(f"block_tokens must be >= 1 and count >= 0, got {block_tokens} and {count}")
    if count > len(token_ids) // block_tokens:
        raise ValueError(f"token_ids hold {len(token_ids)} tokens, fewer than {count} blocks of {block_tokens}")
    ids = token_ids if type(token_ids) is tuple else tuple(token_ids)   # slices of a tuple are tuples
    out = []
    start = 0
    for _ in range(count):
        key = hash((key, ids[start:start + block_tokens]))
        start += block_tokens
        out.append(key)
    return out


def _engine_hash(h: bytes | int) -> int:
    return h if type(h) is int else int.from_bytes(h[-8:], "big")  # type: ignore[index]


def store_blocks(blocks: OrderedDict, holders: dict, bit: int, hashes: Sequence, keys: Sequence[int]) -> None:
    """Enter stored blocks in one endpoint's view: for each engine hash (bytes: its low 64 bits)
    and router key, in order, ``blocks[hash] = key`` as the most recent entry and `bit` set in
    ``holders[key]``; a hash held under another key drops `bit` from the old key's mask (a key
    whose mask is left empty is dropped). Pairs beyond the shorter of the two are ignored."""
    others = ~bit
    for h, key in zip(hashes, keys):
        eh = _engine_hash(h)
        old = blocks.get(eh)
        if old is None:
            blocks[eh] = key
            holders[key] = holders.get(key, 0) | bit
            continue
        blocks.move_to_end(eh)
        if old != key:
            mask = holders.get(old, 0) & others
            if mask:
                holders[old] = mask
            else:
                holders.pop(old, None)
            blocks[eh] = key
            holders[key] = holders.get(key, 0) | bit


def remove_blocks(blocks: OrderedDict, holders: dict, others: int, hashes: Sequence) -> None:
    """Drop removed blocks from one endpoint's view: each engine hash held in `blocks` is popped and
    its key's mask in `holders` is and-ed with `others` (every bit but the endpoint's), the key
    dropped when none is left. Hashes not held are skipped."""
    for h in hashes:
        key = blocks.pop(_engine_hash(h), None)
        if key is not None:
            mask = holders.get(key, 0) & others
            if mask:
                holders[key] = mask
            else:
                holders.pop(key, None)


def walk_keys(holders: dict, expected: dict | None, now_s: float | None, keys: Sequence[int],
              alive: int) -> list[tuple[int, int]]:  # fmt: skip
    """Walk a prompt's router `keys` in order with `alive`, the mask of endpoints still matching:
    returns ``(blocks, mask)`` pairs, `mask` the endpoints whose match ends after `blocks` whole
    blocks (> 0), in order, the last pair for those that hold every key. An endpoint holds a key
    when its bit is in ``holders[key]`` or, with `expected` (router key -> {endpoint bit: until_s},
    `ExactIndex.expect`), claimed there until `now_s` or later. Stops where no endpoint matches."""
    out = []
    depth = 0
    for key in keys:
        mask = holders.get(key, 0)
        if expected:
            waiting = expected.get(key)
            if waiting:
                for bit, until_s in waiting.items():
                    if until_s >= now_s:
                        mask |= bit
        still = alive & mask
        if depth and still != alive:
            out.append((depth, alive ^ still))
        alive = still
        if not alive:
            return out
        depth += 1
    if depth:
        out.append((depth, alive))
    return out


def claim_keys(holders: dict, expected: dict, bit: int, until_s: float, keys: Iterable[int]) -> list[int]:
    """Claim router `keys` for the endpoint of `bit` until `until_s` in `expected` (router key ->
    {endpoint bit: until_s}, `ExactIndex.expect_keys`): a key whose ``holders[key]`` has `bit` is
    skipped (the engine holds it), a key claimed there already has its claim extended to `until_s`
    when that is later. Returns the keys newly claimed, in order."""
    claimed = []
    for key in keys:
        if holders.get(key, 0) & bit:
            continue   # the engine's account already holds it
        waiting = expected.get(key)
        if waiting is None:
            expected[key] = {bit: until_s}
        else:
            before = waiting.get(bit)
            if before is not None:
                if before < until_s:
                    waiting[bit] = until_s   # claimed again: it lasts longer, and is not news
                continue
            waiting[bit] = until_s
        claimed.append(key)
    return claimed


PYTHON = IndexOps("python", chain_keys, store_blocks, remove_blocks, walk_keys, claim_keys)
"""The loops above, in Python: what runs where the extension is not built."""


def _agrees(ops: IndexOps) -> bool:
    """Whether `ops` gives the same keys and views as `PYTHON` on a sample that crosses the hashes'
    edges (negative, large and -1-hashing parents; bytes and int engine hashes)."""
    for parent in (0x6B76_E7E4_7EED, -1, -2, 2**61 - 1, 2**63 - 1, -(2**63), 2**64 + 5, True):
        ids = [0, 1, 2**31, 2**61, -1, 2**70, 16, 7] * 4
        if ops.chain_keys(parent, ids, 8, 4) != chain_keys(parent, ids, 8, 4):
            return False
    views = []
    for impl in (ops, PYTHON):
        blocks: OrderedDict = OrderedDict()
        holders: dict = {3: 0b10}
        impl.store_blocks(blocks, holders, 1, [b"\x01" * 32, 7, b"\x02"], [3, 4, 5])
        impl.store_blocks(blocks, holders, 1, [7, 9], [6, 4])
        impl.remove_blocks(blocks, holders, ~1, [b"\x01" * 32, 11])
        expected = {4: {2: 5.0, 4: 1.0}, 6: {2: 9.0}}
        walks = [impl.walk_keys(holders, expected, 2.0, keys, 0b111) for keys in ([3, 4, 6], [4, 6, 6], [3, 3, 3])]
        claims = [impl.claim_keys(holders, expected, bit, until_s, [3, 4, 6, 8, 8, 2**80])
                  for bit, until_s in ((2, 7.0), (2, 3.0), (4, 2.0), (2**70, 1.0))]  # fmt: skip
        views.append((list(blocks.items()), holders, walks, claims, expected))
    return views[0] == views[1]


def _compiled() -> IndexOps | None:
    try:
        ext = importlib.import_module("router.kv._kvindex")
        ops = IndexOps("compiled", ext.chain_keys, ext.store_blocks, ext.remove_blocks, ext.walk_keys, ext.claim_keys)
    except (ImportError, AttributeError):   # not built, or built from an older source than this module's
        return None
    if not _agrees(ops):
        log.warning("router.kv._kvindex disagrees with Python's hashes here; the index runs its Python loops")
        return None
    return ops


COMPILED = _compiled()
"""The compiled loops (router/kv/_kvindex.c), or None where the extension is missing or disagrees."""

SELECTED = COMPILED or PYTHON
"""What `ExactIndex` runs unless told otherwise: compiled when present."""

IMPLEMENTATIONS = {ops.name: ops for ops in (PYTHON, COMPILED) if ops is not None}
"""The implementations present here, by name ("python", and "compiled" where built)."""
