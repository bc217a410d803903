"""vLLM's KV cache events on the wire (PLACEHOLDER: helper A's codec in branch `kvevents` replaces
this file at merge; only the names the engine simulator uses are here).

vllm/distributed/kv_events.py: a ZMQ PUB multipart (topic, seq as 8 bytes big-endian, payload);
the payload is msgpack of `KVEventBatch` as an array ``[ts, [events], data_parallel_rank]`` and
each event a map tagged ``"type"``: ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

END_SEQ = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KvCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class EventBatch:
    ts: float
    events: list[KvCacheEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


def _event_doc(e: KvCacheEvent) -> dict[str, Any]:
    if isinstance(e, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
                "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": e.lora_id,
                "medium": e.medium, "lora_name": None}  # fmt: skip
    if isinstance(e, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: EventBatch) -> bytes:
    """msgpack bytes of ``batch`` as vLLM's msgspec encoder writes a `KVEventBatch`."""
    return msgpack.packb([batch.ts, [_event_doc(e) for e in batch.events], batch.data_parallel_rank])


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in a payload. Raises ValueError on anything else."""
    try:
        doc = msgpack.unpackb(payload)
        ts, raw = doc[0], doc[1]
        events: list[KvCacheEvent] = []
        for d in raw:
            kind = d.get("type")
            if kind == "BlockStored":
                events.append(BlockStored(d["block_hashes"], d["parent_block_hash"], d["token_ids"], d["block_size"],
                                          d.get("lora_id"), d.get("medium")))  # fmt: skip
            elif kind == "BlockRemoved":
                events.append(BlockRemoved(d["block_hashes"], d.get("medium")))
            elif kind == "AllBlocksCleared":
                events.append(AllBlocksCleared())
        return EventBatch(float(ts), events, doc[2] if len(doc) > 2 else None)
    except (ValueError, TypeError, KeyError, IndexError, msgpack.ExtraData) as err:
        raise ValueError(f"not a KV event batch: {err}") from None
