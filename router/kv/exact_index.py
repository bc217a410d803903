"""The exact view of what each endpoint holds in its prefix (KV) cache, from the engines' own events.

Owns `ExactIndex` and `StreamState`. Fed by the router's KV event subscribers
(`router.signals.kv_subscriber`, one per endpoint, decoding vLLM's `--kv-events-config` stream with
`router.kv.events`) and, in virtual time, by the trace simulator with the batches its simulated
engines emit; read by the `kv-aware` policy (`router.pools.policies.KvAware`), which uses it for the
endpoints whose stream is live and its approximate `router.kv.prefix_index.PrefixIndex` for the
rest. Pure data structure: no I/O, no clock (the subscriber says when a stream is up or down).

**Keys.** The engine names a block by its own hash (sha256 over the parent's hash, the block's
token ids and extra keys; vllm/v1/core/kv_cache_utils.py `hash_block_tokens`), which the router
cannot recompute for a prompt (the hash function, its seed and the extra keys are the engine's).
So every stored block also gets a router key, chained over token ids the way
`router.kv.prompt_blocks.token_id_block_hashes` chains them: ``key = hash((parent key, tuple(block
token ids)))`` from `KEY_ROOT`, with the engine's block size. A prompt's token ids hashed the same
way give the same keys exactly where the engine holds the same prefix; `match` walks them. Per
endpoint the index maps engine hash -> router key (a `BlockStored`'s parent is looked up there;
a `BlockRemoved` names engine hashes) and keeps, per router key, the bitmask of endpoints that
hold it. Byte hashes are reduced to their low 64 bits, as vLLM does for its int hashes
(`maybe_convert_block_hash`), so both encodings give the same entries.

What is left out, because a prompt's token ids cannot match it: blocks with extra keys (LoRA,
multimodal inputs, cache salt) and their descendants, LoRA blocks, blocks of KV cache groups
other than 0 (the full-attention group of a hybrid model; the only group of others), blocks on
other media than the GPU (offload tiers), and blocks whose parent the index does not hold
(stored before the stream was seen). Each is counted in `skipped_blocks`. A block stored twice
(two physical copies of one hash) is one entry, dropped at the first removal: the view errs
towards holding less than the engine, never more.

**Memory.** At most `max_blocks_per_endpoint` entries per endpoint (default
`DEFAULT_MAX_BLOCKS_PER_ENDPOINT`); beyond it the least recently stored entry is dropped, as the
engine would have evicted it. The engine's own cache is smaller than the cap in any sane setup,
so the cap binds only when removals were lost; the index is bounded by cap x endpoints whatever
the traffic (loadtests/bench_router_memory.py `--policy-stream N --kv-events`).

**What the router sent, not yet stored** (`expect`). The engine reports a prompt's blocks only
once it has scheduled the prompt's prefill, and the report reaches the router a tick later; in
between, a second request sharing the prefix would see it nowhere. So the policy may tell the
index what it sent where: those blocks count as held there (`match` with `now_s`) until the
engine's `BlockStored` for each arrives, its view is cleared, or the claim expires. The
endpoint picker moves a claim where a late pick went (`Claim`, taken with `expect_keys`;
`router.picker.state`). This is the one part of the index that is the routers' own account, not the engines'.

**Liveness** (`state`): an endpoint's view is LIVE when its stream is up (`stream_up`) and the
view is complete: it was built from a known-empty cache (`reset(known_empty=True)`: a fresh
publisher replayed from seq 0, or an `AllBlocksCleared`) or declared rebuilt (`rebuilt`) after
a partial start. A view reset with ``known_empty=False`` (a gap replay could not cover) is
REBUILDING; a stream that is down is DOWN. `match` answers for live endpoints, and when asked
(``rebuilding=True``) for REBUILDING ones too: what a rebuilding view holds the engine holds, but
not the reverse, so `kv-aware` takes the larger of it and its approximate index there.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from typing import NamedTuple

from router.kv import index_ops
from router.kv.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.kv.index_ops import IndexOps
from router.kv.prompt_keys import KEY_ROOT, PromptKeys

DEFAULT_MAX_BLOCKS_PER_ENDPOINT = 262_144
"""Most blocks the index holds per endpoint: 4M tokens at vLLM's 16-token blocks, ten times the
KV cache of an H100 serving an 8B model (27,000 blocks, fleet/enginesim/profiles.py) and more
than an H200 holds for an 8B model (~57,000 blocks). About 230 bytes per block (measured with
tracemalloc: the OrderedDict entry, two 64-bit ints, the holder mask; ~300 bytes of RSS), so at
most ~57 MiB of Python objects (~75 MiB RSS) per endpoint, reached only if removals are lost;
while they arrive the view is the engine's own size (27,000 blocks: ~6 MiB)."""


class Claim(NamedTuple):
    """Blocks a router sent to an endpoint for prefill and claimed there (`ExactIndex.expect`):
    what the endpoint picker moves to the endpoint a late pick went to (`router.picker.state`)."""

    endpoint_id: str
    keys: list[int]    # router keys, in prompt order (the view's blocks left out)
    until_s: float     # the claim's end, on the claiming router's clock


class StreamState(enum.Enum):
    """What the index knows of one endpoint's KV event stream (derived in `ExactIndex.state`)."""

    UNKNOWN = "unknown"        # never heard of
    DOWN = "down"              # stream not connected: the approximate index applies
    REBUILDING = "rebuilding"  # connected, view partial since a resync: the approximate index applies
    LIVE = "live"              # connected and the view is complete: the exact index applies

    def exact(self) -> bool:
        """Whether routing may trust the exact view of an endpoint in this state."""
        return self is StreamState.LIVE


class _View:
    """One endpoint's blocks and stream facts."""

    __slots__ = ("bit", "blocks", "block_tokens", "connected", "complete", "last_seq", "events", "skipped_blocks",
                 "stored_blocks", "orphan_blocks", "claims")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.blocks: OrderedDict[int, int] = OrderedDict()  # engine hash (64-bit) -> router key, oldest first
        self.block_tokens: int | None = None   # the engine's block size, learned from its first BlockStored
        self.connected = False
        self.complete = False
        self.last_seq: int | None = None
        self.events = 0
        self.skipped_blocks = 0
        self.stored_blocks = 0   # blocks of BlockStored events entered in the view (since it was created)
        self.orphan_blocks = 0   # ... left out because their parent was not in the view
        self.claims = 0   # (key, this endpoint) entries in `ExactIndex._expected`: claimed, not yet stored


def engine_hash(h: bytes | int) -> int:
    """An engine block hash as the index keys it: ints as they are (vLLM's int mode is already the
    low 64 bits), bytes reduced to their low 64 bits (what vLLM's int mode would have sent)."""
    if type(h) is int:
        return h
    return int.from_bytes(h[-8:], "big")  # type: ignore[index]


class ExactIndex:
    """Per-endpoint exact block views, matched by a prompt's token ids.

    Args:
        max_blocks_per_endpoint: most entries per endpoint (>= 1); see the module docstring.
        ops: the per-block loops to apply events and walk a prompt's keys with
            (`router.kv.index_ops.IndexOps`); None: the one selected at import
            (`index_ops.SELECTED`: compiled where the extension is built). Both give the same
            index; tests run each.

    Raises:
        ValueError: `max_blocks_per_endpoint` < 1.
    """

    def __init__(self, max_blocks_per_endpoint: int = DEFAULT_MAX_BLOCKS_PER_ENDPOINT, *,
                 ops: IndexOps | None = None) -> None:  # fmt: skip
        if max_blocks_per_endpoint < 1:
            raise ValueError(f"max_blocks_per_endpoint must be >= 1, got {max_blocks_per_endpoint}")
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self.ops = ops if ops is not None else index_ops.SELECTED
        self._views: dict[str, _View] = {}
        self._by_bit: dict[int, str] = {}
        self._holders: dict[int, int] = {}   # router key -> mask of endpoint bits
        self._next_slot = 0
        self._free_slots: list[int] = []
        # (LIVE, LIVE or REBUILDING): block tokens -> mask of those endpoints (cached; None: to derive)
        self._masks: tuple[dict[int, int], dict[int, int]] | None = None
        # router key -> {endpoint bit: until_s}: blocks this router sent for prefill, not yet stored (`expect`)
        self._expected: dict[int, dict[int, float]] = {}
        self._expect_calls = 0

    # ----- stream facts (the subscriber, or the trace simulator) ----------------------------------------

    def stream_up(self, endpoint_id: str) -> None:
        """The endpoint's stream is connected."""
        self._view(endpoint_id).connected = True
        self._masks = None

    def stream_down(self, endpoint_id: str) -> None:
        """The endpoint's stream is down (disconnected, stalled): routing falls back for it."""
        view = self._views.get(endpoint_id)
        if view is not None:
            view.connected = False
            self._masks = None

    def reset(self, endpoint_id: str, *, known_empty: bool) -> None:
        """Drop the endpoint's view. `known_empty`: the engine's cache is known to have been empty
        where the events that follow begin (a fresh publisher read from seq 0), so the view is
        complete again; otherwise it is partial until `rebuilt`."""
        view = self._view(endpoint_id)
        self._clear(view)
        view.complete = known_empty
        self._masks = None

    def rebuilt(self, endpoint_id: str) -> None:
        """Trust the endpoint's view again after a partial start (the subscriber's rebuild time)."""
        view = self._views.get(endpoint_id)
        if view is not None:
            view.complete = True
            self._masks = None

    def open(self, endpoint_id: str) -> None:
        """A stream that starts with the engine: up, empty and complete (the trace simulator)."""
        self.reset(endpoint_id, known_empty=True)
        self.stream_up(endpoint_id)

    # ----- events -----------------------------------------------------------------------------------

    def apply(self, endpoint_id: str, batch: EventBatch, seq: int | None = None) -> int:
        """Apply one batch of the endpoint's events, in order; `seq` (its sequence number) is kept
        as `last_seq`. Returns the events applied. An `AllBlocksCleared` empties the view and
        makes it complete (the engine's cache is known empty)."""
        view = self._view(endpoint_id)
        blocks = view.blocks
        holders = self._holders
        others = ~view.bit
        remove = self.ops.remove_blocks
        for event in batch.events:
            kind = type(event)
            if kind is BlockRemoved:   # the commonest: one per evicted block
                if event.medium in (None, MEDIUM_GPU) and event.group_idx in (None, 0):
                    remove(blocks, holders, others, event.block_hashes)
            elif kind is BlockStored:
                self._stored(view, event)
            elif kind is AllBlocksCleared:
                self._clear(view)
                if not view.complete:
                    view.complete = True
                    self._masks = None
        view.events += len(batch.events)
        if seq is not None:
            view.last_seq = seq
        return len(batch.events)

    def _stored(self, view: _View, event: BlockStored) -> None:
        hashes = event.block_hashes
        size = event.block_size
        tokens = event.token_ids
        if (event.medium not in (None, MEDIUM_GPU) or event.group_idx not in (None, 0) or event.lora_name is not None
                or event.lora_id is not None or len(tokens) != len(hashes) * size):  # fmt: skip
            view.skipped_blocks += len(hashes)
            return
        if view.block_tokens != size:
            if view.block_tokens is not None and view.blocks:
                view.skipped_blocks += len(hashes)   # one block size per endpoint (the engine's)
                return
            view.block_tokens = size
            self._masks = None
        parent = event.parent_block_hash
        if parent is None:
            key = KEY_ROOT
        else:
            found = view.blocks.get(engine_hash(parent))
            if found is None:
                view.skipped_blocks += len(hashes)   # stored before we saw the stream
                view.orphan_blocks += len(hashes)
                return
            key = found
        extra = event.extra_keys
        if extra is not None and any(k is not None for k in extra):
            clean = next(i for i, k in enumerate(extra) if k is not None)
            view.skipped_blocks += len(hashes) - clean   # keys the token ids alone cannot match
            hashes = hashes[:clean]
        blocks = view.blocks
        bit = view.bit
        view.stored_blocks += len(hashes)
        keys = self.ops.chain_keys(key, tokens, size, len(hashes))
        expected = self._expected
        if expected:   # the engine stored what was claimed: its own account answers from now on
            for key in keys:
                waiting = expected.get(key)
                if waiting is not None and waiting.pop(bit, None) is not None:
                    view.claims -= 1
                    if not waiting:
                        del expected[key]
        self.ops.store_blocks(blocks, self._holders, bit, hashes, keys)
        excess = len(blocks) - self.max_blocks_per_endpoint
        for _ in range(excess):
            _, old_key = blocks.popitem(last=False)
            self._drop_holder(old_key, bit)

    # ----- what this router sent (not the engines' account) ------------------------------------------

    def expect(self, endpoint_id: str, token_ids: Sequence[int], until_s: float, now_s: float) -> list[int]:
        """This router sent a prompt of `token_ids` to `endpoint_id`: its whole blocks count as held
        there (`match` with `now_s`) until the engine reports each one stored (a `BlockStored`;
        from then on the engine's own account answers, evictions included), the view is cleared,
        or `until_s`, whichever comes first. It covers the time the prompt waits and prefills,
        when the engine has not stored it yet and the next request sharing its prefix would
        otherwise go elsewhere and compute it again (docs/routing.md, "Prefixes on their way").

        Keys are chained with the endpoint's block size (known from its events); an endpoint
        without one, or a prompt shorter than a block, claims nothing. Returns the keys newly claimed
        (neither held nor claimed there already), in prompt order (what `expect_keys` takes). `now_s`: the caller's clock, for the sweep of expired claims (every
        256 calls). Memory: one entry per block claimed and not yet stored or expired."""
        view = self._views.get(endpoint_id)
        size = view.block_tokens if view is not None else None
        if type(token_ids) is PromptKeys:   # chained already (the endpoint picker's requests)
            keys = token_ids.keys if size == token_ids.block_tokens else ()
            return self.expect_keys(endpoint_id, keys, until_s, now_s)
        if view is None or size is None or len(token_ids) < size:
            self._count_expect(now_s)
            return []
        try:   # whole blocks; a client's "token ids" holding a list or a dict claim nothing
            keys = self.ops.chain_keys(KEY_ROOT, token_ids, size, len(token_ids) // size)
        except TypeError:
            self._count_expect(now_s)
            return []
        return self.expect_keys(endpoint_id, keys, until_s, now_s)

    def expect_keys(self, endpoint_id: str, keys: Iterable[int], until_s: float, now_s: float) -> list[int]:
        """Claim router `keys` at `endpoint_id` until `until_s`, as `expect` does for a prompt: how a
        claim made elsewhere (the keys an `expect` returned) is taken. Keys the view holds are
        skipped; nothing is claimed at an endpoint the index has not seen (its bit would be
        another endpoint's later). Returns the keys newly claimed (a key claimed there already
        only has its claim extended, and is left out)."""
        self._count_expect(now_s)
        view = self._views.get(endpoint_id)
        if view is None:
            return []
        claimed = self.ops.claim_keys(self._holders, self._expected, view.bit, until_s, keys)
        view.claims += len(claimed)
        return claimed

    def withdraw(self, endpoint_id: str, keys: Iterable[int]) -> None:
        """Drop the claims of `keys` at `endpoint_id` (`expect_keys`): the prompt went elsewhere (a
        pick the router could not wait for, `router.picker.state.PickerState.placed`)."""
        view = self._views.get(endpoint_id)
        expected = self._expected
        for key in keys if view is not None else ():
            waiting = expected.get(key)
            if waiting is not None and waiting.pop(view.bit, None) is not None:  # type: ignore[union-attr]
                view.claims -= 1  # type: ignore[union-attr]
                if not waiting:
                    del expected[key]

    def _count_expect(self, now_s: float) -> None:
        self._expect_calls += 1
        if self._expect_calls % 256 == 0:
            self._sweep_expected(now_s)

    def expected_blocks(self) -> int:
        """(router key, endpoint) pairs expected and not yet stored (`expect`), expired ones included
        until the next sweep."""
        return sum(len(waiting) for waiting in self._expected.values())

    def _sweep_expected(self, now_s: float) -> None:
        expected = self._expected
        views = self._views
        by_bit = self._by_bit
        for key in list(expected):
            waiting = expected[key]
            for bit in [b for b, until_s in waiting.items() if until_s < now_s]:
                del waiting[bit]
                views[by_bit[bit]].claims -= 1
            if not waiting:
                del expected[key]

    # ----- reading ----------------------------------------------------------------------------------

    def state(self, endpoint_id: str) -> StreamState:
        """The endpoint's stream state, derived from the facts the subscriber reported."""
        view = self._views.get(endpoint_id)
        if view is None:
            return StreamState.UNKNOWN
        if not view.connected:
            return StreamState.DOWN
        return StreamState.LIVE if view.complete else StreamState.REBUILDING

    def any_live(self, *, rebuilding: bool = False) -> bool:
        """Whether `match` answers for some endpoint (one LIVE, or with `rebuilding` also one
        REBUILDING, with a block size known): what `router.pools.pool.Pool.wants_token_ids` asks
        before `router.request.prepare` tokenizes a prompt."""
        return bool(self._by_size(rebuilding))

    def live(self, endpoint_id: str) -> bool:
        """Whether `match` answers for the endpoint (its state is LIVE)."""
        view = self._views.get(endpoint_id)
        return view is not None and view.connected and view.complete

    def match(self, token_ids: Sequence[int], *, rebuilding: bool = False, now_s: float | None = None) -> dict[str, int]:
        """Leading prompt tokens each live endpoint holds: endpoint id -> tokens (> 0 only; whole
        blocks of that endpoint's block size). O(matched blocks) per block size in use: the
        prompt is hashed only as far as some endpoint still matches.

        `rebuilding`: also answer for REBUILDING endpoints, from the blocks their engines stored
        since the view was dropped: a subset of what they hold (a prefix cached before the resync
        and never stored again is missing, and so is every block stored below it), so such an
        answer is a lower bound, where a LIVE endpoint's is exact.

        `now_s`: also count the blocks this router sent there and the engine has not stored yet
        (`expect`, while unexpired at `now_s`); None: the engines' account alone. `token_ids` may
        be the prompt's keys (`router.kv.prompt_keys.PromptKeys`, as `expect` also takes them).

        Token ids are not checked one by one (the request path passes a client's token-id prompt as
        parsed): one that holds something unhashable (a list, a dict) matches nothing, and the
        engine answers the request 400."""
        try:
            return self._match(token_ids, rebuilding, now_s)
        except TypeError:
            return {}

    def _match(self, token_ids: Sequence[int], rebuilding: bool, now_s: float | None) -> dict[str, int]:
        holders = self._holders
        expected = self._expected if now_s is not None else None
        if not token_ids or not (holders or expected):
            return {}
        if expected:
            def holders_of(key: int) -> int:
                mask = holders.get(key, 0)
                waiting = expected.get(key)
                if waiting:
                    for bit, until_s in waiting.items():
                        if until_s >= now_s:
                            mask |= bit
                return mask
        else:
            def holders_of(key: int) -> int:
                return holders.get(key, 0)
        live = self._by_size(rebuilding)
        out: dict[str, int] = {}
        by_bit = self._by_bit
        if type(token_ids) is PromptKeys:
            size = token_ids.block_tokens
            alive = live.get(size, 0)
            for blocks, mask in self.ops.walk_keys(holders, expected, now_s, token_ids.keys, alive) if alive else ():
                while mask:
                    low = mask & -mask
                    out[by_bit[low]] = blocks * size
                    mask ^= low
            return out
        n = len(token_ids)
        ids: Sequence[int] | None = None   # the prompt as a tuple (slices of a tuple are tuples), made once
        for size, alive in live.items():
            if n < size:
                continue
            key = hash((KEY_ROOT, tuple(token_ids[:size])))
            alive &= holders_of(key)
            if not alive:
                continue
            if ids is None:
                ids = token_ids if type(token_ids) is tuple else tuple(token_ids)
            depth = size
            for start in range(size, n - size + 1, size):
                key = hash((key, ids[start:start + size]))
                still = alive & holders_of(key)
                dropped = alive & ~still
                while dropped:
                    low = dropped & -dropped
                    out[by_bit[low]] = depth
                    dropped ^= low
                alive = still
                if not alive:
                    break
                depth += size
            while alive:
                low = alive & -alive
                out[by_bit[low]] = depth
                alive ^= low
        return out

    def blocks(self, endpoint_id: str) -> int:
        """Blocks held for `endpoint_id` (0 for an unknown endpoint)."""
        view = self._views.get(endpoint_id)
        return len(view.blocks) if view is not None else 0

    def block_tokens(self, endpoint_id: str) -> int | None:
        """The endpoint's block size in tokens, as its events said (None before any)."""
        view = self._views.get(endpoint_id)
        return view.block_tokens if view is not None else None

    def last_seq(self, endpoint_id: str) -> int | None:
        """Sequence number of the last batch applied for `endpoint_id` (None before any)."""
        view = self._views.get(endpoint_id)
        return view.last_seq if view is not None else None

    def skipped_blocks(self, endpoint_id: str) -> int:
        """Blocks of `BlockStored` events the index left out for `endpoint_id` (module docstring)."""
        view = self._views.get(endpoint_id)
        return view.skipped_blocks if view is not None else 0

    def store_counts(self, endpoint_id: str) -> tuple[int, int]:
        """(blocks of `BlockStored` events entered in the endpoint's view, blocks left out because
        their parent was not in it), both counted since the endpoint was first seen; (0, 0) for
        an unknown endpoint. After a resync the second grows while the engine keeps storing below
        prefixes it cached before: `router.signals.kv_subscriber` trusts the view again once it stops."""
        view = self._views.get(endpoint_id)
        return (view.stored_blocks, view.orphan_blocks) if view is not None else (0, 0)

    def placed_blocks(self, endpoint_id: str) -> int:
        """Blocks of new prompt content the endpoint has taken: the blocks its engine reported
        stored since the endpoint was first seen (`store_counts`, never decreasing: evictions do
        not take them back), plus the blocks claimed there and not stored yet (`expect`: the
        claims of this index's router, or of every router at the endpoint picker). `kv-aware` sends a new conversation to the endpoint
        with the fewest (`DEFAULT_NEW_PREFIX_SLACK` in `router.pools.policies`), as `cache_aware` sends
        it to its smallest tree; every router reads the same engines' events, so they agree.
        0 for an unknown endpoint."""
        view = self._views.get(endpoint_id)
        return view.stored_blocks + view.claims if view is not None else 0

    def __len__(self) -> int:
        """Entries held, summed over endpoints (the memory bound's unit)."""
        return sum(len(v.blocks) for v in self._views.values())

    def distinct_blocks(self) -> int:
        """Distinct router keys held by at least one endpoint."""
        return len(self._holders)

    def endpoints(self) -> list[str]:
        """Ids of the endpoints the index has a view for, sorted."""
        return sorted(self._views)

    # ----- membership -------------------------------------------------------------------------------

    def forget(self, endpoint_id: str) -> None:
        """Drop everything known about `endpoint_id` (it left the pool)."""
        view = self._views.pop(endpoint_id, None)
        if view is None:
            return
        self._clear(view)
        del self._by_bit[view.bit]
        self._free_slots.append(view.bit.bit_length() - 1)
        self._masks = None

    def retain(self, endpoint_ids: Collection[str]) -> None:
        """Forget every endpoint not in `endpoint_ids`."""
        for endpoint_id in [e for e in self._views if e not in endpoint_ids]:
            self.forget(endpoint_id)

    # ----- helpers ----------------------------------------------------------------------------------

    def _view(self, endpoint_id: str) -> _View:
        view = self._views.get(endpoint_id)
        if view is None:
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            view = self._views[endpoint_id] = _View(1 << slot)
            self._by_bit[view.bit] = endpoint_id
        return view

    def _clear(self, view: _View) -> None:
        """Empty the view, and drop what this router expected there (`expect`): the engine's cache
        was reset or the view is rebuilt, so a claim of prompts sent before is not to be trusted."""
        bit = view.bit
        for key in view.blocks.values():
            self._drop_holder(key, bit)
        view.blocks.clear()
        expected = self._expected
        if expected:
            for key in [k for k, waiting in expected.items() if bit in waiting]:
                waiting = expected[key]
                del waiting[bit]
                if not waiting:
                    del expected[key]
        view.claims = 0

    def _drop_holder(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    def _by_size(self, rebuilding: bool) -> dict[int, int]:
        """Block tokens -> mask of the LIVE endpoints (with `rebuilding`, also the REBUILDING ones)."""
        masks = self._masks
        if masks is None:
            live: dict[int, int] = {}
            usable: dict[int, int] = {}
            for view in self._views.values():
                size = view.block_tokens
                if view.connected and size is not None:
                    usable[size] = usable.get(size, 0) | view.bit
                    if view.complete:
                        live[size] = live.get(size, 0) | view.bit
            masks = self._masks = (live, usable)
        return masks[1] if rebuilding else masks[0]
