"""The KV event subscriber (router.signals.kv_subscriber) against a real pyzmq publisher in this process,
speaking vLLM's protocol (PUB frames topic/seq/payload, a replay ROUTER answering from a buffer
and ending with END_SEQ, as vllm/distributed/kv_events.py `ZmqEventPublisher`): first contact,
a gap served by replay, a publisher restart forcing a resync, a stream cut and resumed, a replay
buffer that no longer covers the gap, a bad payload; and the subscribers following the pools
(router.pools.pool.PoolTable with router.signals.kv_streams.KvEventStreams), with their metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from router.kv.events import END_SEQ, BlockStored, EventBatch, encode_batch, seq_frame
from router.kv.exact_index import ExactIndex, StreamState
from router.signals.drain_ticks import DrainTicks
from router.signals.kv_streams import KvEventStreams
from router.signals.kv_subscriber import KvEventSubscriber
from router.stats.metrics import RouterMetrics
from router.pools.pool import PoolTable
from router.pools.spec import KvEventsSource, PoolSpec
from tests.support.waits import async_wait_until

BS = 4


class Publisher:
    """vLLM's ZmqEventPublisher in miniature: PUB + replay ROUTER with a buffer of `buffer_steps`.

    The PUB side is an XPUB socket (a PUB that also receives its subscribers' subscriptions), so
    a test can wait until a subscription has reached it (`subscribed`) before it publishes a batch
    the subscriber must get live: a PUB drops what it sends before then (ZMQ's slow joiner)."""

    def __init__(self, ctx: zmq.asyncio.Context, pub_port: int = 0, replay_port: int = 0, buffer_steps: int = 100,
                 topic: str = "kv") -> None:  # fmt: skip
        self.ctx = ctx
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)   # every subscription, not only a topic's first
        self.pub.bind(f"tcp://127.0.0.1:{pub_port}")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(f"tcp://127.0.0.1:{replay_port}")
        self.pub_port = int(self.pub.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.replay_port = int(self.replay.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.replays = 0
        self.gate: asyncio.Event | None = None   # set: replay answers wait for it
        self.subscriptions = 0                   # subscription messages the XPUB socket received
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())
        self._watch = asyncio.get_running_loop().create_task(self._count_subscriptions())

    @property
    def source(self) -> KvEventsSource:
        return KvEventsSource(publisher=f"tcp://127.0.0.1:{self.pub_port}",
                              replay=f"tcp://127.0.0.1:{self.replay_port}", topic="kv")  # fmt: skip

    async def publish(self, payload: bytes | EventBatch, *, drop: bool = False) -> int:
        """Publish the next batch (buffered for replay; `drop`: not sent live, a lost message)."""
        data = payload if isinstance(payload, bytes) else encode_batch(payload)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, data))
        if not drop:
            await self.pub.send_multipart([self.topic, seq_frame(seq), data])
        return seq

    async def subscribed(self, n: int = 1) -> None:
        """Wait until ``n`` subscriptions have reached this publisher: a batch published after
        that reaches the subscriber live."""
        await async_wait_until(lambda: self.subscriptions >= n, 10,
                               what=f"{n} subscription(s) to reach the publisher on port {self.pub_port}")

    async def _count_subscriptions(self) -> None:
        while True:
            message = await self.pub.recv()
            if message[:1] == b"\x01":              # b"\x01" + topic: subscribe; b"\x00": unsubscribe
                self.subscriptions += 1

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.replay.recv_multipart()
            self.replays += 1
            if self.gate is not None:
                await self.gate.wait()
            first = int.from_bytes(start, "big")
            for seq, data in list(self.buffer):
                if seq >= first:
                    await self.replay.send_multipart([client, b"", self.topic, seq_frame(seq), data])
            await self.replay.send_multipart([client, b"", b"", END_SEQ, b""])

    async def close(self) -> None:
        for task in (self._task, self._watch):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pub.close(linger=0)
        self.replay.close(linger=0)


def stored(base: int, n_blocks: int, parent: int | None = None, first_hash: int = 0) -> EventBatch:
    """A batch storing `n_blocks` blocks of token ids base..; engine hashes first_hash+1... (ints)."""
    hashes = [base + first_hash + i + 1 for i in range(n_blocks)]
    ids = [base + i for i in range(first_hash * BS, (first_hash + n_blocks) * BS)]
    return EventBatch(time.time(), [BlockStored(hashes, parent, ids, BS, medium="GPU")])


def ids(base: int, n_blocks: int) -> list[int]:
    return [base + i for i in range(n_blocks * BS)]


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@contextlib.asynccontextmanager
async def following(sub: KvEventSubscriber) -> AsyncIterator[KvEventSubscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_first_contact_replays_history_from_seq_0_and_is_live(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    await pub.publish(stored(100, 2))                      # before anyone listens
    index = ExactIndex()
    async with following(KvEventSubscriber("m", "e", pub.source, index, ctx)):
        await async_wait_until(lambda: index.live("e") and index.blocks("e") == 2,
                               what='index.live("e") and index.blocks("e") == 2')
        assert index.last_seq("e") == 0
        # the live stream continues it (subscription may need a moment: a miss is a gap, replayed)
        await pub.publish(stored(100, 2, parent=102, first_hash=2))
        await async_wait_until(lambda: index.blocks("e") == 4, what='index.blocks("e") == 4')
        assert index.match(ids(100, 4) + [7]) == {"e": 4 * BS}
    await pub.close()


async def test_a_gap_is_served_by_replay_and_the_view_stays_exact(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    metrics = RouterMetrics()
    bound = metrics.bind_kv("m", "e")
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx, bound)
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        await pub.publish(stored(100, 1))
        await async_wait_until(lambda: index.blocks("e") == 1, what='index.blocks("e") == 1')
        await pub.publish(stored(100, 1, parent=101, first_hash=1), drop=True)   # lost on the way
        await pub.publish(stored(100, 1, parent=102, first_hash=2))
        await async_wait_until(lambda: index.blocks("e") == 3, what='index.blocks("e") == 3')
        assert index.match(ids(100, 3)) == {"e": 3 * BS} and index.live("e")
        assert sub.resyncs == 0 and index.last_seq("e") == 2
    assert metrics.registry.get_sample_value("fleet_router_kv_event_gaps_total", {"model": "m", "endpoint": "e"}) == 1
    assert metrics.registry.get_sample_value("fleet_router_kv_events_total", {"model": "m", "endpoint": "e"}) == 3
    await pub.close()


async def test_a_publisher_restart_forces_a_resync_to_its_new_history(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx)
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        for n in range(3):
            await pub.publish(stored(1000 * n, 2))
        await async_wait_until(lambda: index.blocks("e") == 6, what='index.blocks("e") == 6')
        ports = pub.pub_port, pub.replay_port
        await pub.close()
        await async_wait_until(lambda: index.state("e") is StreamState.DOWN,
                               what='index.state("e") is StreamState.DOWN')
        pub = Publisher(ctx, *ports)                       # a new engine: seq from 0, an empty cache
        await pub.publish(stored(5000, 1))
        await async_wait_until(lambda: sub.resyncs == 1 and index.live("e") and index.blocks("e") == 1, 15.0,
                               what='sub.resyncs == 1 and index.live("e") and index.blocks("e") == 1')
        assert index.match(ids(0, 2)) == {} and index.match(ids(5000, 1)) == {"e": BS}
    await pub.close()


async def test_a_cut_stream_resumes_from_the_replay_buffer(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx)
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        await pub.publish(stored(100, 1))
        await async_wait_until(lambda: index.blocks("e") == 1, what='index.blocks("e") == 1')
        # The network is cut: the publisher goes on (its buffer too) but nothing reaches the router.
        ports, buffer, seq = (pub.pub_port, pub.replay_port), pub.buffer, pub.seq
        await pub.close()
        await async_wait_until(lambda: index.state("e") is StreamState.DOWN,
                               what='index.state("e") is StreamState.DOWN')
        assert index.match(ids(100, 1)) == {}              # down: not trusted, the approximate index routes
        pub = Publisher(ctx, *ports)
        pub.buffer, pub.seq = buffer, seq
        pub.gate = asyncio.Event()                         # the replay answer is slow to come
        await pub.publish(stored(100, 1, parent=101, first_hash=1), drop=True)
        await pub.publish(stored(100, 1, parent=102, first_hash=2), drop=True)
        # On reconnection the subscriber replays from its last batch: nothing lost, no resync;
        # and until the replay has caught it up the view is not trusted (it lacks what was missed).
        await async_wait_until(lambda: pub.replays >= 1, 15.0, what='pub.replays >= 1')
        await asyncio.sleep(0.1)           # time for a wrong turn to LIVE: the case under test is that none comes
        assert index.state("e") is StreamState.DOWN
        pub.gate.set()
        await async_wait_until(lambda: index.live("e") and index.blocks("e") == 3, 15.0,
                               what='index.live("e") and index.blocks("e") == 3')
        assert sub.resyncs == 0 and index.match(ids(100, 3)) == {"e": 3 * BS}
    await pub.close()


async def outrun_the_replay_buffer(pub: Publisher, sub: KvEventSubscriber, index: ExactIndex,
                                   after: EventBatch) -> None:
    """One block applied, then a gap longer than a 2-batch replay buffer, then `after`: the
    subscriber resyncs (``replay_gone``) and its view is REBUILDING."""
    await pub.publish(stored(100, 1))
    await async_wait_until(lambda: index.blocks("e") == 1, what='index.blocks("e") == 1')
    for n in range(4):
        await pub.publish(stored(200 + 10 * n, 1), drop=True)
    await pub.publish(after)
    await async_wait_until(lambda: sub.resyncs == 1, what='sub.resyncs == 1')


async def test_a_gap_the_buffer_no_longer_holds_rebuilds_the_view(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx, buffer_steps=2)
    index = ExactIndex()
    now = [0.0]
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx, clock=lambda: now[0], rebuild_s=30.0)
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        await outrun_the_replay_buffer(pub, sub, index, stored(900, 1))
        assert index.state("e") is StreamState.REBUILDING and index.match(ids(900, 1)) == {}
        assert index.blocks("e") == 2                      # what the buffer still had, then the live batch
        now[0] = 31.0
        await pub.publish(stored(950, 1))                  # wakes the subscriber; the rebuild time is over
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        assert index.match(ids(900, 1)) == {"e": BS} and index.match(ids(100, 1)) == {}
    await pub.close()


async def test_a_rebuilding_view_is_not_trusted_while_the_engine_stores_below_prefixes_it_lacks(
        ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture) -> None:
    """After a resync, blocks stored below a prefix cached before it (orphans) keep the view partial
    past the rebuild time; once the blocks stored between two checks are not orphans it is LIVE."""
    pub = Publisher(ctx, buffer_steps=2)
    index = ExactIndex()
    now = [0.0]
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx, clock=lambda: now[0], rebuild_s=30.0)
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        caplog.set_level(logging.INFO, logger="router.signals.kv_subscriber")
        await outrun_the_replay_buffer(pub, sub, index, stored(900, 1, parent=77))   # below a prefix never seen
        assert index.state("e") is StreamState.REBUILDING
        now[0] = 31.0
        await pub.publish(stored(950, 1, parent=78))       # the rebuild time is over; still orphans
        await async_wait_until(lambda: "view still partial (2 of " in caplog.text,
                               what='"view still partial (2 of " in caplog.text')
        assert index.state("e") is StreamState.REBUILDING and index.store_counts("e")[1] == 2
        assert index.match(ids(950, 1), rebuilding=True) == {}
        await pub.publish(stored(600, 2))                  # a prefix stored whole: not an orphan
        await async_wait_until(lambda: index.blocks("e") >= 2, what='index.blocks("e") >= 2')
        now[0] = 62.0                                       # the next check (REBUILD_RECHECK_S later)
        await pub.publish(stored(700, 1))
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        assert index.match(ids(600, 2)) == {"e": 2 * BS}
    await pub.close()


async def test_a_bad_payload_is_counted_and_never_stops_the_subscriber(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    metrics = RouterMetrics()
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx, metrics.bind_kv("m", "e"))
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        await pub.publish(b"\xc1 not msgpack")
        await pub.pub.send_multipart([b"kv", b"short"])    # a bad seq frame
        await pub.publish(stored(100, 1))
        await async_wait_until(lambda: index.blocks("e") == 1, what='index.blocks("e") == 1')
        assert index.state("e") is StreamState.REBUILDING
    labels = {"model": "m", "endpoint": "e"}
    get = metrics.registry.get_sample_value
    assert get("fleet_router_kv_event_errors_total", {**labels, "reason": "decode"}) == 1
    assert get("fleet_router_kv_event_errors_total", {**labels, "reason": "frames"}) == 1
    assert get("fleet_router_kv_event_resyncs_total", {**labels, "reason": "bad_payload"}) == 1
    await pub.close()


async def test_a_batch_nested_too_deep_or_with_bad_token_ids_is_counted_and_the_stream_goes_on(
        ctx: zmq.asyncio.Context) -> None:
    """Two batches the decoder alone would let through (nested past the recursion limit; token ids
    that are lists, which the index's apply cannot take): each is counted and skipped and the next
    batch is applied; the subscriber does not restart (a restart would replay the same batch)."""
    pub = Publisher(ctx)
    metrics = RouterMetrics()
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx, metrics.bind_kv("m", "e"))
    event = {"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None, "token_ids": [1, 2, 3, 4],
             "block_size": BS, "extra_keys": 0}  # fmt: skip
    plain = msgpack.packb([1.0, [event], None])
    marker = msgpack.packb("extra_keys") + b"\x00"
    deep = plain.replace(marker, msgpack.packb("extra_keys") + b"\x91" * 5000 + b"\x90")
    lists = msgpack.packb([1.0, [{**event, "token_ids": [[7]]}], None])
    async with following(sub):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        await pub.publish(deep)
        await pub.publish(lists)
        await pub.publish(stored(100, 1))
        await async_wait_until(lambda: index.blocks("e") == 1, what='index.blocks("e") == 1')
        assert sub.bad_payloads == 2 and index.last_seq("e") == 2
    labels = {"model": "m", "endpoint": "e"}
    assert metrics.registry.get_sample_value("fleet_router_kv_event_errors_total", {**labels, "reason": "decode"}) == 2
    await pub.close()


async def test_a_first_batch_lost_before_the_subscription_took_is_replayed(ctx: zmq.asyncio.Context) -> None:
    """The replay buffer was empty at first contact; seq 0 then went out before the subscription
    reached the publisher (ZMQ's slow joiner) and the stream's first batch is seq 1: the
    subscriber replays from 0 instead of starting an "exact" view without seq 0's blocks."""
    pub = Publisher(ctx)
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", pub.source, index, ctx)
    async with following(sub):
        await async_wait_until(lambda: index.live("e") and pub.replays >= 1,   # the empty buffer, answered
                               what='index.live("e") and pub.replays >= 1')
        await pub.subscribed()
        await pub.publish(stored(100, 1), drop=True)                       # seq 0, lost
        await pub.publish(stored(100, 1, parent=101, first_hash=1))        # seq 1, below it
        await async_wait_until(lambda: index.blocks("e") == 2, what='index.blocks("e") == 2')
        assert index.live("e") and index.match(ids(100, 2)) == {"e": 2 * BS} and sub.resyncs == 0
    await pub.close()


async def test_without_a_replay_address_only_seq_0_makes_the_view_exact(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    index = ExactIndex()
    source = KvEventsSource(publisher=pub.source.publisher, topic="kv")
    sub = KvEventSubscriber("m", "e", source, index, ctx)
    async with following(sub):
        await async_wait_until(lambda: index.state("e") is StreamState.REBUILDING,
                               what='index.state("e") is StreamState.REBUILDING')
        await pub.subscribed()
        await pub.publish(stored(100, 1))                  # seq 0: a fresh publisher
        await async_wait_until(lambda: index.live("e") and index.blocks("e") == 1,
                               what='index.live("e") and index.blocks("e") == 1')
        await pub.publish(stored(200, 1), drop=True)
        await pub.publish(stored(300, 1))
        await async_wait_until(lambda: sub.resyncs == 1 and index.blocks("e") == 1,
                               what='sub.resyncs == 1 and index.blocks("e") == 1')
        assert index.state("e") is StreamState.REBUILDING and pub.replays == 0
    await pub.close()


async def test_subscribers_follow_the_pools(ctx: zmq.asyncio.Context) -> None:
    pubs = [Publisher(ctx), Publisher(ctx)]
    metrics = RouterMetrics()
    streams = KvEventStreams(metrics)
    table = PoolTable(metrics, wall_clock=time.time, kv_streams=streams)

    def doc(*n: int, policy: str = "kv-aware") -> PoolSpec:
        return PoolSpec.model_validate({"policy": policy, "endpoints": [
            {"id": f"e{i}", "url": f"http://127.0.0.1:{9000 + i}", "kv_events": pubs[i].source.model_dump()}
            for i in n]})  # fmt: skip

    pool = table.put("m", doc(0, 1))                      # before start: only wished
    assert streams.subscriber("m", "e0") is None
    await streams.start()
    assert streams.subscriber("m", "e0") is not None and streams.subscriber("m", "e1") is not None
    index = streams.index("m")
    assert pool.kv_view is index
    await async_wait_until(lambda: index.live("e0") and index.live("e1"), what='index.live("e0") and index.live("e1")')
    body, _ = metrics.render()
    assert b'fleet_router_kv_stream_live{endpoint="e0",model="m"} 1.0' in body
    await pubs[1].subscribed()
    await pubs[1].publish(stored(100, 3))
    await async_wait_until(lambda: index.blocks("e1") == 3, what='index.blocks("e1") == 3')
    assert b'fleet_router_kv_index_blocks{endpoint="e1",model="m"} 3.0' in metrics.render()[0]

    table.put("m", doc(0))                                 # e1 left the pool: its subscriber stops
    assert streams.subscriber("m", "e1") is None and index.endpoints() == ["e0"]
    assert b'endpoint="e1"' not in metrics.render()[0]
    table.put("m", doc(0, policy="round-robin"))          # another policy: no exact index needed, still followed
    assert streams.subscriber("m", "e0") is not None
    table.delete("m")
    assert streams.subscriber("m", "e0") is None and b"fleet_router_kv_stream_live{" not in metrics.render()[0]
    await streams.close()
    for pub in pubs:
        await pub.close()


async def test_the_router_follows_a_published_pool_and_routes_on_the_engines_events(ctx: zmq.asyncio.Context) -> None:
    import aiohttp

    from router.http.app import create_app
    from tests.support.router import FakeEngine, running_app

    token = "t0ken"
    auth = {"Authorization": f"Bearer {token}"}
    pubs = [Publisher(ctx), Publisher(ctx)]
    app = create_app(token)
    async with FakeEngine("a") as a, FakeEngine("b") as b, running_app(app) as base, \
            aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=10)) as client:  # fmt: skip
        doc = {"policy": "kv-aware", "endpoints": [
            {"id": name, "url": engine.url, "kv_events": pub.source.model_dump()}
            for name, engine, pub in (("a", a, pubs[0]), ("b", b, pubs[1]))]}  # fmt: skip
        async with client.put("/admin/v1/pools/m", json=doc, headers=auth) as resp:
            assert resp.status == 200, await resp.text()
        assert app.kv_streams is not None
        index = app.kv_streams.index("m")
        await async_wait_until(lambda: index.live("a") and index.live("b"), what='index.live("a") and index.live("b")')
        await pubs[1].subscribed()
        prompt = ids(7000, 300)                            # 1,200 tokens, held by b's engine only
        await pubs[1].publish(stored(7000, 300))
        await async_wait_until(lambda: index.blocks("b") == 300, what='index.blocks("b") == 300')
        for _ in range(3):
            async with client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 2}) as resp:
                assert (await resp.json())["served_by"] == "b"
        bad = prompt[:4] + [[1]] + prompt[5:]              # not token ids: the engine's to refuse, not a router 500
        async with client.post("/v1/completions", json={"model": "m", "prompt": bad, "max_tokens": 2}) as resp:
            assert resp.status == 200, await resp.text()
        async with client.get("/metrics") as resp:
            text = await resp.text()
        assert 'fleet_router_kv_stream_live{endpoint="b",model="m"} 1.0' in text
        assert 'fleet_router_kv_events_total{endpoint="b",model="m"} 1.0' in text
    assert app.kv_streams.subscriber("m", "a") is None      # stopped with the app's lifespan
    for pub in pubs:
        await pub.close()


async def test_a_replay_socket_that_does_not_answer_rebuilds_the_view(ctx: zmq.asyncio.Context) -> None:
    pub = Publisher(ctx)
    dead = ctx.socket(zmq.ROUTER)                          # bound, never answers
    dead.bind("tcp://127.0.0.1:0")
    source = KvEventsSource(publisher=pub.source.publisher, replay=dead.getsockopt_string(zmq.LAST_ENDPOINT),
                            topic="kv")  # fmt: skip
    index = ExactIndex()
    sub = KvEventSubscriber("m", "e", source, index, ctx, replay_timeout_s=0.2)
    async with following(sub):
        await async_wait_until(lambda: index.state("e") is StreamState.REBUILDING,   # first contact: history unknown
                               what='index.state("e") is StreamState.REBUILDING')
        await pub.subscribed()
        await pub.publish(stored(100, 1))                  # seq 0: a fresh publisher, exact after all
        await async_wait_until(lambda: index.live("e") and index.blocks("e") == 1,
                               what='index.live("e") and index.blocks("e") == 1')
        await pub.publish(stored(200, 1), drop=True)
        await pub.publish(stored(300, 1))
        await async_wait_until(lambda: sub.resyncs == 1, what='sub.resyncs == 1')
        assert index.state("e") is StreamState.REBUILDING and index.match(ids(300, 1)) == {}
    dead.close(linger=0)
    await pub.close()


async def test_a_moved_publisher_gets_a_new_subscriber_and_an_empty_view(ctx: zmq.asyncio.Context) -> None:
    old, new = Publisher(ctx), Publisher(ctx)
    streams = KvEventStreams()
    await streams.start()
    streams.put("m", {"e": old.source})
    index = streams.index("m")
    await async_wait_until(lambda: index.live("e"), what='index.live("e")')
    await old.subscribed()
    await old.publish(stored(100, 2))
    await async_wait_until(lambda: index.blocks("e") == 2, what='index.blocks("e") == 2')
    first = streams.subscriber("m", "e")
    streams.put("m", {"e": new.source})
    assert streams.subscriber("m", "e") is not first and index.blocks("e") == 0
    await async_wait_until(lambda: index.live("e"), what='index.live("e")')
    await streams.close()
    await old.close()
    await new.close()


async def test_the_drain_tick_wakes_every_waiter_at_once_and_a_cancelled_wait_alone() -> None:
    ticks = DrainTicks(0.01)
    first, second, third = ticks.wait(), ticks.wait(), ticks.wait()
    second.cancel()
    await asyncio.wait_for(asyncio.gather(first, third), 1.0)
    assert ticks.ticks == 1 and second.cancelled()
    with pytest.raises(ValueError):
        DrainTicks(-1.0)


async def test_a_waiter_that_polls_is_woken_only_when_its_poll_says_so_and_its_error_reaches_it_alone() -> None:
    ticks = DrainTicks(0.01)
    answers = iter([True, True, False])
    calls: list[int] = []

    def poll() -> bool:
        calls.append(ticks.ticks)
        return next(answers)

    def broken() -> bool:
        raise RuntimeError("socket gone")

    polled, failed, plain = ticks.wait(poll), ticks.wait(broken), ticks.wait()
    await asyncio.wait_for(plain, 1.0)
    with pytest.raises(RuntimeError, match="socket gone"):
        await asyncio.wait_for(failed, 1.0)
    await asyncio.wait_for(polled, 1.0)
    assert calls == [1, 2, 3]          # polled at three ticks in a row, woken by the third's False
    assert ticks.ticks == 3


async def test_a_burst_of_batches_is_drained_in_a_few_wakes_and_a_quiet_stream_stops_ticking(
        ctx: zmq.asyncio.Context) -> None:  # fmt: skip
    pub = Publisher(ctx)
    index = ExactIndex()
    ticks = DrainTicks(0.05)
    async with following(KvEventSubscriber("m", "e", pub.source, index, ctx, ticks=ticks)):
        await async_wait_until(lambda: index.live("e"), what='index.live("e")')
        await pub.subscribed()
        before = ticks.ticks
        parent = None
        for n in range(300):   # 300 batches sent back to back, each continuing the last
            await pub.publish(stored(0, 1, parent=parent, first_hash=n))
            parent = n + 1
        await async_wait_until(lambda: index.blocks("e") == 300, what='index.blocks("e") == 300')
        assert index.match(ids(0, 300)) == {"e": 300 * BS}
        assert ticks.ticks - before < 30          # ~20 ms of sending: a few ticks, not one wake per batch
        # Nothing arrives: after QUIET_TICKS (router.signals.kv_subscriber) empty ticks the subscriber
        # waits on its socket and the ticks stop (no tick in 0.3 s, six tick intervals).
        seen: list[int] = []

        def stopped_ticking() -> bool:      # the same count at two polls 0.3 s apart
            seen.append(ticks.ticks)
            return len(seen) >= 2 and seen[-1] == seen[-2]

        await async_wait_until(stopped_ticking, 10, interval_s=0.3, what="the drain ticks to stop on a quiet stream",
                               explain=lambda: f"ticks seen: {seen[-5:]}")
        await pub.publish(stored(0, 1, parent=parent, first_hash=300))
        await async_wait_until(lambda: index.blocks("e") == 301, what='index.blocks("e") == 301')
    await pub.close()
