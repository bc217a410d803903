"""A pool's own tokenizer in the router: the token ids the engine will compute for a prompt.

Owns `PromptTokenizer` (one model's tokenizer: `tokenizers` for the ids, jinja2 for the chat
template), `load_tokenizer` (read one from a local directory, or fetch its files from the hub
first: `fetch_from_hub`; blocking), `TokenizerError`, and `PoolTokenizers`, the router's set of
loaded tokenizers: loaded in a worker thread when a pool names a directory or an ``hf://``
source (`router.pools.spec.PoolSpec.tokenizer`), used by `router.request.proxy` for every request of
such a pool to fill `router.kv.prompt_blocks.RouteRequest.token_ids`, which the exact KV index matches
against the engines' KV events. A pool whose tokenizer is loading or failed still routes, on the
approximate (text-block) view only; a failed load is logged with its reason and counted.

**What vLLM computes, reproduced** (vLLM 0.32, transformers 5):

* `/v1/completions` with a text prompt: ``tokenizer.encode(prompt, add_special_tokens=True)``
  (the request's ``add_special_tokens``, default true: vllm/entrypoints/openai/completion/protocol.py),
  so the post-processor of tokenizer.json adds BOS where the model wants it. A token-id prompt
  is used as sent.
* `/v1/chat/completions`: the messages become vLLM's "conversation" (vllm/renderers/chat_utils.py,
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

What cannot be reproduced gives no token ids (the request is routed on the approximate view):
images, audio or other non-text parts (their placeholder tokens come from the engine's processor),
``tools`` (vLLM passes them through its own request model first), a per-request
``chat_template``, ``documents``, ``continue_final_message``, and a template that raises.

**Cost.** Tokenization is Rust, but `tokenizers.Tokenizer.encode` holds the GIL while it runs;
``encode_batch_fast`` releases it (pyo3 ``py.detach``, bindings/python/src/tokenizer.rs) and,
without character offsets, is also faster. So a prompt of at least `OFFLOAD_CHARS` characters is
rendered and tokenized in a worker thread while the event loop serves other requests; a shorter
one inline, where the hop to a thread would cost more than the work (figures and command:
docs/benchmarks.md, "Tokenizing in the router").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from prometheus_client import CollectorRegistry, Counter, Gauge

from router.kv.token_segments import SegmentCache

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
"""Where transformers (>= 4.43) saves a model's single chat template; it wins over
tokenizer_config.json's ``chat_template`` when both exist, as in transformers' loading."""
HUB_PREFIX = "hf://"
HUB_FILES = (TOKENIZER_FILE, CONFIG_FILE, CHAT_TEMPLATE_FILE)
"""What the router fetches of a hub model (`fetch_from_hub`): the tokenizer, never the weights."""
HUB_TIMEOUT_S = 10.0
"""Seconds huggingface_hub waits for the hub's answer about each file."""
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens a chat template sees (transformers' `SPECIAL_TOKENS_ATTRIBUTES`)."""

OFFLOAD_CHARS = 2_048
"""Prompts of at least this many characters (text, or the sum of a chat's message contents) are
tokenized in a worker thread; shorter ones on the event loop. Measured (docs/benchmarks.md,
"Tokenizing in the router"; shared machine): the round trip to a thread costs 44-121 us of wall
time, what tokenizing ~200 characters does, while 2 KiB take 0.4-1.2 ms and 4 KiB 1.6-2.6 ms:
below this the loop is held for about a millisecond at most, above it the hop costs about a
tenth of the work it moves off the loop."""
TOKENIZE_THREADS = 2
"""Worker threads that tokenize long prompts (one per core of the router's usual 2-core pod)."""
MAX_PENDING = 64
"""Long prompts waiting for a tokenizing thread beyond which a request is routed without token
ids (approximately) rather than queued: routing must not wait behind a burst of long prompts."""
MAX_TOKENIZERS = 32
"""Tokenizers kept loaded; the least recently used directory is dropped beyond it."""
RETRY_AFTER_S = 60.0
"""Seconds before a directory whose load failed is tried again (its files may arrive later)."""

LOAD_OUTCOMES = ("ok", "missing", "unreadable", "invalid", "chat_template")
"""Values of the `outcome` label of `fleet_router_tokenizer_loads_total` (the `reason` of
`TokenizerError`, or ok)."""
TOKENIZE_OUTCOMES = ("inline", "thread", "unsupported", "failed", "busy", "not_loaded")
"""Values of the `outcome` label of `fleet_router_prompt_tokenizations_total`: tokenized on the
loop or in a thread; a prompt that cannot be reproduced (see the module docstring), a template or
tokenizer error, too many long prompts waiting, the pool's tokenizer not (yet) loaded."""


class TokenizerError(Exception):
    """A tokenizer directory (or hub source) the router cannot use. ``reason`` is one word for the
    metric label: ``missing`` (no directory or no tokenizer.json; on the hub: no such repository,
    revision or file), ``unreadable`` (an OS error; the hub did not answer), ``invalid``
    (tokenizer.json or tokenizer_config.json that does not parse), ``chat_template`` (a chat
    template that does not compile). The message names the directory and the file."""

    def __init__(self, directory: str, reason: str, message: str) -> None:
        super().__init__(f"tokenizer {directory}: {message}")
        self.directory = directory
        self.reason = reason


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


def _names_content_loop(source: str, env: jinja2.Environment) -> bool:
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


# ----- one tokenizer ----------------------------------------------------------------------------

_TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                                     "tokenize"})  # fmt: skip


@dataclass(frozen=True, eq=False)
class PromptTokenizer:
    """One model's tokenizer and chat template (see the module docstring for what is reproduced).

    Thread-safe: the proxy calls it on the event loop and in worker threads at once. Build with
    `load_tokenizer`.
    """

    directory: str
    tokenizer: Any                                # tokenizers.Tokenizer
    chat_template: jinja2.Template | None = None
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    content_parts: bool = False                   # vLLM's "openai" content format
    names_developer: bool = False                 # the template knows the developer role
    segments: SegmentCache | None = None          # chat prompts: ids of pieces seen before (router.kv.token_segments)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text`` (``encode_batch_fast``: same ids as ``encode``, no offsets, GIL
        released). Raises ValueError for text the tokenizer refuses (a lone surrogate)."""
        try:
            return self.tokenizer.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        except Exception as exc:  # tokenizers raises plain Exception
            raise ValueError(f"tokenizer refused the text: {exc}") from None

    def conversation(self, messages: Sequence[object]) -> list[dict[str, Any]]:
        """``messages`` as vLLM hands them to the template (module docstring). Raises
        UnsupportedPrompt for anything else than text content, or a malformed message."""
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
            content: object = ([{"type": "text", "text": t} for t in texts] if self.content_parts and role != "tool"
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
        if not self.names_developer and any(t["role"] == "developer" for t in out):
            out = _developer_as_system(out)
        return out

    def render_chat(self, messages: Sequence[object], *, add_generation_prompt: bool = True,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:  # fmt: skip
        """The prompt text of a chat, as transformers' ``apply_chat_template(tokenize=False)``
        renders it. Raises UnsupportedPrompt (no chat template, non-text content) or
        ChatTemplateError (the template raised)."""
        if self.chat_template is None:
            raise UnsupportedPrompt("the tokenizer has no chat template")
        if not messages:
            raise UnsupportedPrompt("no messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_VARS}
        try:
            return self.chat_template.render(messages=self.conversation(messages), tools=None, documents=None,
                                             add_generation_prompt=add_generation_prompt,
                                             **{**self.special_tokens, **kwargs})  # fmt: skip
        except UnsupportedPrompt:
            raise
        except Exception as exc:   # raise_exception, an undefined name, a type error in the template
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from None

    def prompt_token_ids(self, doc: Mapping[str, Any]) -> list[int]:
        """The token ids vLLM computes for a parsed `/v1/completions` or `/v1/chat/completions`
        body: ``prompt`` (text, or the first of a batch) or ``messages``. Token-id prompts are
        `router.kv.prompt_blocks.route_request`'s, not this. Raises UnsupportedPrompt,
        ChatTemplateError, or ValueError (text the tokenizer refuses)."""
        special = doc.get("add_special_tokens")
        prompt = doc.get("prompt")
        if prompt is not None:
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                raise UnsupportedPrompt("prompt is not text")
            return self.encode(prompt, special if isinstance(special, bool) else True)
        messages = doc.get("messages")
        if not isinstance(messages, list):
            raise UnsupportedPrompt("no prompt and no messages")
        for name in ("tools", "chat_template", "documents"):
            if doc.get(name) is not None:
                raise UnsupportedPrompt(f"a request with {name}")
        if doc.get("continue_final_message"):
            raise UnsupportedPrompt("continue_final_message")
        generation = doc.get("add_generation_prompt")
        text = self.render_chat(messages, add_generation_prompt=generation if isinstance(generation, bool) else True,
                                template_kwargs=_template_kwargs(doc))  # fmt: skip
        if special is True or self.segments is None:
            return self.encode(text, special is True)
        try:
            return self.segments.encode(text)   # the history's pieces from before: only new messages cost
        except Exception as exc:  # tokenizers raises plain Exception
            raise ValueError(f"tokenizer refused the text: {exc}") from None


def _template_kwargs(doc: Mapping[str, Any]) -> dict[str, Any]:
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


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(directory: str, name: str) -> dict[str, Any] | None:
    path = Path(directory) / name
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(directory, "unreadable", f"cannot read {name}: {exc}") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise TokenizerError(directory, "invalid", f"{name} is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise TokenizerError(directory, "invalid", f"{name} is not a JSON object")
    return doc


def _template_source(directory: str, config: Mapping[str, Any]) -> str | None:
    """The model's chat template: chat_template.jinja, else tokenizer_config.json's
    ``chat_template`` (a string, or a list of named templates: the one named ``default``)."""
    try:
        return (Path(directory) / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(directory, "unreadable", f"cannot read {CHAT_TEMPLATE_FILE}: {exc}") from None
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
        source = named.get("default")
    if source is not None and not isinstance(source, str):
        raise TokenizerError(directory, "invalid", f"{CONFIG_FILE}: chat_template is not a string")
    return source


def parse_hub_source(source: str) -> tuple[str, str | None]:
    """``hf://org/name[@revision]`` -> (repository id, revision or None for the default branch).
    Raises TokenizerError (``missing``) for anything else."""
    repo, _, revision = source.removeprefix(HUB_PREFIX).partition("@")
    if not source.startswith(HUB_PREFIX) or repo.count("/") != 1 or not all(repo.split("/")) or (_ and not revision):
        raise TokenizerError(source, "missing", "not an hf://org/name[@revision] source")
    return repo, revision or None


def fetch_from_hub(source: str) -> str:
    """The local directory holding the tokenizer files of the hub model ``source``
    (``hf://org/name[@revision]``), fetched with huggingface_hub's ``hf_hub_download`` (it reads
    ``HF_ENDPOINT`` and ``HF_TOKEN``, and keeps the files in its cache under ``HF_HOME``): the
    `HUB_FILES` only, never the weights; tokenizer.json must exist, the others where the
    repository has them. A router pod (which holds no weights) gets a model's tokenizer this way.
    Blocking (network): call it off the event loop.

    Raises:
        TokenizerError: no such repository, revision or tokenizer.json, or no access
            (``missing``); the hub did not answer or the cache cannot be written (``unreadable``).
    """
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    repo, revision = parse_hub_source(source)
    directory: str | None = None
    for name in HUB_FILES:
        try:
            path = hf_hub_download(repo, name, revision=revision, endpoint=os.environ.get("HF_ENDPOINT") or None,
                                   etag_timeout=HUB_TIMEOUT_S)
        except LocalEntryNotFoundError:   # the hub did not answer (after huggingface_hub's retries), not cached
            raise TokenizerError(source, "unreadable", f"{name}: the hub did not answer and the hub cache has "
                                 "no copy") from None  # fmt: skip
        except EntryNotFoundError:
            if name == TOKENIZER_FILE:
                raise TokenizerError(source, "missing", f"the repository has no {TOKENIZER_FILE} (a fast tokenizer "
                                     "is needed)") from None  # fmt: skip
            continue
        except RevisionNotFoundError:
            raise TokenizerError(source, "missing", f"revision {revision!r} not found") from None
        except RepositoryNotFoundError:
            raise TokenizerError(source, "missing", f"repository {repo!r} not found (or no access: set HF_TOKEN "
                                 "in the router's environment)") from None  # fmt: skip
        except (HfHubHTTPError, OSError, ValueError) as exc:
            raise TokenizerError(source, "unreadable", f"{name} not fetched from the hub: {exc}") from None
        directory = directory or str(Path(path).parent)
    assert directory is not None   # tokenizer.json came first, or raised
    return directory


def load_tokenizer(source: str) -> PromptTokenizer:
    """The tokenizer of the model in the directory ``source`` (tokenizer.json; tokenizer_config.json
    and chat_template.jinja when present), or of the hub model ``source`` (``hf://org/name[@rev]``:
    its tokenizer files fetched first, `fetch_from_hub`). Blocking (reads files, builds the Rust
    tokenizer: tens of milliseconds to seconds for a large vocabulary; the network for a hub
    source): call it off the event loop.

    Raises:
        TokenizerError: no such directory or no tokenizer.json (``missing``), a file that cannot
            be read (``unreadable``), one that does not parse (``invalid``), a chat template
            that does not compile (``chat_template``); for a hub source, as `fetch_from_hub`.
    """
    from tokenizers import Tokenizer

    directory = fetch_from_hub(source) if source.startswith(HUB_PREFIX) else source
    root = Path(directory)
    if not root.is_dir():
        raise TokenizerError(directory, "missing", "no such directory")
    if not (root / TOKENIZER_FILE).is_file():
        raise TokenizerError(directory, "missing", f"no {TOKENIZER_FILE} (a fast tokenizer is needed)")
    config = _read_json(directory, CONFIG_FILE) or {}
    try:
        text = (root / TOKENIZER_FILE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(directory, "unreadable", f"cannot read {TOKENIZER_FILE}: {exc}") from None
    try:
        description = json.loads(text)
    except ValueError as exc:
        raise TokenizerError(directory, "invalid", f"{TOKENIZER_FILE} is not valid JSON: {exc}") from None
    try:
        tokenizer = Tokenizer.from_str(text)
    except Exception as exc:  # tokenizers raises plain Exception for a description it cannot use
        raise TokenizerError(directory, "invalid", f"{TOKENIZER_FILE} does not load: {exc}") from None
    special = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    source = _template_source(directory, config)
    template = None
    content_parts = names_developer = False
    if source is not None:
        try:
            template = compile_chat_template(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(directory, "chat_template", f"the chat template does not compile: {exc}") from None
        content_parts = _names_content_loop(source, template.environment)
        names_developer = '"developer"' in source or "'developer'" in source   # vLLM's own test
    return PromptTokenizer(directory, tokenizer, template, special, content_parts, names_developer,
                           SegmentCache.for_tokenizer(tokenizer, description))  # fmt: skip


def prompt_chars(doc: Mapping[str, Any]) -> int:
    """Characters of a body's prompt (text, the first of a batch) or of what its messages give the
    chat template (text content and parts, an assistant's reasoning, tool-call arguments given as
    text): what decides between tokenizing on the loop and in a thread. Cheap (no copy)."""
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        return len(prompt)
    if isinstance(prompt, list):
        return len(prompt[0]) if prompt and isinstance(prompt[0], str) else 0
    messages = doc.get("messages")
    total = 0
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, Mapping):
                continue
            content = m.get("content")
            if isinstance(content, str):
                total += len(content)
            elif isinstance(content, list):
                for p in content:
                    text = p.get("text") if isinstance(p, Mapping) else p
                    total += len(text) if isinstance(text, str) else 0
            reasoning = m.get("reasoning")
            total += len(reasoning) if isinstance(reasoning, str) else 0
            calls = m.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    function = call.get("function") if isinstance(call, Mapping) else None
                    arguments = function.get("arguments") if isinstance(function, Mapping) else None
                    total += len(arguments) if isinstance(arguments, str) else 0
    return total


# ----- the router's tokenizers ------------------------------------------------------------------

@dataclass(eq=False)
class _Entry:
    tokenizer: PromptTokenizer | None = None
    loading: asyncio.Future | None = None
    error: TokenizerError | None = None
    failed_at_s: float = 0.0


class PoolTokenizers:
    """The tokenizers of the router's pools, one per directory, loaded in a worker thread.

    `want(directory)` (on a pool put, and lazily on a request) starts a load unless the directory
    is loaded, loading, or failed less than `RETRY_AFTER_S` ago; `get` returns the loaded
    tokenizer or None; `token_ids(directory, doc)` the prompt's ids or None (not loaded, not
    reproducible, too busy). Metrics on ``registry``: `fleet_router_tokenizer_loads_total{outcome}`,
    `fleet_router_tokenizers{state}` (loaded, loading, failed directories) and
    `fleet_router_prompt_tokenizations_total{outcome}`. ``clock``: monotonic seconds (retries).
    Must be used from one event loop; `close` stops the threads.
    """

    def __init__(self, registry: CollectorRegistry | None = None, *, clock: Callable[[], float] = time.monotonic,
                 loader: Callable[[str], PromptTokenizer] = load_tokenizer, offload_chars: int = OFFLOAD_CHARS,
                 threads: int = TOKENIZE_THREADS, max_pending: int = MAX_PENDING,
                 max_tokenizers: int = MAX_TOKENIZERS) -> None:  # fmt: skip
        self._entries: dict[str, _Entry] = {}
        self._clock = clock
        self._loader = loader
        self.offload_chars = offload_chars
        self._threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._pending = 0
        self._max_pending = max_pending
        self._max_tokenizers = max_tokenizers
        registry = registry if registry is not None else CollectorRegistry()
        self._loads = Counter("fleet_router_tokenizer_loads", "Tokenizer loads from a pool's tokenizer directory, "
                              "by outcome: ok, or why it failed (missing, unreadable, invalid, chat_template); a pool "
                              "whose tokenizer failed routes on the approximate prefix view only.",
                              ["outcome"], registry=registry)  # fmt: skip
        self._states = Gauge("fleet_router_tokenizers", "Tokenizer directories by state (loaded, loading, failed).",
                             ["state"], registry=registry)  # fmt: skip
        self._states.labels("loaded").set_function(lambda: self._count("loaded"))
        self._states.labels("loading").set_function(lambda: self._count("loading"))
        self._states.labels("failed").set_function(lambda: self._count("failed"))
        tokenized = Counter("fleet_router_prompt_tokenizations", "Requests of pools with a tokenizer, by outcome: "
                            "inline (tokenized on the event loop), thread (a long prompt, in a worker thread), "
                            "unsupported (images, tools, ...: no token ids), failed (the chat template or tokenizer "
                            "refused it), busy (too many long prompts waiting), not_loaded.",
                            ["outcome"], registry=registry)  # fmt: skip
        self._outcome = {o: tokenized.labels(o) for o in TOKENIZE_OUTCOMES}

    def _count(self, state: str) -> int:
        n = 0
        for e in self._entries.values():
            s = "loaded" if e.tokenizer is not None else "loading" if e.loading is not None else "failed"
            n += s == state
        return n

    def error(self, directory: str) -> TokenizerError | None:
        """Why ``directory``'s last load failed, or None."""
        entry = self._entries.get(directory)
        return entry.error if entry is not None else None

    def get(self, directory: str) -> PromptTokenizer | None:
        """The loaded tokenizer of ``directory``; None while loading or after a failure."""
        entry = self._entries.get(directory)
        return entry.tokenizer if entry is not None else None

    def want(self, directory: str | None) -> None:
        """Start loading ``directory`` in a thread unless it is loaded, loading, or failed less
        than `RETRY_AFTER_S` ago. Needs a running event loop; None does nothing."""
        if directory is None:
            return
        entry = self._entries.get(directory)
        if entry is not None:
            if entry.tokenizer is not None or entry.loading is not None:
                self._entries[directory] = self._entries.pop(directory)   # most recently wanted last
                return
            if self._clock() - entry.failed_at_s < RETRY_AFTER_S:
                return
        entry = entry or _Entry()
        self._entries[directory] = entry
        entry.loading = asyncio.get_running_loop().run_in_executor(self._pool(), self._loader, directory)
        entry.loading.add_done_callback(lambda f, d=directory, e=entry: self._loaded(d, e, f))
        while len(self._entries) > self._max_tokenizers:
            del self._entries[next(iter(self._entries))]

    def _loaded(self, directory: str, entry: _Entry, future: asyncio.Future) -> None:
        entry.loading = None
        if future.cancelled():
            return
        exc = future.exception()
        if exc is None:
            entry.tokenizer, entry.error = future.result(), None
            self._loads.labels("ok").inc()
            log.info("tokenizer loaded from %s", directory)
            return
        if not isinstance(exc, TokenizerError):
            exc = TokenizerError(directory, "invalid", f"{type(exc).__name__}: {exc}")
        entry.error, entry.failed_at_s = exc, self._clock()
        self._loads.labels(exc.reason).inc()
        log.warning("%s; its pool routes on the approximate prefix view (retried in %.0f s)", exc, RETRY_AFTER_S)

    async def wait_loaded(self, directory: str) -> PromptTokenizer | None:
        """Start loading ``directory`` if needed and wait for the outcome (tests, benchmarks)."""
        self.want(directory)
        entry = self._entries.get(directory)
        if entry is not None and entry.loading is not None:
            await asyncio.wait([entry.loading])
        return self.get(directory)

    async def token_ids(self, directory: str, doc: Mapping[str, Any]) -> list[int] | None:
        """The token ids of ``doc``'s prompt under ``directory``'s tokenizer (see
        `PromptTokenizer.prompt_token_ids`), or None: tokenizer not loaded (a load is started),
        a prompt that cannot be reproduced, a template error, or `MAX_PENDING` long prompts
        already waiting. Long prompts (`offload_chars`) go to a worker thread. Never raises."""
        tokenizer = self.get(directory)
        if tokenizer is None:
            self.want(directory)
            self._outcome["not_loaded"].inc()
            return None
        if prompt_chars(doc) < self.offload_chars:
            outcome = "inline"
            try:
                ids = tokenizer.prompt_token_ids(doc)
            except UnsupportedPrompt:
                outcome, ids = "unsupported", None
            except ValueError:
                outcome, ids = "failed", None
            self._outcome[outcome].inc()
            return ids
        if self._pending >= self._max_pending:
            self._outcome["busy"].inc()
            return None
        self._pending += 1
        try:
            outcome, ids = await asyncio.get_running_loop().run_in_executor(self._pool(), _tokenize, tokenizer, doc)
        finally:
            self._pending -= 1
        self._outcome[outcome].inc()
        return ids

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._threads, thread_name_prefix="tokenize")
        return self._executor

    def close(self) -> None:
        """Stop the worker threads (loads in flight finish in the background)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


def _tokenize(tokenizer: PromptTokenizer, doc: Mapping[str, Any]) -> tuple[str, list[int] | None]:
    """`PromptTokenizer.prompt_token_ids` in a worker thread, with its outcome label."""
    try:
        return "thread", tokenizer.prompt_token_ids(doc)
    except UnsupportedPrompt:
        return "unsupported", None
    except ValueError:
        return "failed", None

