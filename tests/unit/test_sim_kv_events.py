"""The engine simulator's KV cache events: what the block pool reports (stored on prefill, removed
on eviction, cleared on reset), that an index built from the events is the cache itself, and the
replica's PUB and replay sockets on vLLM's wire (ipc:// sockets in the test's directory).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
import zmq
import zmq.asyncio

from fleet.enginesim import tokens
from fleet.enginesim.cost import StepCost
from fleet.enginesim.kvcache import BlockPool, block_hashes, wire_hash
from fleet.enginesim.kvpublish import KvEventPublisher, KvEventsConfig, KvEventsConfigError
from fleet.enginesim.model import Arrival, EngineConfig, EngineModel, run_virtual
from fleet.enginesim.profiles import Profile
from fleet.enginesim.runner import bind_socket
from fleet.enginesim.server import ReplicaSettings, SimReplica
from router.kv.events import END_SEQ, AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from tests.support.waits import async_wait_until

BS = 4


def _model(num_blocks: int = 64, **kw) -> EngineModel:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=BS, num_gpu_blocks=num_blocks,
                       max_model_len=min(128, num_blocks * BS), **kw)  # fmt: skip
    return EngineModel(cfg, StepCost(fixed_s=0.01, per_token_s=0.0), kv_events=True)


def _events(model: EngineModel, arrivals: list[Arrival]) -> list:
    out: list = []
    run_virtual(model, arrivals, on_step=lambda r: out.extend(r.kv_events))
    return out


# ----- the block pool and the model -------------------------------------------------------------

def test_prefill_stores_the_prompt_blocks_with_their_tokens_and_parent():
    model = _model()
    prompt = list(range(100, 110))      # 10 tokens: 2 full blocks + 2
    events = _events(model, [Arrival(0.0, "a", prompt, 1, output_token_ids=[7])])
    stored = [e for e in events if isinstance(e, BlockStored)]
    hashes = [wire_hash(h) for h in block_hashes(prompt, BS)]
    assert stored[0].block_hashes == hashes and stored[0].parent_block_hash is None
    assert stored[0].token_ids == prompt[:8] and stored[0].block_size == BS and stored[0].medium == "GPU"
    assert all(0 <= h < 2**64 for h in stored[0].block_hashes)


def test_a_shared_prefix_stores_only_the_new_blocks_chained_to_the_hit():
    model = _model()
    shared = list(range(200, 208))                   # 2 blocks
    first = _events(model, [Arrival(0.0, "a", shared + [1, 2, 3, 4, 5], 1, output_token_ids=[9])])
    second = _events(model, [Arrival(1.0, "b", shared + [6, 7, 8, 9, 10], 1, output_token_ids=[9])])
    assert len([e for e in first if isinstance(e, BlockStored)]) == 1
    (s,) = [e for e in second if isinstance(e, BlockStored)]
    full = block_hashes(shared + [6, 7, 8, 9], BS)
    assert s.block_hashes == [wire_hash(full[2])] and s.parent_block_hash == wire_hash(full[1])
    assert s.token_ids == [6, 7, 8, 9]


def test_output_blocks_are_stored_as_they_fill():
    model = _model()
    events = _events(model, [Arrival(0.0, "a", [1, 2, 3], 6, output_token_ids=[4, 5, 6, 7, 8, 9])])
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [t for e in stored for t in e.token_ids] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert stored[1].parent_block_hash == stored[0].block_hashes[-1]


def test_eviction_removes_and_an_index_of_the_events_is_the_cache():
    """A cache of 12 blocks under 40 prompts: blocks are evicted, and replaying every event into a
    set gives exactly the hashes the pool can hit (duplicates counted per block, as vLLM does)."""
    model = _model(num_blocks=12)
    arrivals = [Arrival(i * 0.05, f"r{i}", [i % 5] * 8 + list(range(i, i + 9)), 2, output_token_ids=[1, 2])
                for i in range(40)]  # fmt: skip
    events = _events(model, arrivals)
    assert any(isinstance(e, BlockRemoved) for e in events)
    held: dict[int, int] = {}
    for e in events:
        for h in getattr(e, "block_hashes", []):
            held[h] = held.get(h, 0) + (1 if isinstance(e, BlockStored) else -1)
            assert held[h] >= 0
    assert {h for h, n in held.items() if n > 0} == model.pool.cached_hashes()


def test_duplicate_blocks_of_one_hash_are_stored_and_removed_each():
    events: list = []
    pool = BlockPool(4, on_event=events.append)
    a, b = pool.allocate(2)
    pool.cache_blocks([a], [11], [1, 2], 2, None)
    pool.cache_blocks([b], [11], [1, 2], 2, None)     # two requests computed the same block in one step
    assert [type(e) for e in events] == [BlockStored, BlockStored] and pool.lookup([11], 1)
    pool.free([a, b])
    pool.allocate(3)      # two never-used blocks, then the LRU cached one
    assert isinstance(events[-1], BlockRemoved) and pool.lookup([11], 1), "the other block still holds it"
    pool.allocate(1)
    assert isinstance(events[-1], BlockRemoved) and not pool.lookup([11], 1)


def test_reset_clears_only_when_nothing_is_held():
    events: list = []
    pool = BlockPool(4, on_event=events.append)
    (a,) = pool.allocate(1)
    pool.cache_blocks([a], [5], [1, 2], 2, None)
    assert not pool.reset() and pool.lookup([5], 1)
    pool.free([a])
    assert pool.reset() and not pool.lookup([5], 1) and isinstance(events[-1], AllBlocksCleared)


def test_no_events_without_the_switch_and_the_same_schedule():
    arrivals = [Arrival(i * 0.01, f"r{i}", list(range(i, i + 20)), 3) for i in range(10)]
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, block_size=BS, num_gpu_blocks=20, max_model_len=64)
    off = EngineModel(cfg, StepCost(fixed_s=0.01, per_token_s=1e-4))
    on = EngineModel(cfg, StepCost(fixed_s=0.01, per_token_s=1e-4), kv_events=True)
    steps: list = []
    done_off = run_virtual(off, arrivals, on_step=steps.append)
    assert all(not s.kv_events and s.kv_event_batch() is None for s in steps)
    assert [f.finished_s for f in done_off] == [f.finished_s for f in run_virtual(on, arrivals)]


# ----- the config ---------------------------------------------------------------------------------

def test_config_has_vllms_keys_and_defaults():
    c = KvEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:6000", "topic": "kv"}')
    assert c.publisher == "zmq" and c.enabled and c.buffer_steps == 10_000 and c.replay_endpoint is None
    assert not KvEventsConfig.from_json("{}").enabled
    assert c.for_replica(2).endpoint == "tcp://*:6002"
    for bad, key in (('{"enable_kv_cache_events": true, "endpiont": "x"}', "endpiont"),
                     ('{"publisher": "kafka"}', "publisher"), ('{"buffer_steps": 0}', "buffer_steps"),
                     ('{"endpoint": "http://x:1"}', "endpoint"), ("[1]", "object")):  # fmt: skip
        with pytest.raises(KvEventsConfigError, match=key):
            KvEventsConfig.from_json(bad)


def test_replay_frames_follow_vllms_service_replay():
    pub = KvEventPublisher(KvEventsConfig(enable_kv_cache_events=True, publisher="null", buffer_steps=2, topic="t"))
    got: list = []
    pub.sinks.append(lambda seq, batch: got.append(seq))
    for i in range(3):
        pub.publish(EventBatch(ts=float(i), events=[AllBlocksCleared()]))
    assert got == [0, 1, 2]
    frames = pub.replay_frames(0)      # seq 0 fell out of the buffer of 2
    assert [int.from_bytes(f[1], "big") for f in frames[:-1]] == [1, 2] and frames[-1] == (b"", END_SEQ, b"")
    assert decode_batch(frames[0][2]).ts == 1.0 and frames[0][0] == b"t"


# ----- a replica on the wire ----------------------------------------------------------------------

FAST = Profile(
    name="test-fast", model="sim-model", hardware="nothing (unit test)",
    config=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256, block_size=16, num_gpu_blocks=256,
                        max_model_len=512),
    cost=StepCost(fixed_s=0.002, per_token_s=1e-6), typical_startup_s=0.0, notes="unit tests",
)  # fmt: skip


@contextlib.asynccontextmanager
async def _replica(tmp_path, sinks=()):
    import aiohttp

    kv = KvEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{tmp_path}/pub",
                        replay_endpoint=f"ipc://{tmp_path}/replay", topic="kv")  # fmt: skip
    r = SimReplica(ReplicaSettings(profile=FAST, served_model_name="sim-model", kv_events=kv), kv_sinks=sinks)
    await r.start(bind_socket("127.0.0.1", 0))
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(kv.endpoint)
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{r.port}") as client:
            yield r, client, sub, ctx, kv
    finally:
        ctx.destroy(linger=0)
        await r.close()


async def _complete(client, prompt: str) -> None:
    async with client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}) as resp:
        assert resp.status == 200, await resp.text()


async def _subscribed(r: SimReplica, client, sub) -> int:
    """Wait until the SUB's subscription has reached the replica's PUB (ZMQ's slow joiner: a SUB
    misses what is sent before then): complete new prompts until a batch reaches the SUB, then
    read every batch published so far. Returns the seq of the next batch the SUB will read."""
    probes = iter(range(1_000))

    async def a_batch_arrived() -> bool:
        await _complete(client, f"probe {next(probes)} " * 16)       # new blocks: a batch is published
        return bool(await sub.poll(100))

    await async_wait_until(a_batch_arrived, 30, what="the SUB's subscription to reach the replica's PUB")
    last = -1
    while last < r.kv_publisher.next_seq - 1:                         # in order, none lost once subscribed
        _, seq, _ = await asyncio.wait_for(sub.recv_multipart(), 5)
        last = int.from_bytes(seq, "big")
    return last + 1


@pytest.mark.asyncio
async def test_a_replica_publishes_each_steps_events_and_replays_them(tmp_path):
    seen: list = []
    async with _replica(tmp_path, sinks=(lambda seq, b: seen.append((seq, b)),)) as (r, client, sub, ctx, kv):
        first = await _subscribed(r, client, sub)
        prompt = "the same long system prompt " * 8
        await _complete(client, prompt)
        topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
        assert topic == b"kv" and int.from_bytes(seq, "big") == first
        batch = decode_batch(payload)
        stored = [e for e in batch.events if isinstance(e, BlockStored)]
        ids = tokens.encode_prompt(prompt)
        assert stored and stored[0].token_ids == ids[:len(stored[0].token_ids)] and stored[0].block_size == 16
        assert seen[first][0] == first and seen[first][1].events == batch.events   # the in-process sink: same batch

        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(kv.replay_endpoint)
        await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            _, t, s, p = await asyncio.wait_for(dealer.recv_multipart(), 5)
            if s == END_SEQ:
                break
            replayed.append((int.from_bytes(s, "big"), p))
        assert [s for s, _ in replayed] == list(range(r.kv_publisher.next_seq)) and replayed[first] == (first, payload)


@pytest.mark.asyncio
async def test_sleep_clears_the_cache_with_all_blocks_cleared(tmp_path):
    async with _replica(tmp_path) as (r, client, sub, ctx, kv):
        await _subscribed(r, client, sub)
        await _complete(client, "x " * 40)
        await r._sleep(type("Req", (), {"query": {"level": "1"}})())
        kinds = []
        while not kinds or not isinstance(kinds[-1], AllBlocksCleared):
            _, _, payload = await asyncio.wait_for(sub.recv_multipart(), 5)
            kinds += decode_batch(payload).events
        assert r.model.pool.cached_hashes() == set()


@pytest.mark.asyncio
async def test_a_sleep_during_a_step_voids_that_steps_events(tmp_path):
    """POST /sleep lands while a step runs (its events taken, its duration not yet over): the
    AllBlocksCleared it publishes must stay last, not be followed by the step's BlockStored for
    blocks the reset dropped (a subscriber's view would hold blocks the engine does not)."""
    seen: list = []
    async with _replica(tmp_path, sinks=(lambda seq, b: seen.append(b),)) as (r, client, sub, ctx, kv):
        stepped, delivered = asyncio.Event(), asyncio.Event()
        step, deliver = r.model.step, r._deliver

        def step_and_tell(start_s):
            result = step(start_s)
            if result.kv_events:
                stepped.set()
            return result

        def deliver_and_tell(result):
            deliver(result)
            if stepped.is_set():
                delivered.set()

        r.model.step, r._deliver = step_and_tell, deliver_and_tell
        pending = asyncio.create_task(client.post("/v1/completions", json={"prompt": "x " * 40, "max_tokens": 2}))
        await asyncio.wait_for(stepped.wait(), 5)          # the step ran; the driver waits out its duration
        await r._sleep(type("Req", (), {"query": {"level": "1"}})())
        await asyncio.wait_for(delivered.wait(), 5)        # the driver went on past that step
        (await pending).release()
        events = [e for batch in seen for e in batch.events]
        assert isinstance(events[-1], AllBlocksCleared)
        assert r.model.pool.cached_hashes() == set()


def test_the_command_line_takes_the_flag():
    from fleet.enginesim.__main__ import options_from_args

    opts, ignored = options_from_args(["--kv-events-config", json.dumps({"enable_kv_cache_events": True,
                                                                         "endpoint": "tcp://*:7000"})])
    assert not ignored and opts.kv_events.endpoint == "tcp://*:7000"
    assert opts.replica_settings()[0].kv_events is opts.kv_events


def test_fleet_up_puts_the_sockets_in_a_directory_of_this_user_alone(tmp_path, monkeypatch):
    """ipc:// addresses in a 0700 directory named after the state directory; a directory someone
    else could read (or none at all) means the engine starts without events, never a failure."""
    import os

    from fleet.inventory import NodeInventory
    from fleet.local.backend import LocalBackend

    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    monkeypatch.setattr("tempfile.gettempdir", lambda: str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    backend = LocalBackend(tmp_path / "state", "f", NodeInventory(name="n"))
    kv = backend._kv_events_addresses("chat-0")
    d = tmp_path / "tmp" / f"fleet-kv-{os.getuid()}-"
    assert kv["publisher"].startswith(f"ipc://{d}") and kv["publisher"].endswith("/chat-0.pub")
    assert kv["replay"].endswith("/chat-0.replay")
    kv_dir = os.path.dirname(kv["publisher"][len("ipc://"):])
    assert os.stat(kv_dir).st_mode & 0o777 == 0o700
    assert len(backend._kv_events_addresses("x" * 60)["publisher"]) < len(kv["publisher"]) + 20   # long ids hashed
    os.chmod(kv_dir, 0o755)
    assert backend._kv_events_addresses("chat-1") is None
