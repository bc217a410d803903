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

KV cache events (vLLM's ``--kv-events-config``): with an ``on_event`` callback the pool reports
what enters and leaves its prefix cache as `router.kv.events` objects, when vLLM's `BlockPool`
queues them (vllm/v1/core/block_pool.py):

- `BlockStored` when full blocks of a request become cached (`cache_blocks`: one event per call,
  the request's newly cached blocks, with the hash of the block before them as
  ``parent_block_hash``, their token ids and ``block_size``), as ``cache_full_blocks`` does;
- `BlockRemoved` when allocation evicts a cached block (one event per block), as
  ``_maybe_evict_cached_block`` does from ``get_new_blocks``;
- `AllBlocksCleared` on `reset` (vLLM's ``reset_prefix_cache``, e.g. before sleeping).

As in vLLM a hash may be held by two blocks at once (two requests computed the same prefix in one
step): each block's caching is a `BlockStored` and each block's eviction a `BlockRemoved`, and
the hash stays cached while any block holds it. Hashes on the wire are unsigned 64-bit ints
(vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` default).

Used only by `fleet.enginesim.model`. Pure: no I/O, no clock. Hashes use Python's `hash` of tuples
of ints, which does not depend on PYTHONHASHSEED, so runs are reproducible.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from router.kv.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KvCacheEvent

_ROOT_HASH = 0x5EED
_U64 = (1 << 64) - 1


def wire_hash(block_hash: int) -> int:
    """A block hash as the events carry it: an unsigned 64-bit int (vLLM's ``maybe_convert_block_hash``)."""
    return block_hash & _U64


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

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True,
                 on_event: Callable[[KvCacheEvent], None] | None = None) -> None:  # fmt: skip
        """``on_event``: called with each KV cache event, in order (see the module docstring);
        None: no events are made."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.on_event = on_event
        self._next_fresh = 0                           # blocks >= this were never used
        self._ref: dict[int, int] = {}                 # used blocks -> reference count
        self._hash: dict[int, int] = {}                # cached blocks -> block hash
        self._free: OrderedDict[int, None] = OrderedDict()   # used, now free blocks, LRU first
        self._cached: dict[int, int] = {}              # block hash -> block id (the first that holds it)
        self._dups: dict[int, set[int]] = {}           # block hash -> other blocks holding it (rare)

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
                self._evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        """Release a request's blocks, tail first (vLLM frees in reverse so tails evict first)."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def cache(self, block: int, block_hash: int) -> bool:
        """Mark a full, computed block as holding the prefix whose chained hash is given; False
        when it already held one (or caching is off). Makes no event: `cache_blocks` does."""
        if not self.enable_prefix_caching or block in self._hash:
            return False
        self._hash[block] = block_hash
        held = self._cached.setdefault(block_hash, block)
        if held != block:
            self._dups.setdefault(block_hash, set()).add(block)
        return True

    def cache_blocks(self, blocks: Sequence[int], hashes: Sequence[int], token_ids: Sequence[int],
                     block_size: int, parent_hash: int | None) -> None:  # fmt: skip
        """Cache consecutive full blocks of one request (``token_ids``: their tokens, ``block_size``
        each; ``parent_hash``: the hash of the request's block before them, None for its first)
        and report the newly cached ones as one `BlockStored` (vLLM's ``cache_full_blocks``)."""
        stored = [i for i, (b, h) in enumerate(zip(blocks, hashes)) if self.cache(b, h)]
        if not stored or self.on_event is None:
            return
        if len(stored) == len(blocks):
            tokens = list(token_ids[:len(blocks) * block_size])
        else:
            tokens = [t for i in stored for t in token_ids[i * block_size:(i + 1) * block_size]]
        self.on_event(BlockStored(
            block_hashes=[wire_hash(hashes[i]) for i in stored],
            parent_block_hash=None if parent_hash is None else wire_hash(parent_hash),
            token_ids=tokens, block_size=block_size, lora_id=None, medium=MEDIUM_GPU,
        ))  # fmt: skip

    def reset(self) -> bool:
        """Drop every cached hash (vLLM's ``reset_prefix_cache``): only when no request holds a
        block, else False and nothing changes. Reports `AllBlocksCleared`."""
        if any(r > 0 for r in self._ref.values()):
            return False
        self._hash.clear()
        self._cached.clear()
        self._dups.clear()
        if self.on_event is not None:
            self.on_event(AllBlocksCleared())
        return True

    def cached_hashes(self) -> set[int]:
        """The hashes a prefix lookup finds now, as the events carry them (tests compare an
        index built from the events with this)."""
        return {wire_hash(h) for h in self._cached}

    def _evict(self, block: int) -> None:
        """Forget the hash of ``block`` (taken for reuse); report it (vLLM's ``_maybe_evict_cached_block``)."""
        h = self._hash.pop(block, None)
        if h is None:
            return
        if self._cached.get(h) == block:
            others = self._dups.get(h)
            if others:
                self._cached[h] = others.pop()
                if not others:
                    del self._dups[h]
            else:
                del self._cached[h]
        elif h in self._dups:
            self._dups[h].discard(block)
            if not self._dups[h]:
                del self._dups[h]
        if self.on_event is not None:
            self.on_event(BlockRemoved(block_hashes=[wire_hash(h)], medium=MEDIUM_GPU))
