"""router.kv.tokenize against what vLLM computes, on the generated tiny model's tokenizer.

vLLM 0.32 tokenizes a completion's text with the model's Hugging Face tokenizer
(``add_special_tokens`` from the request, default true) and a chat with transformers'
``apply_chat_template(conversation, tokenize=True, add_generation_prompt=True, return_dict=False)``
(vllm/renderers/hf.py, `safe_apply_chat_template`), the conversation being the messages after
vLLM's parsing (text parts joined with a newline for a template that takes string content). The
expected ids below are made by exactly those transformers calls on the same directory, so the
router's reimplementation (tokenizers + jinja2, no transformers) is checked against the real thing.
Also: bad directories, the loader's metrics and retry, long prompts in a thread, the proxy filling
`RouteRequest.token_ids`, and the engine simulator with ``--tokenizer``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from router.kv.prompt_blocks import route_request
from router.kv.chat_template import ChatTemplateError, UnsupportedPrompt
from router.kv.tokenize import PoolTokenizers, prompt_chars
from router.kv.tokenizer_files import TokenizerError, load_tokenizer

transformers = pytest.importorskip("transformers", reason="the reference is transformers' own chat template code")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there, how are you?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Explain prefill."},
     {"role": "assistant", "content": "It computes the prompt's KV cache."}, {"role": "user", "content": "And decode?"}],
    [{"role": "user", "content": "Ünïcödé, emoji \U0001f680, CJK 推理, tabs\tand\nnewlines  and  spaces "}],
    [{"role": "user", "content": ""}],
]  # fmt: skip

# A template in vLLM's "openai" content format (it loops over the parts), with transformers'
# extensions and globals: loopcontrols, {% generation %}, tojson, raise_exception.
PARTS_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}{% if part['type'] != 'text' %}{% continue %}{% endif %}"
    "{{ part['text'] }}{% if not loop.last %} | {% endif %}{% endfor %}{% endif %}"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "{% generation %}<call>{{ call['function']['arguments'] | tojson }}</call>{% endgeneration %}{% endfor %}{% endif %}"
    "{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from fleet.engines.tinymodel import make_tiny_tokenizer

    return make_tiny_tokenizer(tmp_path_factory.mktemp("tiny") / "tok")


@pytest.fixture(scope="module")
def parts_dir(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parts") / "tok"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tokenizer_dir / name).read_bytes())
    (out / "chat_template.jinja").write_text(PARTS_TEMPLATE)
    return out


def hf(directory: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def vllm_chat_ids(directory: Path, conversation: list[dict[str, Any]], **kwargs: Any) -> list[int]:
    """What vLLM's `safe_apply_chat_template` returns for the parsed conversation."""
    kwargs.setdefault("add_generation_prompt", True)
    return hf(directory).apply_chat_template(conversation, tokenize=True, return_dict=False, **kwargs)


# ----- rendering and ids against transformers ------------------------------------------------------

@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_renders_and_tokenizes_as_transformers(tokenizer_dir: Path, messages: list[dict[str, Any]]) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    reference = hf(tokenizer_dir)
    assert tok.render_chat(messages) == reference.apply_chat_template(messages, tokenize=False,
                                                                      add_generation_prompt=True)  # fmt: skip
    assert tok.render_chat(messages, add_generation_prompt=False) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=False)
    ids = tok.prompt_token_ids({"model": "m", "messages": messages})
    assert ids == vllm_chat_ids(tokenizer_dir, messages)
    assert ids[0] == reference.bos_token_id and ids.count(reference.bos_token_id) == 1   # the template's BOS only


def test_chat_options_of_the_request(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    messages = CONVERSATIONS[1]
    no_prompt = tok.prompt_token_ids({"messages": messages, "add_generation_prompt": False})
    assert no_prompt == vllm_chat_ids(tokenizer_dir, messages, add_generation_prompt=False)
    # add_special_tokens true on a chat request: vLLM adds BOS again in front of the template's.
    doubled = tok.prompt_token_ids({"messages": messages, "add_special_tokens": True})
    assert doubled[:2] == [hf(tokenizer_dir).bos_token_id] * 2


def test_text_parts_are_joined_with_a_newline_as_vllm_does(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    messages = [{"role": "user", "content": [{"type": "text", "text": "part one"}, "part two",
                                             {"type": "input_text", "text": "three"}]}]  # fmt: skip
    parsed = [{"role": "user", "content": "part one\npart two\nthree"}]   # vLLM's parse_chat_messages
    assert tok.prompt_token_ids({"messages": messages}) == vllm_chat_ids(tokenizer_dir, parsed)


def test_empty_text_parts_are_left_out_as_vllm_does(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    messages = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "hi"}, ""]}]
    parsed = [{"role": "user", "content": "hi"}]   # vLLM keeps a parse result only if it is truthy
    assert tok.prompt_token_ids({"messages": messages}) == vllm_chat_ids(tokenizer_dir, parsed)


# A template that reads the reasoning variables vLLM passes (Qwen3 and Gemma read enable_thinking).
THINKING_TEMPLATE = (
    "{{ bos_token }}{% if enable_thinking is defined and not enable_thinking %}<|system|>\nno think\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if reasoning_effort is defined %}[effort {{ reasoning_effort }}]{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(tokenizer_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "thinking"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_bytes((tokenizer_dir / name).read_bytes())
    (directory / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    tok = load_tokenizer(str(directory))
    messages = [{"role": "user", "content": "x"}]
    # vLLM 0.32 (ChatCompletionRequest.build_chat_params): the request's kwargs, reasoning_effort,
    # and enable_thinking = effort != "none" unless the kwargs name it.
    cases = [({"reasoning_effort": "none"}, {"enable_thinking": False, "reasoning_effort": "none"}),
             ({"reasoning_effort": "high"}, {"enable_thinking": True, "reasoning_effort": "high"}),
             ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}},
              {"enable_thinking": True, "reasoning_effort": "none"}),
             ({}, {})]  # fmt: skip
    for request, template_kwargs in cases:
        assert tok.prompt_token_ids({"messages": messages, **request}) == vllm_chat_ids(directory, messages,
                                                                                       **template_kwargs)
    assert tok.prompt_token_ids({"messages": messages, "reasoning_effort": "none"}) != tok.prompt_token_ids(
        {"messages": messages})


def test_the_loop_or_thread_choice_counts_what_the_template_renders() -> None:
    long = "r" * 5000
    assert prompt_chars({"messages": [{"role": "assistant", "content": "ok", "reasoning": long}]}) >= 5000
    assert prompt_chars({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": long}}]}]}) >= 5000  # fmt: skip
    assert prompt_chars({"messages": [{"role": "user", "content": ["a" * 3000, {"type": "text", "text": 7}]}]}) == 3000


def test_completion_text_gets_the_special_tokens_vllm_adds(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    reference = hf(tokenizer_dir)
    text = "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 0x7fff <|user|> inline special"
    assert tok.prompt_token_ids({"prompt": text}) == reference(text, add_special_tokens=True)["input_ids"]
    assert tok.prompt_token_ids({"prompt": text})[0] == reference.bos_token_id
    assert tok.prompt_token_ids({"prompt": text, "add_special_tokens": False}) == reference(
        text, add_special_tokens=False)["input_ids"]
    assert tok.prompt_token_ids({"prompt": [text, "second"]}) == reference(text)["input_ids"]   # a batch: the first


def test_template_in_parts_format_with_transformers_extensions(parts_dir: Path) -> None:
    tok = load_tokenizer(str(parts_dir))
    assert tok.content_parts   # the template loops over message['content']: vLLM's "openai" format
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": "é<"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        {"role": "user", "content": "c"},
    ]  # fmt: skip
    parsed = [   # what vLLM hands the template: parts kept as dicts, tool arguments decoded, tool text joined
        {"role": "system", "content": [{"type": "text", "text": "sys"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": [], "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "é<"}}}]},
        {"role": "tool", "content": "r1\nr2", "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "c"}]},
    ]  # fmt: skip
    reference = hf(parts_dir)
    assert tok.render_chat(messages) == reference.apply_chat_template(parsed, tokenize=False, add_generation_prompt=True)
    assert '{"x": 1, "y": "é<"}' in tok.render_chat(messages)   # tojson keeps non-ASCII and "<" as they are
    assert tok.prompt_token_ids({"messages": messages}) == vllm_chat_ids(parts_dir, parsed)


def test_template_errors_and_unsupported_requests(parts_dir: Path, tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(parts_dir))
    with pytest.raises(ChatTemplateError, match="unknown role narrator"):
        tok.prompt_token_ids({"messages": [{"role": "narrator", "content": "x"}]})
    plain = load_tokenizer(str(tokenizer_dir))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for doc in ({"messages": [{"role": "user", "content": [image]}]},
                {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
                {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"},
                {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
                {"messages": [{"content": "no role"}]}, {"messages": []}, {"prompt": 42}):  # fmt: skip
        with pytest.raises(UnsupportedPrompt):
            plain.prompt_token_ids(doc)


def test_developer_becomes_system_when_the_template_never_names_it(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    messages = [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]
    parsed = [{"role": "system", "content": "d"}, {"role": "user", "content": "u"}]   # converted, moved first
    assert tok.prompt_token_ids({"messages": messages}) == vllm_chat_ids(tokenizer_dir, parsed)


def test_chat_template_from_tokenizer_config(tokenizer_dir: Path, tmp_path: Path) -> None:
    """Older model directories keep the template in tokenizer_config.json (possibly as named templates)."""
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": (tokenizer_dir / "chat_template.jinja").read_text()}]
    config["bos_token"] = {"content": "<s>", "lstrip": False, "__type": "AddedToken"}   # the older AddedToken form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(str(tmp_path))
    assert tok.render_chat(CONVERSATIONS[0]) == load_tokenizer(str(tokenizer_dir)).render_chat(CONVERSATIONS[0])


# ----- bad directories ---------------------------------------------------------------------------

def test_bad_directories_fail_with_their_reason(tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no such directory") as err:
        load_tokenizer(str(tmp_path / "absent"))
    assert err.value.reason == "missing"
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match="no tokenizer.json") as err:
        load_tokenizer(str(tmp_path / "empty"))
    assert err.value.reason == "missing"

    def copy(name: str) -> Path:
        d = tmp_path / name
        d.mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (d / f).write_bytes((tokenizer_dir / f).read_bytes())
        return d

    bad = copy("bad-json")
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(TokenizerError, match="tokenizer.json is not valid JSON") as err:
        load_tokenizer(str(bad))
    assert err.value.reason == "invalid" and str(bad) in str(err.value)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "NoSuchModel"}}')
    with pytest.raises(TokenizerError, match="tokenizer.json does not load") as err:
        load_tokenizer(str(bad))
    assert err.value.reason == "invalid"
    bad = copy("bad-config")
    (bad / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json is not valid JSON") as err:
        load_tokenizer(str(bad))
    assert err.value.reason == "invalid"
    bad = copy("bad-template")
    (bad / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(TokenizerError, match="chat template does not compile") as err:
        load_tokenizer(str(bad))
    assert err.value.reason == "chat_template"
    no_template = copy("no-template")
    (no_template / "chat_template.jinja").unlink()
    tok = load_tokenizer(str(no_template))      # completions still tokenize; chats cannot
    assert tok.prompt_token_ids({"prompt": "hi"})
    with pytest.raises(UnsupportedPrompt, match="no chat template"):
        tok.prompt_token_ids({"messages": [{"role": "user", "content": "hi"}]})


# ----- the router's set of tokenizers ------------------------------------------------------------

def _sample(tokenizers: PoolTokenizers, registry: Any, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def test_pool_tokenizers_load_off_the_loop_and_count(tokenizer_dir: Path, tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    now = [0.0]
    tokenizers = PoolTokenizers(registry, clock=lambda: now[0])
    doc = {"messages": CONVERSATIONS[1]}
    try:
        assert await tokenizers.token_ids(str(tokenizer_dir), doc) is None      # not loaded: a load starts
        assert _sample(tokenizers, registry, "fleet_router_prompt_tokenizations_total", outcome="not_loaded") == 1
        assert await tokenizers.wait_loaded(str(tokenizer_dir)) is not None
        assert await tokenizers.token_ids(str(tokenizer_dir), doc) == vllm_chat_ids(tokenizer_dir, CONVERSATIONS[1])
        assert _sample(tokenizers, registry, "fleet_router_tokenizer_loads_total", outcome="ok") == 1
        assert _sample(tokenizers, registry, "fleet_router_prompt_tokenizations_total", outcome="inline") == 1
        image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]}
        assert await tokenizers.token_ids(str(tokenizer_dir), image) is None
        assert _sample(tokenizers, registry, "fleet_router_prompt_tokenizations_total", outcome="unsupported") == 1

        missing = str(tmp_path / "absent")
        with caplog.at_level(logging.WARNING, logger="router.kv.tokenize"):
            assert await tokenizers.wait_loaded(missing) is None
        assert "no such directory" in caplog.text and "approximate" in caplog.text
        assert tokenizers.error(missing).reason == "missing"  # type: ignore[union-attr]
        assert _sample(tokenizers, registry, "fleet_router_tokenizer_loads_total", outcome="missing") == 1
        assert _sample(tokenizers, registry, "fleet_router_tokenizers", state="failed") == 1
        assert _sample(tokenizers, registry, "fleet_router_tokenizers", state="loaded") == 1
        await tokenizers.wait_loaded(missing)                                    # not retried at once
        assert _sample(tokenizers, registry, "fleet_router_tokenizer_loads_total", outcome="missing") == 1
        (tmp_path / "absent").mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            (tmp_path / "absent" / f).write_bytes((tokenizer_dir / f).read_bytes())
        now[0] = 61.0                                                            # RETRY_AFTER_S later
        assert await tokenizers.wait_loaded(missing) is not None
        assert tokenizers.error(missing) is None
    finally:
        tokenizers.close()


async def test_long_prompts_are_tokenized_in_a_thread_and_bounded(tokenizer_dir: Path) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    inline = PoolTokenizers(CollectorRegistry(), offload_chars=10**9)
    threaded = PoolTokenizers(registry, offload_chars=100)
    busy = PoolTokenizers(CollectorRegistry(), offload_chars=100, max_pending=0)
    text = "Prefill processes the prompt tokens of new requests; decode produces one token. " * 50
    docs = [{"prompt": text}, {"messages": [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"},
                                            {"role": "user", "content": text}]}]  # fmt: skip
    try:
        for t in (inline, threaded, busy):
            await t.wait_loaded(str(tokenizer_dir))
        for doc in docs:
            assert prompt_chars(doc) >= 100
            expected = await inline.token_ids(str(tokenizer_dir), doc)
            assert expected and await threaded.token_ids(str(tokenizer_dir), doc) == expected
            assert await busy.token_ids(str(tokenizer_dir), doc) is None
        assert registry.get_sample_value("fleet_router_prompt_tokenizations_total", {"outcome": "thread"}) == 2
        # Concurrent long prompts all come back, each with its own ids.
        many = [{"prompt": f"{i} {text}"} for i in range(8)]
        got = await asyncio.gather(*(threaded.token_ids(str(tokenizer_dir), d) for d in many))
        assert [g[:3] for g in got] == [load_tokenizer(str(tokenizer_dir)).encode(d["prompt"], True)[:3] for d in many]
    finally:
        for t in (inline, threaded, busy):
            t.close()


def test_route_request_token_ids_for_id_prompts_only() -> None:
    ids = list(range(100, 300))
    assert route_request({"prompt": ids}).token_ids == ids
    assert route_request({"prompt": [ids, [1, 2]]}).token_ids == ids
    assert route_request({"prompt": "text"}).token_ids is None
    assert route_request({"messages": [{"role": "user", "content": "x"}]}).token_ids is None


async def test_proxy_fills_token_ids_from_the_pools_tokenizer(tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                              tier_guards: Any) -> None:  # fmt: skip
    from router.pools.policies import KvAware
    from router.pools.pool import Pool
    from tests.support.router import FakeEngine
    from tests.unit.test_router_proxy import AUTH, router

    seen: list[Any] = []
    choose = KvAware.choose

    def spy(self: KvAware, endpoints: Any, request: Any, now_s: float, kv_view: Any = None) -> Any:
        seen.append(request)
        return choose(self, endpoints, request, now_s, kv_view)

    monkeypatch.setattr(KvAware, "choose", spy)
    wants = [False]
    monkeypatch.setattr(Pool, "wants_token_ids", lambda self: wants[0])
    chat = {"model": "m", "messages": CONVERSATIONS[1], "max_tokens": 4}
    async with FakeEngine("e") as engine, router() as (app, client):
        pool = {"policy": "kv-aware", "endpoints": [{"id": "e", "url": engine.url}], "tokenizer": str(tokenizer_dir)}
        async with client.put("/admin/v1/pools/m", json=pool, headers=AUTH) as resp:
            assert resp.status == 200, await resp.text()
        async with client.post("/v1/chat/completions", json=chat) as resp:   # starts the load; no ids wanted
            assert resp.status == 200
        assert await app.proxy.tokenizers.wait_loaded(str(tokenizer_dir)) is not None
        wants[0] = True
        async with client.post("/v1/chat/completions", json=chat) as resp:
            assert resp.status == 200
        async with client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}) as resp:
            assert resp.status == 200
    expected = vllm_chat_ids(tokenizer_dir, CONVERSATIONS[1])
    assert seen[0].token_ids is None
    assert seen[1].token_ids == expected and seen[1].prompt_tokens == len(expected)
    assert seen[2].token_ids == [5, 6, 7]


# ----- chat prompts: the history's pieces are not tokenized again (router.kv.token_segments) -------------

def test_segment_cache_gives_the_whole_encodes_ids_and_reuses_the_history(tokenizer_dir: Path) -> None:
    tok = load_tokenizer(str(tokenizer_dir))
    assert tok.segments is not None   # byte-level BPE, special tokens without lstrip/rstrip: exact
    long = "Prefill processes the prompt tokens of new requests; decode produces one token. " * 20
    turn1 = [{"role": "system", "content": long}, {"role": "user", "content": long + " first?"}]
    turn2 = [*turn1, {"role": "assistant", "content": "an answer"}, {"role": "user", "content": "second?"}]
    for messages in (turn1, turn2, *CONVERSATIONS):
        assert tok.prompt_token_ids({"messages": messages}) == vllm_chat_ids(tokenizer_dir, messages)
    hits = tok.segments.hits
    tok.prompt_token_ids({"messages": [*turn2, {"role": "assistant", "content": "b"}, {"role": "user", "content": "3"}]})
    assert tok.segments.hits == hits + 2   # the system prompt and the first question: from the cache
    for text in ("<s><s>x</s>", "</s>" + long + "<|user|><|assistant|>\n\n  " + long, "no specials " * 40, ""):
        assert tok.segments.encode(text) == tok.tokenizer.encode(text, add_special_tokens=False).ids


def test_segment_cache_is_bounded_and_refuses_tokenizers_it_cannot_split(tokenizer_dir: Path) -> None:
    import re

    from router.kv.token_segments import SegmentCache, _regex_of

    description = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    raw = load_tokenizer(str(tokenizer_dir)).tokenizer
    small = SegmentCache.for_tokenizer(raw, description, max_chars=1_000)
    assert small is not None
    for i in range(20):
        small.encode(f"<s>{i} " + "x " * 200 + "</s>")
    assert 0 < small.chars <= 1_000
    stripping = json.loads(json.dumps(description))
    stripping["added_tokens"][1]["lstrip"] = True     # "</s>" eats the whitespace before it
    assert SegmentCache.for_tokenizer(raw, stripping) is None
    first = {**description, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}}
    assert SegmentCache.for_tokenizer(raw, first) is None
    assert re.compile(f"({_regex_of(['<|a|>', '<|a|>x', '<|b|>'])})").split("1<|a|>x2<|a|>3<|b|>") == [
        "1", "<|a|>x", "2", "<|a|>", "3", "<|b|>", ""]   # leftmost-longest, as tokenizers matches


def test_a_kv_aware_pool_wants_token_ids_while_an_exact_view_is_live() -> None:
    from router.kv.events import BlockStored, EventBatch
    from router.kv.exact_index import ExactIndex
    from router.pools.endpoint import EndpointState
    from router.pools.policies import KvAware, RoundRobin
    from router.pools.pool import Pool

    endpoints = [EndpointState("e", "http://127.0.0.1:1")]
    index = ExactIndex()
    assert not Pool("m", KvAware(), endpoints, 0.0).wants_token_ids()   # no exact index: the approximate view only
    pool = Pool("m", KvAware(), endpoints, 0.0, kv_view=index)
    round_robin = Pool("m", RoundRobin(), endpoints, 0.0, kv_view=index)
    assert not pool.wants_token_ids()
    index.open("e")
    index.apply("e", EventBatch(0.0, [BlockStored([1], None, list(range(16)), 16)]))
    assert pool.wants_token_ids()                     # a live stream with blocks: ids are worth it
    assert not round_robin.wants_token_ids()          # its policy reads no token ids
    index.stream_down("e")
    assert not pool.wants_token_ids()


def test_a_hub_source_fetches_the_tokenizer_files_only(tokenizer_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """A router pod holds no weights: `hf://org/name@rev` fetches tokenizer.json,
    tokenizer_config.json and chat_template.jinja from the hub (a local hub server here) and
    tokenizes as the directory does; errors name the reason."""
    import huggingface_hub.constants
    import huggingface_hub.errors

    from fleet.testing.hub_server import HubRepo, HubServer

    files = {f: (tokenizer_dir / f).read_bytes() for f in ("tokenizer.json", "tokenizer_config.json",
                                                           "chat_template.jinja")}  # fmt: skip
    repos = {"org/tiny": HubRepo({**files, "config.json": b"{}", "model.safetensors": b"\0" * 4096}),
             "org/no-tokenizer": HubRepo({"config.json": b"{}"})}  # fmt: skip
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with HubServer(repos) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        tok = load_tokenizer(f"hf://org/tiny@{repos['org/tiny'].commit}")
        local = load_tokenizer(str(tokenizer_dir))
        chat = {"messages": CONVERSATIONS[1]}
        assert tok.prompt_token_ids(chat) == local.prompt_token_ids(chat)
        assert tok.prompt_token_ids({"prompt": "hello there"}) == local.prompt_token_ids({"prompt": "hello there"})
        fetched = {p.rsplit("/", 1)[1] for m, p, _ in hub.log.requests if m == "GET" and "/resolve/" in p}
        assert fetched == set(files)                                    # never the weights
        assert load_tokenizer("hf://org/tiny").prompt_token_ids({"prompt": "hi"})   # the default branch

        for source, match in (("hf://org/absent", "repository 'org/absent' not found"),
                              ("hf://org/tiny@no-such-branch", "revision 'no-such-branch' not found"),
                              ("hf://org/no-tokenizer", "has no tokenizer.json"),
                              ("hf://just-a-name", "not an hf://org/name")):  # fmt: skip
            with pytest.raises(TokenizerError, match=match) as err:
                load_tokenizer(source)
            assert err.value.reason == "missing"

    def unreachable(*args: Any, **kwargs: Any) -> str:   # what huggingface_hub raises after its retries
        raise huggingface_hub.errors.LocalEntryNotFoundError("connection refused, not in the local cache")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", unreachable)
    with pytest.raises(TokenizerError, match="the hub did not answer") as err:
        load_tokenizer("hf://org/other")
    assert err.value.reason == "unreadable"
