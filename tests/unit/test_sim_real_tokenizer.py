"""The engine simulator with ``--tokenizer DIR``: prompts become the token ids vLLM computes (the
router's `router.kv.prompt_tokenizer`, checked against transformers in tests/unit/test_router_tokenize.py),
so a simulated engine and the router name the same blocks; replies are words that re-tokenize to
the ids generated; bad directories are option errors. In-process replicas on loopback sockets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fleet.enginesim.__main__ import options_from_args
from fleet.enginesim.realtokens import RealTokens
from fleet.enginesim.runner import OptionsError, SimEngineOptions
from router.kv.tokenizer_files import load_tokenizer
from tests.unit.test_router_tokenize import CONVERSATIONS, tokenizer_dir, vllm_chat_ids  # noqa: F401 - a fixture
from tests.unit.test_sim_server import replica


def _spy(r: Any) -> list[list[int]]:
    prompts: list[list[int]] = []
    add = r.model.add_request

    def recording(rid: str, prompt_ids: list[int], *args: Any, **kwargs: Any) -> Any:
        prompts.append(list(prompt_ids))
        return add(rid, prompt_ids, *args, **kwargs)

    r.model.add_request = recording
    return prompts


async def test_prompts_are_tokenized_with_the_real_tokenizer(tokenizer_dir: Path) -> None:  # noqa: F811
    real = RealTokens(load_tokenizer(str(tokenizer_dir)))
    text = "The scheduler inside each engine builds a batch at every step."
    async with replica(tokens=real) as (r, client):
        prompts = _spy(r)
        chat = {"model": "sim-model", "messages": CONVERSATIONS[1], "max_tokens": 8}
        async with client.post("/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200, await resp.text()
            doc = await resp.json()
        async with client.post("/v1/completions", json={"model": "sim-model", "prompt": text, "max_tokens": 4}) as resp:
            completion = await resp.json()
        async with client.post("/v1/completions", json={"model": "sim-model", "prompt": [9999], "max_tokens": 4}) as resp:
            assert resp.status == 400 and "out of range 0..2047" in (await resp.json())["error"]["message"]
        image = {"model": "sim-model", "max_tokens": 4,
                 "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}
        async with client.post("/v1/chat/completions", json=image) as resp:
            assert resp.status == 400
    expected = vllm_chat_ids(tokenizer_dir, CONVERSATIONS[1])
    assert prompts[0] == expected and doc["usage"]["prompt_tokens"] == len(expected)
    assert prompts[1] == load_tokenizer(str(tokenizer_dir)).encode(text, True)
    assert completion["usage"]["prompt_tokens"] == len(prompts[1])
    # The reply re-tokenizes to the ids the replica generated: a next turn hits the reply's blocks.
    reply = doc["choices"][0]["message"]["content"]
    generated = real.filler_token_ids(0, prompts[0], 8)
    assert load_tokenizer(str(tokenizer_dir)).encode(reply, False) == generated


def test_options_load_the_tokenizer_once_or_fail_clearly(tokenizer_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    opts, ignored = options_from_args(["--model", "/nowhere", "--tokenizer", str(tokenizer_dir), "--replicas", "2"])
    assert ignored == [] and opts.tokenizer == str(tokenizer_dir)
    a, b = opts.replica_settings()
    assert a.tokens is not None and a.tokens is b.tokens and a.tokens.vocab_size == 2048
    assert SimEngineOptions().replica_settings()[0].tokens is None     # the word tokenizer by default
    with pytest.raises(OptionsError, match=r"--tokenizer: tokenizer .*absent: no such directory"):
        SimEngineOptions(tokenizer=str(tmp_path / "absent")).replica_settings()
