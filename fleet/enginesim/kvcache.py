"""KV-cache blocks and the prefix cache of the engine SIMULATOR.

Owns `BlockPool`: a fixed number of KV blocks of ``block_size`` tokens, reference counts, an
LRU queue of free blocks, and the map from block hash to cached block. Mirrors vLLM v1's
`BlockPool` / `KVCacheManager` (vllm/v1/core/block_pool.py, kv_cache_utils.py):

- A block is cached once it is full of computed tokens; its hash chains the parent block's
  hash with the block's token ids (`block_hashes`), so equal hashes mean equal prefixes.
- Freed blocks keep their hash and go to the tail of the free queue; allocation takes blocks
  from the head, evicting their hash. A request freed its blocks tail first, so the tail of a
  prompt is evicted before its head.
- A prefix hit takes a cached block out of the free queue (if no running request holds it) and
  raises its reference count.

Used only by `fleet.enginesim.model`. Pure: no I/O, no clock. Hashes use Python's `hash` of tuples
of ints, which does not depend on PYTHONHASHSEED, so runs are reproducible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

_ROOT_HASH = 0x5EED


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``parent`` continues a chain: the hash of the block before ``token_ids[0]``.
    """
    h = _ROOT_HASH if parent is None else parent
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start:start + block_size])))
        out.append(h)
    return out


class BlockPool:
    """``num_blocks`` KV blocks; block ids are 0..num_blocks-1.

    Memory grows with the blocks ever used, not with ``num_blocks``: never-used blocks are a
    range (they sit at the head of vLLM's free queue, so they are handed out first), which keeps
    an idle replica with a GPU-sized cache small.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._next_fresh = 0                           # blocks >= this were never used
        self._ref: dict[int, int] = {}                 # used blocks -> reference count
        self._hash: dict[int, int] = {}                # cached blocks -> block hash
        self._free: OrderedDict[int, None] = OrderedDict()   # used, now free blocks, LRU first
        self._cached: dict[int, int] = {}              # block hash -> block id

    @property
    def num_free(self) -> int:
        """Blocks no request holds (cached ones included: they are evictable)."""
        return self.num_blocks - self._next_fresh + len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1 (vLLM's `vllm:kv_cache_usage_perc`)."""
        return 1.0 - self.num_free / self.num_blocks

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``, at most ``max_blocks``."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for h in hashes[:max_blocks]:
            block = self._cached.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them uses free capacity)."""
        return sum(1 for b in blocks if self._ref.get(b, 0) == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Take prefix-hit blocks for a request (out of the free queue if nobody held them)."""
        for b in blocks:
            ref = self._ref.get(b, 0)
            if ref == 0:
                del self._free[b]
            self._ref[b] = ref + 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks from the head of the free queue. Raises ValueError if too few."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._next_fresh < self.num_blocks:
                b = self._next_fresh
                self._next_fresh += 1
            else:
                b, _ = self._free.popitem(last=False)
                h = self._hash.pop(b, None)
                if h is not None and self._cached.get(h) == b:
                    del self._cached[h]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Release a request's blocks, tail first (vLLM frees in reverse so tails evict first)."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def cache(self, block: int, block_hash: int) -> None:
        """Mark a full, computed block as holding the prefix whose chained hash is given."""
        if not self.enable_prefix_caching or block in self._hash:
            return
        self._hash[block] = block_hash
        self._cached.setdefault(block_hash, block)
