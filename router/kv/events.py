"""The wire format of vLLM's KV cache events: what an engine's `--kv-events-config` publisher sends.

Owns the event classes (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`: msgspec structs, as
vLLM's own; `EventBatch`), `decode_batch` / `encode_batch` (msgpack) and the framing constants
of the ZMQ streams. Called by the router's subscriber (`router.signals.kv_subscriber`, one per endpoint),
the exact block index (`router.kv.exact_index`) and the engine simulator's publisher, which encodes
with `encode_batch` so the router reads simulated and real engines alike. Pure: no I/O.

**Wire format** (vllm/distributed/kv_events.py, `ZmqEventPublisher`, `KVEventBatch`):

* the PUB socket sends 3-frame messages ``(topic, seq, payload)``: `topic` the configured topic
  (UTF-8, may be empty), `seq` the batch's sequence number as 8 bytes big-endian (0, 1, 2, ...
  from the publisher's start), `payload` one msgpack-encoded batch;
* a batch is msgspec's ``array_like`` struct ``[ts, events, data_parallel_rank]``: `ts` a float
  (seconds since the epoch), `events` a list, `data_parallel_rank` an int or nil (older
  publishers omit it);
* each event is a tagged msgspec struct, encoded as a map whose ``"type"`` key names it
  (``"BlockStored"``, ``"BlockRemoved"``, ``"AllBlocksCleared"``) and whose other keys are its
  fields; fields left at their default are omitted (``omit_defaults``). Older vLLM encoded events
  ``array_like`` as ``[tag, field, ...]`` in declaration order: `decode_batch` reads both;
* block hashes are ``bytes`` (vLLM's sha256 block hashes, the default) or ``int`` (with
  ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: the low 64 bits of the same hash, vllm/v1/core/
  kv_cache_utils.py `maybe_convert_block_hash`);
* the replay socket is a ROUTER: a DEALER sends ``(b"", start_seq)`` (8 bytes big-endian) and gets
  ``(b"", topic, seq, payload)`` for every buffered batch with seq >= start_seq, then
  ``(b"", b"", END_SEQ, b"")`` (`ZmqEventPublisher._service_replay`).

A payload that is not such a batch raises `KvEventDecodeError` naming what was wrong; the
subscriber counts it and resynchronizes, it never stops the router. An event of a type this
module does not know (a newer vLLM) is skipped and counted in `EventBatch.skipped`.

**Cost.** A router decodes every batch of every engine (hundreds of events per request on long
prompts: one `BlockRemoved` per evicted block), so the current form is decoded by msgspec
straight into the event structs, types checked in C (vLLM's own codec; ~0.2 us per one-block
`BlockRemoved` against ~1.1 us through msgpack and checks in Python). Anything that does not fit
that form exactly (an older vLLM's arrays, an unknown event type, a bad field) is decoded again
by the general path, which reads every form and names what is wrong, so both paths accept and
refuse the same payloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeAlias

import msgpack
import msgspec

BlockHash: TypeAlias = bytes | int
"""An engine block hash as it travels: sha256 bytes, or a 64-bit int (vLLM `ExternalBlockHash`)."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The seq frame that ends a replay answer (vLLM `ZmqEventPublisher.END_SEQ`)."""

SEQ_BYTES = 8
"""Length of a seq frame: an unsigned 64-bit big-endian integer."""

MEDIUM_GPU = "GPU"
"""`medium` of blocks in the engine's GPU KV cache (vLLM `MEDIUM_GPU`); offload tiers say "CPU"
or "STORAGE"."""


class KvEventDecodeError(ValueError):
    """A payload (or a frame) that is not a vLLM KV event batch; the message says what is wrong."""


class BlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True, gc=False):
    """Blocks newly cached by the engine (vLLM `BlockStored`).

    `block_hashes[i]` holds tokens ``token_ids[i * block_size:(i + 1) * block_size]``; the first
    block's parent is `parent_block_hash` (None: the prompt's first block), each later block's
    parent is the block before it. `extra_keys` (one entry per block, or None) carries what the
    engine hashed besides the tokens: LoRA name, multimodal ids, cache salt. `medium` is
    `MEDIUM_GPU` (or None: unspecified) for the GPU cache; `group_idx` the KV cache group
    (hybrid models have several).
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True, gc=False):
    """Blocks the engine evicted from its cache (vLLM `BlockRemoved`)."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag="AllBlocksCleared", gc=False):
    """The engine dropped its whole prefix cache (vLLM `AllBlocksCleared`: `reset_prefix_cache`)."""


KvCacheEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    """One published batch (vLLM `KVEventBatch`): `ts` epoch seconds, `events` in engine order,
    `data_parallel_rank` of the publishing rank (None: not said). `skipped`: events of unknown
    types left out when decoding (never encoded)."""

    ts: float
    events: list[KvCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None
    skipped: int = 0


class _WireBatch(msgspec.Struct, array_like=True, gc=False):
    """The current wire form of a batch, for msgspec's decoder (`decode_batch`'s fast path)."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_FAST = msgspec.msgpack.Decoder(_WireBatch)
_FIXARRAY_2_OR_3 = (0x92, 0x93)   # msgpack's header byte of an array of 2 or 3 items


# Field order of each event struct in vLLM (the array_like encoding of older releases).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx")  # fmt: skip
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def decode_batch(payload: bytes) -> EventBatch:
    """The `EventBatch` in one msgpack `payload` (the third frame of a PUB message).

    Raises:
        KvEventDecodeError: not msgpack, not ``[ts, events(, rank)]``, or an event with a
            missing or mistyped field (block hashes must be bytes or int, token ids a list of
            ints, block size a positive int), or one nested past the recursion limit.
    """
    if payload[:1] and payload[0] in _FIXARRAY_2_OR_3:
        try:
            wire = _FAST.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
            pass   # not the current form exactly (or nested too deep): the general path reads it or says why
        else:
            return EventBatch(wire.ts, wire.events, wire.data_parallel_rank)
    return _decode_any(payload)


def _decode_any(payload: bytes) -> EventBatch:
    """`decode_batch` for every form (older vLLM's arrays, unknown event types), checked in Python."""
    try:
        doc = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except RecursionError:
        raise KvEventDecodeError("payload nested deeper than the decoder's recursion limit") from None
    except Exception as exc:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise KvEventDecodeError(f"payload is not msgpack: {exc}") from None
    if not isinstance(doc, list) or len(doc) not in (2, 3):
        raise KvEventDecodeError(f"batch must be [ts, events, data_parallel_rank], got {_kind(doc)}")
    ts, events = doc[0], doc[1]
    if type(ts) not in (float, int):
        raise KvEventDecodeError(f"batch ts must be a number, got {_kind(ts)}")
    if not isinstance(events, list):
        raise KvEventDecodeError(f"batch events must be a list, got {_kind(events)}")
    rank = doc[2] if len(doc) == 3 else None
    if rank is not None and type(rank) is not int:
        raise KvEventDecodeError(f"batch data_parallel_rank must be an int or nil, got {_kind(rank)}")
    batch = EventBatch(float(ts), [], rank)
    out = batch.events
    for i, raw in enumerate(events):
        event = _event(raw, i)
        if event is None:
            batch.skipped += 1
        else:
            out.append(event)
    return batch


def encode_batch(batch: EventBatch) -> bytes:
    """`batch` as vLLM's publisher encodes a `KVEventBatch` (msgspec, ``omit_defaults``): what a
    vLLM subscriber (msgspec) and `decode_batch` both read."""
    events: list[dict[str, Any]] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            doc: dict[str, Any] = {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                                   "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                                   "block_size": event.block_size, "lora_id": event.lora_id, "medium": event.medium,
                                   "lora_name": event.lora_name}  # fmt: skip
            if event.extra_keys is not None:
                doc["extra_keys"] = event.extra_keys
            if event.group_idx is not None:
                doc["group_idx"] = event.group_idx
        elif isinstance(event, BlockRemoved):
            doc = {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
            if event.group_idx is not None:
                doc["group_idx"] = event.group_idx
        elif isinstance(event, AllBlocksCleared):
            doc = {"type": "AllBlocksCleared"}
        else:
            raise TypeError(f"not a KV cache event: {event!r}")
        events.append(doc)
    return msgpack.packb([float(batch.ts), events, batch.data_parallel_rank], use_bin_type=True)


def seq_frame(seq: int) -> bytes:
    """The 8-byte big-endian frame of sequence number `seq` (>= 0)."""
    return seq.to_bytes(SEQ_BYTES, "big")


def parse_seq(frame: bytes) -> int:
    """The sequence number in an 8-byte frame. Raises `KvEventDecodeError` on another length."""
    if len(frame) != SEQ_BYTES:
        raise KvEventDecodeError(f"seq frame must be {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


# ----- helpers ------------------------------------------------------------------------------------


def _kind(value: object) -> str:
    return type(value).__name__


def _event(raw: object, i: int) -> KvCacheEvent | None:
    """One event from its map (current vLLM) or array (older vLLM) form; None for an unknown tag."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        doc = raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        doc = dict(zip(names, raw[1:]))
    else:
        raise KvEventDecodeError(f"event {i} must be a tagged map, got {_kind(raw)}")
    if tag == "BlockStored":
        hashes = _hashes(doc.get("block_hashes"), i)
        parent = doc.get("parent_block_hash")
        if parent is not None and type(parent) not in (bytes, int):
            raise KvEventDecodeError(f"event {i}: parent_block_hash must be bytes, int or nil, got {_kind(parent)}")
        tokens = doc.get("token_ids")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise KvEventDecodeError(f"event {i}: token_ids must be a list of ints, got {_kind(tokens)}")
        size = doc.get("block_size")
        if type(size) is not int or size < 1:
            raise KvEventDecodeError(f"event {i}: block_size must be a positive int, got {size!r}")
        extra = doc.get("extra_keys")
        return BlockStored(hashes, parent, tokens, size, _opt_int(doc, "lora_id", i), _opt_str(doc, "medium", i),
                           _opt_str(doc, "lora_name", i), extra if isinstance(extra, list) else None,
                           _opt_int(doc, "group_idx", i))  # fmt: skip
    if tag == "BlockRemoved":
        return BlockRemoved(_hashes(doc.get("block_hashes"), i), _opt_str(doc, "medium", i),
                            _opt_int(doc, "group_idx", i))  # fmt: skip
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise KvEventDecodeError(f"event {i} has no type tag")
    return None


def _hashes(value: object, i: int) -> list[BlockHash]:
    if not isinstance(value, list):
        raise KvEventDecodeError(f"event {i}: block_hashes must be a list, got {_kind(value)}")
    for h in value:
        if type(h) not in (bytes, int):
            raise KvEventDecodeError(f"event {i}: a block hash must be bytes or int, got {_kind(h)}")
    return value


def _opt_int(doc: dict, key: str, i: int) -> int | None:
    value = doc.get(key)
    if value is not None and type(value) is not int:
        raise KvEventDecodeError(f"event {i}: {key} must be an int or nil, got {_kind(value)}")
    return value


def _opt_str(doc: dict, key: str, i: int) -> str | None:
    value = doc.get(key)
    if value is not None and not isinstance(value, str):
        raise KvEventDecodeError(f"event {i}: {key} must be a string or nil, got {_kind(value)}")
    return value


def batch_of(events: Sequence[KvCacheEvent], ts: float = 0.0) -> EventBatch:
    """An `EventBatch` of `events` (a convenience for publishers and tests)."""
    return EventBatch(ts, list(events))
