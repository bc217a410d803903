"""The router's view of what each endpoint holds in its prefix (KV) cache.

Owns `PrefixIndex`: for every endpoint of a pool, the router blocks (chained block hashes,
`router.kv.prompt_blocks`) the endpoint is believed to hold, with an LRU bound per endpoint. Used
by the `kv-aware` routing policy (`router.pools.policies.KvAware`), which records every prompt it
routes (`record`) and asks, for the next prompt, how many leading blocks each endpoint holds
(`match`). Pure data structure: no I/O, no clock.

**Approximate, from what was routed.** The router does not see the engine's cache; it knows
where it sent each prompt. After a request ran on an endpoint, vLLM keeps its prompt's blocks
cached (freed blocks stay hashed in the free queue until reused) and evicts the least recently
used free block first; among one request's blocks the tail goes first, because vLLM frees a
request's blocks in reverse order (vllm/v1/core/block_pool.py, `free_blocks`;
vllm/v1/core/kv_cache_utils.py, `FreeKVCacheBlockQueue`). `record` mirrors both: it moves the
prompt's blocks to the most recent end of the endpoint's LRU, tail first and head last, and
evicts from the least recent end beyond `capacity_blocks`. A prompt that shares its first k
blocks with a recorded one is predicted to hit k blocks there.

The same index takes an exact view where one exists: `record` with `evict=False` and `remove`
are what a consumer of vLLM's KV cache events (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared` from `--kv-events-config`) would call.

**Memory.** At most `capacity_blocks` entries per endpoint, and one holder mask per distinct
block across endpoints: bounded by `capacity_blocks x endpoints` whatever the traffic.
Endpoints that leave the pool are dropped with `retain` (called when a pool is rebuilt).

`match` walks the prompt's blocks once with a bitmask of the endpoints that still match
(O(matched blocks), not O(blocks x endpoints)).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence


class PrefixIndex:
    """Per-endpoint LRU sets of block hashes, with a reverse map block -> endpoints.

    Args:
        capacity_blocks: most blocks remembered per endpoint (>= 1); the oldest beyond it
            are forgotten, as the engine would evict them.

    Raises:
        ValueError: `capacity_blocks` < 1.
    """

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._bit: dict[str, int] = {}              # endpoint id -> its bit (a power of two)
        self._by_bit: dict[int, str] = {}           # bit -> endpoint id
        self._lru: dict[str, OrderedDict[int, None]] = {}   # endpoint id -> blocks, LRU first
        self._holders: dict[int, int] = {}          # block hash -> mask of endpoint bits
        self._next_slot = 0
        self._free_slots: list[int] = []

    # ----- reading ----------------------------------------------------------------------

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of `hashes` each endpoint holds: endpoint id -> blocks (> 0 only).

        A block counts only if every block before it matched too (chained hashes: a prefix)."""
        holders = self._holders
        if not hashes or not holders:
            return {}
        alive = holders.get(hashes[0], 0)
        if not alive:
            return {}
        out: dict[str, int] = {}
        by_bit = self._by_bit
        depth = 1
        for depth in range(1, len(hashes)):
            still = alive & holders.get(hashes[depth], 0)
            dropped = alive & ~still
            while dropped:
                low = dropped & -dropped
                out[by_bit[low]] = depth
                dropped ^= low
            alive = still
            if not alive:
                return out
        else:
            depth = len(hashes)
        while alive:
            low = alive & -alive
            out[by_bit[low]] = depth
            alive ^= low
        return out

    def blocks(self, endpoint_id: str) -> int:
        """Blocks remembered for `endpoint_id` (0 for an unknown endpoint)."""
        lru = self._lru.get(endpoint_id)
        return len(lru) if lru is not None else 0

    def __len__(self) -> int:
        """Entries held: blocks remembered, summed over endpoints (the memory bound's unit)."""
        return sum(len(lru) for lru in self._lru.values())

    def distinct_blocks(self) -> int:
        """Distinct block hashes held by at least one endpoint."""
        return len(self._holders)

    def endpoints(self) -> list[str]:
        """Ids of the endpoints the index holds blocks for (or has a slot for), sorted."""
        return sorted(self._lru)

    # ----- writing ----------------------------------------------------------------------

    def record(self, endpoint_id: str, hashes: Sequence[int], *, evict: bool = True) -> None:
        """`endpoint_id` now holds the blocks `hashes` (a prompt's, in prompt order), most
        recently used, the head more recent than the tail; with `evict`, forget the least
        recently used blocks beyond `capacity_blocks`."""
        if not hashes:
            return
        bit = self._bit.get(endpoint_id)
        if bit is None:
            bit = self._add_endpoint(endpoint_id)
        lru = self._lru[endpoint_id]
        holders = self._holders
        for h in reversed(hashes):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                holders[h] = holders.get(h, 0) | bit
        if evict:
            excess = len(lru) - self.capacity_blocks
            for _ in range(excess):
                h, _ = lru.popitem(last=False)
                self._drop_holder(h, bit)

    def remove(self, endpoint_id: str, hashes: Collection[int]) -> None:
        """`endpoint_id` no longer holds the blocks `hashes` (e.g. a `BlockRemoved` event)."""
        lru = self._lru.get(endpoint_id)
        if lru is None:
            return
        bit = self._bit[endpoint_id]
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._drop_holder(h, bit)

    def forget(self, endpoint_id: str) -> None:
        """Drop everything known about `endpoint_id` (it left the pool, or its cache was
        cleared: `AllBlocksCleared`, a restart)."""
        lru = self._lru.pop(endpoint_id, None)
        if lru is None:
            return
        bit = self._bit.pop(endpoint_id)
        del self._by_bit[bit]
        for h in lru:
            self._drop_holder(h, bit)
        self._free_slots.append(bit.bit_length() - 1)

    def retain(self, endpoint_ids: Collection[str]) -> None:
        """Forget every endpoint not in `endpoint_ids`."""
        for endpoint_id in [e for e in self._lru if e not in endpoint_ids]:
            self.forget(endpoint_id)

    # ----- helpers ----------------------------------------------------------------------

    def _add_endpoint(self, endpoint_id: str) -> int:
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
        bit = 1 << slot
        self._bit[endpoint_id] = bit
        self._by_bit[bit] = endpoint_id
        self._lru[endpoint_id] = OrderedDict()
        return bit

    def _drop_holder(self, h: int, bit: int) -> None:
        mask = self._holders.get(h, 0) & ~bit
        if mask:
            self._holders[h] = mask
        else:
            self._holders.pop(h, None)
