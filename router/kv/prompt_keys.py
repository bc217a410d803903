"""A prompt as the exact index keys its blocks: router keys chained over token ids.

Owns `KEY_ROOT`, `chain_key`, `PromptKeys` and `prompt_keys`. `router.kv.exact_index.ExactIndex`
chains every stored block's key with `chain_key` and matches a prompt's token ids or its
`PromptKeys`; a router that asks the endpoint picker (`router.picker.client`) computes a prompt's
keys here and sends them (`router.picker.wire`), so the token ids stay with the router. Pure.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.kv import index_ops

KEY_ROOT = 0x6B76_E7E4_7EED
"""The parent key of a prompt's first block (any fixed int: keys must agree across routers)."""


def chain_key(parent_key: int, block: tuple[int, ...]) -> int:
    """The router key of `block` (its token ids) below `parent_key`. Python's hash of a tuple of
    ints does not depend on the process (no hash randomization for ints), so every router and the
    picker chain the same keys."""
    return hash((parent_key, block))


class PromptKeys:
    """A prompt as the router keys of its whole blocks at one block size, in prompt order (`keys`,
    chained with `chain_key` from `KEY_ROOT`; `block_tokens`): what `ExactIndex.match` and `expect` read
    in place of token ids when the ids stayed with the router that computed the keys (`prompt_keys`;
    the endpoint picker's wire, `router.picker.wire`). It matches only endpoints whose block size is
    `block_tokens`. Truthy when it holds a block."""

    __slots__ = ("keys", "block_tokens")

    def __init__(self, keys: Sequence[int], block_tokens: int) -> None:
        self.keys = keys
        self.block_tokens = block_tokens

    def __len__(self) -> int:
        """Prompt tokens the keys cover (whole blocks)."""
        return len(self.keys) * self.block_tokens


def prompt_keys(token_ids: Sequence[int], block_tokens: int) -> PromptKeys:
    """The router keys of the whole `block_tokens`-token blocks of `token_ids` (`PromptKeys`),
    chained by `router.kv.index_ops.SELECTED` (compiled where built; the same keys either way).

    Raises TypeError if `token_ids` holds something unhashable (a list, a dict), ValueError if
    `block_tokens` < 1."""
    keys = index_ops.SELECTED.chain_keys(KEY_ROOT, token_ids, block_tokens, len(token_ids) // block_tokens)
    return PromptKeys(keys, block_tokens)

