"""A chat prompt as vLLM renders it: transformers' template environment and vLLM's conversation.

Owns `compile_chat_template` (a model's chat template compiled as transformers compiles it),
`names_content_loop` (which content format the template takes), `conversation` (a request's
messages as vLLM hands them to the template), `template_variables` (the template's variables from
a request) and the errors `UnsupportedPrompt` and `ChatTemplateError`. Used by
`router.kv.prompt_tokenizer.PromptTokenizer` (rendering) and `router.kv.tokenizer_files`
(compiling). Pure: no I/O.

What vLLM 0.32 (transformers 5) does with a `/v1/chat/completions` body, reproduced: the
messages become vLLM's "conversation" (vllm/renderers/chat_utils.py,
`parse_chat_messages`: text parts joined with ``"\\n"`` for templates that take a string
content, kept as ``{"type": "text", "text": ...}`` parts for templates that loop over the
content (``"openai"`` format, detected from the template's syntax tree as
vllm/renderers/hf.py `_detect_content_format` does, simplified); assistant ``tool_calls``
arguments decoded to objects; ``developer`` turned into ``system`` when the template never
names it), rendered by transformers' ``apply_chat_template`` (vllm/renderers/hf.py,
`safe_apply_chat_template`) and tokenized with ``add_special_tokens=False`` (the template
writes BOS itself). Rendering is transformers' (transformers/utils/chat_template_utils.py,
`_compile_jinja_template` and `render_jinja_template`): jinja2's ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a
``{% generation %}`` tag, ``raise_exception``, ``strftime_now``, a ``tojson`` that keeps
non-ASCII and HTML characters; the variables are ``messages``, ``tools`` (None),
``documents`` (None), ``add_generation_prompt`` (the request's, default true), the named
special tokens (``bos_token``, ``eos_token``, ... from tokenizer_config.json) and the request's
``chat_template_kwargs``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class UnsupportedPrompt(ValueError):
    """A request whose token ids the router cannot reproduce (images, tools, ...): no ids."""


class ChatTemplateError(ValueError):
    """The chat template failed on these messages (``raise_exception``, a jinja error); vLLM
    answers such a request 400."""


# ----- the chat template environment: transformers' ----------------------------------------------

class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: renders its body. Transformers' AssistantTracker
    also records where the assistant's text lies (for training masks); rendering is the same."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled as transformers compiles a chat template (module docstring).
    Raises jinja2.TemplateSyntaxError."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def names_content_loop(source: str, env: jinja2.Environment) -> bool:
    """Whether the template loops over a message's content (``{% for part in message['content'] %}``
    or over a variable named ``content``): vLLM's "openai" content format, parts kept as dicts
    (a simplification of vllm/renderers/hf.py `_detect_content_format`, which also follows
    assignments and macro arguments)."""
    try:
        tree = env.parse(source)
    except jinja2.TemplateSyntaxError:
        return False
    for loop in tree.find_all(jinja2.nodes.For):
        it = loop.iter
        if isinstance(it, jinja2.nodes.Name) and it.name == "content":
            return True
        if isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const) and it.arg.value == "content":
            return True
        if isinstance(it, jinja2.nodes.Getattr) and it.attr == "content":
            return True
    return False


# ----- the conversation: vLLM's -----------------------------------------------------------------

_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def conversation(messages: Sequence[object], *, content_parts: bool = False,
                 names_developer: bool = False) -> list[dict[str, Any]]:
    """``messages`` as vLLM hands them to the template (module docstring): a list of turns, each a
    dict with ``role`` and ``content`` (a string, or text parts when ``content_parts``: the
    template loops over the parts, vLLM's "openai" content format, `names_content_loop`), and
    an assistant's ``tool_calls`` and reasoning, a tool result's ``tool_call_id``, a ``name``.
    ``names_developer``: the template knows the developer role (else developer turns become
    system turns). Raises UnsupportedPrompt for anything else than text content, or a malformed
    message."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise UnsupportedPrompt("a message without a string role")
        role = message["role"]
        texts = _texts(message.get("content"))
        if role == "system":
            texts = _without_billing_header(texts)
        # A tool result's text parts are joined even for templates that take parts (vLLM). Joined
        # parts leave out the empty ones, as vLLM's parse does (`if parse_res:`); parts kept as
        # dicts keep them.
        content: object = ([{"type": "text", "text": t} for t in texts] if content_parts and role != "tool"
                           else "\n".join(t for t in texts if t))  # fmt: skip
        turn: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant":
            calls = message.get("tool_calls")
            if isinstance(calls, list) and calls:
                turn["tool_calls"] = [_tool_call(c) for c in calls]
            reasoning = message.get("reasoning")
            if reasoning is not None:
                turn["reasoning"] = turn["reasoning_content"] = reasoning
        elif role == "tool" and "tool_call_id" in message:
            turn["tool_call_id"] = message["tool_call_id"]
        if isinstance(message.get("name"), str):
            turn["name"] = message["name"]
        out.append(turn)
    if not names_developer and any(t["role"] == "developer" for t in out):
        out = _developer_as_system(out)
    return out


def template_variables(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The chat template's variables from a request, as vLLM 0.32 builds them
    (vllm/entrypoints/openai/chat_completion/protocol.py, `ChatCompletionRequest.build_chat_params`):
    ``chat_template_kwargs``, then ``reasoning_effort`` when set (not "auto"), and with it
    ``enable_thinking`` (effort not "none") unless the request's kwargs name it."""
    given = doc.get("chat_template_kwargs")
    kwargs = dict(given) if isinstance(given, Mapping) else {}
    effort = doc.get("reasoning_effort")
    if effort is not None and effort != "auto":
        if "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = effort != "none"
        kwargs["reasoning_effort"] = effort
    return kwargs


def _texts(content: object) -> list[str]:
    """The text pieces of a message's content (None: none). Raises UnsupportedPrompt."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise UnsupportedPrompt("content that is neither text nor a list of parts")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
            continue
        key = _TEXT_PART_KEYS.get(part.get("type")) if isinstance(part, Mapping) else None
        if key is None:
            raise UnsupportedPrompt("a content part that is not text")
        text = part.get(key)
        if text is None:
            continue   # vLLM skips a text part without text
        if not isinstance(text, str):
            raise UnsupportedPrompt("a text part whose text is not a string")
        texts.append(text)
    return texts


_BILLING_HEADER = "x-anthropic-billing-header"


def _without_billing_header(texts: list[str]) -> list[str]:
    """A system message's texts without Claude Code's attribution header line, whose value
    changes on every request (vllm/renderers/chat_utils.py, `_strip_claude_code_billing_header`)."""
    out = []
    for text in texts:
        if not text.startswith(_BILLING_HEADER):
            out.append(text)
        elif rest := text.partition("\n")[2]:
            out.append(rest)
    return out


def _tool_call(call: object) -> dict[str, Any]:
    """An assistant tool call with its ``arguments`` decoded to an object, as vLLM's
    `_postprocess_messages` does (bad JSON or a non-object: ``{}``)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise UnsupportedPrompt("a tool call that is not a function call")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = None
    function["arguments"] = arguments if isinstance(arguments, dict) else {}
    return {**call, "function": function}


def _developer_as_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """vLLM's `_convert_developer_to_system` then `_consolidate_system_messages`
    (vllm/renderers/hf.py): developer turns become system turns, and system turns that are not
    all first are merged into one first turn (contents joined by a blank line)."""
    turns = [{**t, "role": "system"} if t["role"] == "developer" else t for t in conversation]
    system = [i for i, t in enumerate(turns) if t["role"] == "system"]
    if len(system) <= 1 and (not system or system[0] == 0):
        return turns
    contents = []
    for t in turns:
        if t["role"] == "system":
            c = t.get("content", "")
            if isinstance(c, list):
                c = "\n".join(p["text"] for p in c if isinstance(p, Mapping) and "text" in p)
            if c:
                contents.append(c)
    return [{"role": "system", "content": "\n\n".join(contents)}, *(t for t in turns if t["role"] != "system")]
