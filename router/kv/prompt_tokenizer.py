"""One model's tokenizer in the router: the token ids vLLM computes for a prompt.

Owns `PromptTokenizer`: `tokenizers` for the ids, `router.kv.chat_template` for a chat's prompt
text, and `router.kv.token_segments.SegmentCache` for the pieces of a chat history seen before.
Built by `router.kv.tokenizer_files.load_tokenizer`; called by `router.kv.tokenize.PoolTokenizers`
(on the event loop and in worker threads) and by the engine simulator
(`fleet/enginesim/realtokens.py`), which tokenizes with the very same code.

**What vLLM computes, reproduced** (vLLM 0.32, transformers 5):

* `/v1/completions` with a text prompt: ``tokenizer.encode(prompt, add_special_tokens=True)``
  (the request's ``add_special_tokens``, default true: vllm/entrypoints/openai/completion/protocol.py),
  so the post-processor of tokenizer.json adds BOS where the model wants it. A token-id prompt
  is used as sent.
* `/v1/chat/completions`: the messages rendered by the model's chat template as vLLM renders
  them (`router.kv.chat_template`) and tokenized with ``add_special_tokens=False`` (the template
  writes BOS itself).

What cannot be reproduced gives no token ids (the request is routed on the approximate view):
images, audio or other non-text parts (their placeholder tokens come from the engine's processor),
``tools`` (vLLM passes them through its own request model first), a per-request
``chat_template``, ``documents``, ``continue_final_message``, and a template that raises.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jinja2

from router.kv.chat_template import ChatTemplateError, UnsupportedPrompt, conversation, template_variables
from router.kv.token_segments import SegmentCache

_RESERVED_TEMPLATE_VARS = frozenset({"messages", "tools", "documents", "add_generation_prompt", "chat_template",
                                     "tokenize"})  # fmt: skip


@dataclass(frozen=True, eq=False)
class PromptTokenizer:
    """One model's tokenizer and chat template (see the module docstring for what is reproduced).

    Thread-safe: `router.kv.tokenize.PoolTokenizers` calls it on the event loop and in worker threads at once. Build with
    `router.kv.tokenizer_files.load_tokenizer`.
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
        """``messages`` as vLLM hands them to this tokenizer's template
        (`router.kv.chat_template.conversation`). Raises UnsupportedPrompt."""
        return conversation(messages, content_parts=self.content_parts, names_developer=self.names_developer)

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
                                template_kwargs=template_variables(doc))  # fmt: skip
        if special is True or self.segments is None:
            return self.encode(text, special is True)
        try:
            return self.segments.encode(text)   # the history's pieces from before: only new messages cost
        except Exception as exc:  # tokenizers raises plain Exception
            raise ValueError(f"tokenizer refused the text: {exc}") from None
