"""The KV event wire codec (router.kv.events): round trip, vLLM's older array form, refusals of bad
payloads. Against vLLM's own msgspec classes: tests/integration/test_kv_events_vllm.py."""

from __future__ import annotations

import msgpack
import pytest

from router.kv.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEventDecodeError,
    _decode_any,
    decode_batch,
    encode_batch,
    parse_seq,
    seq_frame,
)

SHA = bytes(range(32))


def sample() -> EventBatch:
    return EventBatch(1795672534.25, [
        BlockStored([SHA, 7], None, list(range(32)), 16, medium="GPU"),
        BlockStored([9], 7, list(range(32, 48)), 16, lora_id=3, lora_name="ad", extra_keys=[["ad"]], group_idx=1),
        BlockRemoved([SHA, 9], medium="GPU"),
        AllBlocksCleared(),
    ], data_parallel_rank=0)  # fmt: skip


def test_round_trip() -> None:
    assert decode_batch(encode_batch(sample())) == sample()


def test_array_like_events_of_older_vllm_decode() -> None:
    payload = msgpack.packb([1.0, [["BlockStored", [5], None, [1, 2], 2, None, "GPU"], ["BlockRemoved", [5], "GPU"],
                                   ["AllBlocksCleared"]]])  # fmt: skip
    assert decode_batch(payload).events == [BlockStored([5], None, [1, 2], 2, medium="GPU"),
                                            BlockRemoved([5], medium="GPU"), AllBlocksCleared()]  # fmt: skip


def test_unknown_event_types_are_skipped_and_counted() -> None:
    batch = decode_batch(msgpack.packb([1.0, [{"type": "BlockMoved", "x": 1}, {"type": "AllBlocksCleared"}]]))
    assert batch.events == [AllBlocksCleared()] and batch.skipped == 1


@pytest.mark.parametrize(("payload", "words"), [
    (b"\xc1", "not msgpack"),
    (msgpack.packb({"ts": 1}), "must be [ts, events"),
    (msgpack.packb(["x", []]), "ts must be a number"),
    (msgpack.packb([1.0, {}]), "events must be a list"),
    (msgpack.packb([1.0, [], "r"]), "data_parallel_rank"),
    (msgpack.packb([1.0, [3]]), "tagged map"),
    (msgpack.packb([1.0, [{"x": 1}]]), "no type tag"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "token_ids": [], "block_size": 1}]]),
     "bytes or int"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [], "block_size": 0}]]),
     "block_size"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": "ab", "block_size": 2}]]),
     "token_ids"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": 4}]]), "block_hashes must be a list"),
])  # fmt: skip
def test_bad_payloads_raise_a_clear_error(payload: bytes, words: str) -> None:
    with pytest.raises(KvEventDecodeError, match=words.replace("[", r"\[")):
        decode_batch(payload)


def test_seq_frames() -> None:
    assert parse_seq(seq_frame(0)) == 0 and parse_seq(seq_frame(2**40)) == 2**40
    with pytest.raises(KvEventDecodeError):
        parse_seq(b"\x00")


@pytest.mark.parametrize("doc", [
    [1.0, []],
    [2, [{"type": "BlockRemoved", "block_hashes": [SHA]}], None],
    [1.5, [{"type": "BlockStored", "block_hashes": [1, SHA], "parent_block_hash": SHA, "token_ids": [1, 2, 3, 4],
            "block_size": 2, "medium": "GPU", "newer_field": 1}], 3],
    [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": ["x"], "block_size": 1}]],   # ids unchecked
    [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": 1, "extra_keys": 5}]],
    [1.0, [{"type": "BlockMoved"}, {"type": "AllBlocksCleared"}]],
    [1.0, [["BlockRemoved", [5], "GPU"]]],
    [1.0, [], 0, "extra"],
    [True, []],
    [1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1], "block_size": True}]],
    [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": False}]],
    [1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]],
])  # fmt: skip
def test_the_fast_decoder_reads_and_refuses_what_the_general_one_does(doc: list) -> None:
    payload = msgpack.packb(doc, use_bin_type=True)
    try:
        expected = _decode_any(payload)
    except KvEventDecodeError as err:
        with pytest.raises(KvEventDecodeError, match=str(err).replace("[", r"\[")):
            decode_batch(payload)
        return
    assert decode_batch(payload) == expected


def test_the_current_form_decodes_into_the_event_structs() -> None:
    batch = decode_batch(encode_batch(sample()))
    assert [type(e) for e in batch.events] == [BlockStored, BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0].block_hashes == [SHA, 7] and batch.events[1].extra_keys == [["ad"]]
