"""vLLM's own KV event classes and publisher against the router's codec and subscriber: vLLM's msgspec
encoding decodes with router.kv.events and the other way round; vLLM's `ZmqEventPublisher` (PUB and
replay ROUTER, in this process) feeds a router subscriber, the batch published before it subscribed
served by the replay socket. Skipped without vLLM (importing it starts processes, so this is not a unit test)."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest
import zmq
import zmq.asyncio

from router.kv.events import (END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch,
                              encode_batch)
from router.kv.exact_index import ExactIndex, StreamState
from router.signals.kv_subscriber import KvEventSubscriber
from router.pools.spec import KvEventsSource
from tests.support.waits import async_wait_until

SHA = bytes(range(32))


def sample() -> EventBatch:
    return EventBatch(1795672534.25, [
        BlockStored([SHA, 7], None, list(range(32)), 16, medium="GPU"),
        BlockStored([9], 7, list(range(32, 48)), 16, lora_id=3, lora_name="ad", extra_keys=[["ad"]], group_idx=1),
        BlockRemoved([SHA, 9], medium="GPU"),
        AllBlocksCleared(),
    ], data_parallel_rank=0)  # fmt: skip


def test_vllm_decodes_ours_and_we_decode_vllms() -> None:
    msgspec = pytest.importorskip("msgspec")
    kv = pytest.importorskip("vllm.distributed.kv_events")
    theirs = msgspec.msgpack.Decoder(type=kv.KVEventBatch).decode(encode_batch(sample()))
    assert theirs.ts == 1795672534.25 and theirs.data_parallel_rank == 0
    stored, lora, removed, cleared = theirs.events
    assert isinstance(stored, kv.BlockStored) and stored.block_hashes == [SHA, 7] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(32)) and stored.block_size == 16 and stored.medium == "GPU"
    assert lora.lora_id == 3 and lora.lora_name == "ad" and lora.group_idx == 1 and lora.parent_block_hash == 7
    assert isinstance(removed, kv.BlockRemoved) and removed.block_hashes == [SHA, 9]
    assert isinstance(cleared, kv.AllBlocksCleared)

    batch = kv.KVEventBatch(ts=12.5, events=[
        kv.BlockStored(block_hashes=[SHA], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                       medium="GPU", lora_name=None, extra_keys=[None], group_idx=0),
        kv.BlockRemoved(block_hashes=[SHA], medium="GPU"),
        kv.AllBlocksCleared(),
    ], data_parallel_rank=None)  # fmt: skip
    ours = decode_batch(msgspec.msgpack.encode(batch))
    assert ours == EventBatch(12.5, [BlockStored([SHA], None, [1, 2], 2, medium="GPU", extra_keys=[None], group_idx=0),
                                     BlockRemoved([SHA], medium="GPU"), AllBlocksCleared()])  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def replayable(ctx: zmq.asyncio.Context, replay_port: int) -> int:
    """How many batches the publisher's replay socket serves from seq 0 (vLLM's replay protocol:
    a DEALER sends an empty frame and the start seq; batches come back, then END_SEQ)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        n = 0
        while (await asyncio.wait_for(dealer.recv_multipart(), 10))[2] != END_SEQ:
            n += 1
        return n
    finally:
        dealer.close(linger=0)


async def test_vllm_publisher_feeds_the_subscriber_and_replays_what_came_before() -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    pub_port, replay_port = free_port(), free_port()
    # vLLM binds wildcard endpoints (its default, tcp://*:5557) and connects to the rest.
    publisher = kv.ZmqEventPublisher(0, endpoint=f"tcp://*:{pub_port}",
                                     replay_endpoint=f"tcp://*:{replay_port}", topic="kv")
    ids = list(range(1000, 1064))

    def stored(first: int, n: int, parent):
        hashes = [first + i for i in range(n)]
        return kv.KVEventBatch(ts=time.time(), events=[kv.BlockStored(
            block_hashes=hashes, parent_block_hash=parent, token_ids=ids[(first - 1) * 16:(first - 1 + n) * 16],
            block_size=16, lora_id=None, medium="GPU", lora_name=None)])

    publisher.publish(stored(1, 1, None))       # before the router subscribes: reached by replay from 0
    ctx = zmq.asyncio.Context()
    # publish() only queues the batch: wait until the publisher's thread has sent and buffered it
    await async_wait_until(lambda: replayable(ctx, replay_port), 10, interval_s=0.05,
                           what="seq 0 in the publisher's replay buffer")
    index = ExactIndex()
    source = KvEventsSource(publisher=f"tcp://127.0.0.1:{pub_port}", replay=f"tcp://127.0.0.1:{replay_port}",
                            topic="kv")
    subscriber = KvEventSubscriber("m", "e0", source, index, ctx)
    task = asyncio.create_task(subscriber.run())
    try:
        await async_wait_until(lambda: index.live("e0") and index.blocks("e0") == 1, 10,
                               what="the replayed batch applied and the stream live")
        publisher.publish(stored(2, 2, 1))
        await async_wait_until(lambda: index.blocks("e0") == 3, 10, what="the live batch applied")
        assert index.match(ids) == {"e0": 48} and subscriber.resyncs == 0
        assert index.state("e0") is StreamState.LIVE
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        publisher.shutdown()
        ctx.destroy(linger=0)
