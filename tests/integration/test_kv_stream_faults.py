"""A KV event publisher in another process, stopped and resumed (SIGSTOP / SIGCONT): the router's
subscriber (router.signals.kv_subscriber) marks the stream down within the ZMTP heartbeat timeout, so
`kv-aware` falls back to its approximate index for that endpoint, and catches up by replay when it
resumes, with the batches published just before the stop and none lost."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import zmq.asyncio

from router.kv.exact_index import ExactIndex, StreamState
from router.signals.kv_subscriber import HEARTBEAT_TIMEOUT_MS, KvEventSubscriber
from router.pools.spec import KvEventsSource
from tests.support.waits import async_wait_until

PUBLISHER = r"""
import sys, time, zmq
from router.kv.events import BlockStored, EventBatch, END_SEQ, encode_batch, seq_frame
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB); pub.bind("tcp://127.0.0.1:0")
rep = ctx.socket(zmq.ROUTER); rep.bind("tcp://127.0.0.1:0")
port = lambda s: s.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
print(port(pub), port(rep), flush=True)
buffer, seq = [], 0
while True:
    while rep.poll(0):
        client, _, start = rep.recv_multipart()
        for s, data in buffer:
            if s >= int.from_bytes(start, "big"):
                rep.send_multipart([client, b"", b"", seq_frame(s), data])
        rep.send_multipart([client, b"", b"", END_SEQ, b""])
    ids = list(range(seq * 4, seq * 4 + 4))
    data = encode_batch(EventBatch(time.time(), [BlockStored([seq + 1], seq or None, ids, 4)]))
    buffer.append((seq, data))
    pub.send_multipart([b"", seq_frame(seq), data])
    seq += 1
    time.sleep(0.05)   # the publisher's pace: a batch every 50 ms
"""


async def test_a_stopped_publisher_is_down_within_the_heartbeat_timeout_and_caught_up_when_resumed() -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER], stdout=subprocess.PIPE, text=True, env=env)
    ctx = zmq.asyncio.Context()
    task = None
    try:
        pub_port, replay_port = proc.stdout.readline().split()  # type: ignore[union-attr]
        index = ExactIndex()
        source = KvEventsSource(publisher=f"tcp://127.0.0.1:{pub_port}", replay=f"tcp://127.0.0.1:{replay_port}")
        subscriber = KvEventSubscriber("m", "e", source, index, ctx)
        task = asyncio.create_task(subscriber.run())
        await async_wait_until(lambda: index.live("e") and index.blocks("e") > 5, 10, interval_s=0.05,
                               what="the stream live with more than 5 blocks")
        os.kill(proc.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        await async_wait_until(lambda: index.state("e") is StreamState.DOWN, 10, interval_s=0.05,
                               what="the stopped publisher's stream down")
        assert time.monotonic() - stopped_at < HEARTBEAT_TIMEOUT_MS / 1000 + 3
        held = index.blocks("e")
        os.kill(proc.pid, signal.SIGCONT)
        await async_wait_until(lambda: index.live("e") and index.blocks("e") > held + 5, 20, interval_s=0.05,
                               what="the resumed stream live and 5 more blocks applied")
        seq = index.last_seq("e")
        assert seq is not None and index.blocks("e") == seq + 1    # every batch applied, none lost
        assert subscriber.resyncs == 0
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()
        ctx.destroy(linger=0)
