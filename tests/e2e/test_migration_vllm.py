"""Request migration against real vLLM (CPU build, the generated tiny model): a stream whose first
engine dies after two events goes on from vLLM, which takes the router's continuation as it is
sent (router.request.migrate): for completions the prompt plus the text streamed so far, for chat
the messages plus the partial assistant message with `continue_final_message`. The client's stream
ends with `data: [DONE]`, no error, one `id`, and as many token events as it asked for.

Waits are on conditions with a deadline, never on sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
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
from router.http.app import create_app
from tests.support.router import running_app
from tests.support.waits import async_wait_until

NODE = NodeInventory(name="local", cpu_cores=(0, 1))
START_TIMEOUT_S = 420.0
TOKEN = "test-admin-token"
MODEL = "tiny-llama"
MAX_TOKENS = 12


def _vllm_want(tmp_path: Path, model: Path) -> ReplicaWant:
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "mig"},
           "spec": {"model": {"name": MODEL, "source": str(model)},
                    "engine": {"kind": "vllm", "args": ["--enforce-eager", "--max-model-len", "1024"],
                               "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
                    "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 1}}}
    f = tmp_path / "mig.yaml"
    f.write_text(yaml.safe_dump(doc))
    (ld,) = load_deployments([f])
    plan = get_strategy().place_replicas(PlacementRequest.for_deployment(ld.deployment, 1), Inventory((NODE,)), {})
    return ReplicaWant("mig-0", ld.deployment, plan.placements[0], ld.serving_hash, ld.base_dir)


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


@contextlib.asynccontextmanager
async def dying_engine(chat: bool) -> AsyncIterator[str]:
    """An engine that streams two token events (vLLM's shapes) and then drops the connection."""
    if chat:
        events = [_event({"id": "chatcmpl-first", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                          "choices": [{"index": 0, "delta": d, "finish_reason": None}]})
                  for d in ({"role": "assistant", "content": ""}, {"content": " once"}, {"content": " upon"})]
    else:
        events = [_event({"id": "cmpl-first", "object": "text_completion", "created": 1, "model": MODEL,
                          "choices": [{"index": 0, "text": t, "finish_reason": None}]}) for t in (" once", " upon")]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))  # fmt: skip
        await reader.readexactly(length)
        body = b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" + body)
        await writer.drain()
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()
        await server.wait_closed()


async def test_vllm_continues_a_migrated_completion_and_chat_stream(tmp_path, tiny_model):
    backend = LocalBackend(tmp_path / "state", "fleet-mig-e2e", NODE)
    await backend.ensure(_vllm_want(tmp_path, tiny_model))
    facts = (await backend.observe())["mig-0"]
    pid = int(facts.detail["pid"])
    try:
        log_tail = [""]

        async def healthy() -> bool:
            f = (await backend.observe())["mig-0"]
            assert not f.exited, f"vLLM exited: {f.exit_reason}: {await backend.log_tail('mig-0', 30)}"
            log_tail[0] = await backend.log_tail("mig-0", 30)
            return httpx.get(f"{facts.endpoint}/health", timeout=5).status_code == 200

        await async_wait_until(healthy, START_TIMEOUT_S, interval_s=1.0, what="vLLM to answer /health",
                               explain=lambda: log_tail[0], ignoring=(httpx.HTTPError,))
        found = {}
        for chat in (False, True):
            app = create_app(TOKEN)
            async with dying_engine(chat) as dying_url, running_app(app) as base, \
                    aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(total=120)) as client:  # fmt: skip
                pool = {"policy": "round-robin", "endpoints": [{"id": "dying", "url": dying_url},
                                                               {"id": "vllm", "url": facts.endpoint}]}  # fmt: skip
                async with client.put(f"/admin/v1/pools/{MODEL}", json=pool,
                                      headers={"Authorization": f"Bearer {TOKEN}"}) as r:  # fmt: skip
                    assert r.status == 200
                prompt = {"messages": [{"role": "user", "content": "tell a story"}]} if chat else {"prompt": "a story:"}
                body = {"model": MODEL, **prompt, "max_tokens": MAX_TOKENS, "stream": True, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}  # fmt: skip
                path = "/v1/chat/completions" if chat else "/v1/completions"
                served = []
                for _ in range(2):   # round-robin: one of the two starts on the dying engine
                    async with client.post(path, json=body) as resp:
                        assert resp.status == 200
                        served.append(await resp.read())
                raw = next(r for r in served if b" once" in r)
                docs = [json.loads(e[6:]) for e in raw.split(b"\n\n") if e.startswith(b"data: {")]
                assert raw.endswith(b"data: [DONE]\n\n") and not any("error" in d for d in docs), raw[-600:]
                assert len({d["id"] for d in docs}) == 1
                texts = [d["choices"][0]["delta"].get("content") if chat else d["choices"][0].get("text")
                         for d in docs if d["choices"]]  # fmt: skip
                tokens = [t for t in texts if t]
                assert tokens[:2] == [" once", " upon"]
                assert docs[-1]["usage"]["completion_tokens"] == MAX_TOKENS
                migrated = app.metrics.registry.get_sample_value("fleet_router_migrations_total",
                                                                 {"model": MODEL, "reason": "interrupted"})  # fmt: skip
                assert migrated == 1
                found[path] = {"events": len(tokens), "usage": docs[-1]["usage"]}
        print(json.dumps(found))
    finally:
        await backend.stop("mig-0")
        try:
            await async_wait_until(lambda: start_ticks(pid) is None, 10, interval_s=0.1, what=f"vLLM ({pid}) to exit")
        except pytest.fail.Exception:
            os.killpg(pid, signal.SIGKILL)         # still running after 10 s: killed, as cleanup, not a verdict
