"""Real vLLM (CPU build) publishes KV cache events that `router.kv.events` decodes: one replica of
the generated tiny model started by `fleet up`'s local backend (so with the ``--kv-events-config``
Fleet gives it: ipc:// sockets in the state directory), two prompts sharing a prefix, a subscriber
that joins after the first one and fetches the batch it missed from the replay socket.

Prompts are sent as token ids, so the token ids the events carry are checked exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

import httpx
import pytest
import yaml

from fleet.controller.backend import ReplicaWant
from fleet.inventory import Inventory, NodeInventory
from fleet.local.backend import LocalBackend
from fleet.local.procs import start_ticks
from fleet.placement import get_strategy
from fleet.placement.shapes import PlacementRequest
from fleet.spec import load_deployments
from router.kv.events import END_SEQ, BlockStored, decode_batch
from tests.support.waits import async_wait_until, zmq_connected

NODE = NodeInventory(name="local", cpu_cores=(0, 1))
START_TIMEOUT_S = 420.0


def _vllm_want(tmp_path: Path, model: Path) -> ReplicaWant:
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "kv"},
           "spec": {"model": {"name": "tiny-llama", "source": str(model)},
                    "engine": {"kind": "vllm", "args": ["--enforce-eager", "--max-model-len", "1024"],
                               "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
                    "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 1}}}
    f = tmp_path / "kv.yaml"
    f.write_text(yaml.safe_dump(doc))
    (ld,) = load_deployments([f])
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(ld.deployment, 1), Inventory((NODE,)), {})
    return ReplicaWant("kv-0", ld.deployment, plan.placements[0], ld.serving_hash, ld.base_dir)


def _complete(url: str, prompt: list[int]) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": "tiny-llama", "prompt": prompt, "max_tokens": 1,
                                                   "ignore_eos": True}, timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text


async def test_vllm_publishes_block_stored_with_the_prompts_tokens_and_replays_a_missed_batch(tmp_path, tiny_model):
    import zmq
    import zmq.asyncio

    backend = LocalBackend(tmp_path / "state", "fleet-kv-e2e", NODE)
    await backend.ensure(_vllm_want(tmp_path, tiny_model))
    facts = (await backend.observe())["kv-0"]
    pid = int(facts.detail["pid"])
    ctx = zmq.asyncio.Context()
    try:
        kv = facts.kv_events
        assert kv and kv["publisher"].startswith("ipc://") and kv["replay"].startswith("ipc://")
        log_tail = [""]

        async def healthy() -> bool:
            f = (await backend.observe())["kv-0"]
            assert not f.exited, f"vLLM exited: {f.exit_reason}: {await backend.log_tail('kv-0', 30)}"
            log_tail[0] = await backend.log_tail("kv-0", 30)
            return httpx.get(f"{facts.endpoint}/health", timeout=5).status_code == 200

        await async_wait_until(healthy, START_TIMEOUT_S, interval_s=1.0, what="vLLM to answer /health",
                               explain=lambda: log_tail[0], ignoring=(httpx.HTTPError,))

        shared = [(7 * i) % 2000 + 10 for i in range(256)]
        first = shared + list(range(1000, 1050))            # 306 tokens
        second = shared + list(range(1500, 1650))           # 406 tokens: at least one new full block
        await asyncio.to_thread(_complete, facts.endpoint, first)   # published before anyone subscribed

        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await zmq_connected(sub, kv["publisher"])            # the SUB's connection is up
        await asyncio.to_thread(_complete, facts.endpoint, second)
        batches: dict[int, bytes] = {}
        while not any(isinstance(e, BlockStored) for p in batches.values() for e in decode_batch(p).events):
            topic, seq, payload = await asyncio.wait_for(sub.recv_multipart(), 30)
            assert topic == b""
            batches[int.from_bytes(seq, "big")] = payload
        assert min(batches) > 0, "the subscriber joined late: seq 0 (the first prompt) is missed"

        replay = ctx.socket(zmq.DEALER)
        replay.connect(kv["replay"])
        await replay.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed: dict[int, bytes] = {}
        while True:
            _, _, seq, payload = await asyncio.wait_for(replay.recv_multipart(), 30)
            if seq == END_SEQ:
                break
            replayed[int.from_bytes(seq, "big")] = payload
        assert 0 in replayed and all(replayed[s] == p for s, p in batches.items() if s in replayed)

        stored_first = [e for e in decode_batch(replayed[0]).events if isinstance(e, BlockStored)]
        assert stored_first, decode_batch(replayed[0])
        s0 = stored_first[0]
        n = len(s0.block_hashes) * s0.block_size
        assert s0.parent_block_hash is None and n <= len(first) and s0.token_ids == first[:n]
        assert s0.block_size in (16, 128) and s0.medium in ("GPU", None)
        later = [e for p in batches.values() for e in decode_batch(p).events if isinstance(e, BlockStored)]
        chained = [e for e in later if e.parent_block_hash is not None]
        assert chained, later     # the second prompt's new block hangs off the shared prefix
        assert chained[0].parent_block_hash in s0.block_hashes, (chained[0], s0.block_hashes)
        start = (s0.block_hashes.index(chained[0].parent_block_hash) + 1) * s0.block_size
        assert start <= len(shared) and chained[0].token_ids == second[start:start + len(chained[0].token_ids)]
        print(json.dumps({"block_size": s0.block_size, "first_blocks": len(s0.block_hashes),
                          "batches_seen": sorted(batches), "replayed": sorted(replayed)}))
    finally:
        ctx.destroy(linger=0)
        await backend.stop("kv-0")
        try:
            await async_wait_until(lambda: start_ticks(pid) is None, 10, interval_s=0.1, what=f"vLLM ({pid}) to exit")
        except pytest.fail.Exception:
            os.killpg(pid, signal.SIGKILL)         # still running after 10 s: killed, as cleanup, not a verdict
