"""Tokens of the engine SIMULATOR with a model's real tokenizer (``--tokenizer DIR``).

Owns `RealTokens`: prompts become the token ids vLLM computes for them, through the very code the
router matches KV events with (`router.kv.prompt_tokenizer.PromptTokenizer`: tokenizer.json with
``add_special_tokens`` true for completions, the chat template rendered as transformers does and
tokenized without special tokens for chat), so a simulated engine and the router name the same
blocks. Output tokens are words of the tokenizer's own vocabulary that are one token each and
come back as that token when re-tokenized (``" word"`` in a byte-level BPE such as GPT-2's or
Llama 3's): a reply that a client sends back in its next turn is re-tokenized to the ids the
replica generated, as with a real model. Which words come out is a function of (seed, prompt),
as in `fleet.enginesim.tokens`. Without ``--tokenizer`` the simulator keeps its word tokenizer
(`fleet.enginesim.tokens`). Used by `fleet.enginesim.server`.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from fleet.enginesim.tokens import PromptError
from router.kv.chat_template import ChatTemplateError, UnsupportedPrompt
from router.kv.prompt_tokenizer import PromptTokenizer

MAX_OUTPUT_WORDS = 4096
"""Vocabulary entries kept as output words (the first ones found, in id order)."""


class RealTokens:
    """Prompts and output tokens of one real tokenizer (see the module docstring).

    Raises ValueError when the vocabulary has no token that decodes to text and re-encodes to
    itself (nothing to generate)."""

    def __init__(self, tokenizer: PromptTokenizer) -> None:
        self.tokenizer = tokenizer
        raw = tokenizer.tokenizer
        self.vocab_size: int = raw.get_vocab_size(with_added_tokens=True)
        special = {t for t in tokenizer.special_tokens.values()}
        words: list[int] = []
        plain: list[int] = []
        text: dict[int, str] = {}
        for token_id in range(self.vocab_size):
            piece = raw.id_to_token(token_id)
            if piece is None or piece in special:
                continue
            decoded = raw.decode([token_id], skip_special_tokens=False)
            if not decoded or "\ufffd" in decoded or raw.encode(decoded, add_special_tokens=False).ids != [token_id]:
                continue
            text[token_id] = decoded
            if decoded[0] == " " and decoded[1:].isascii() and decoded[1:].isalpha():
                words.append(token_id)
                if len(words) >= MAX_OUTPUT_WORDS:
                    break
            elif len(plain) < MAX_OUTPUT_WORDS:
                plain.append(token_id)
        self._outputs = tuple(words or plain)
        if not self._outputs:
            raise ValueError(f"tokenizer {tokenizer.directory}: no token decodes to text that re-encodes to it")
        self._text = text

    def encode_prompt(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a completions body's ``prompt`` (text, or token ids used as sent).

        Raises PromptError: a batch, ids out of the vocabulary, another type, text the tokenizer
        refuses."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise PromptError("prompt: batched prompts are not supported by the simulator; send one per request")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise PromptError(f"prompt: token id {bad[0]} is out of range 0..{self.vocab_size - 1}")
            return list(prompt)
        if not isinstance(prompt, str):
            raise PromptError("prompt: must be a string or a list of token ids")
        return self._ids(body, prompt=prompt)

    def encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        """Token ids of a chat body (``messages`` through the model's chat template).

        Raises PromptError: no messages, no chat template, non-text content, a template error."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages: must be a non-empty list")
        return self._ids(body)

    def _ids(self, body: Mapping[str, Any], prompt: str | None = None) -> list[int]:
        doc = dict(body) if prompt is None else {**body, "prompt": prompt}
        try:
            return self.tokenizer.prompt_token_ids(doc)
        except UnsupportedPrompt as err:
            raise PromptError(f"the simulator cannot tokenize this request: {err}") from None
        except ChatTemplateError as err:
            raise PromptError(f"the chat template failed: {err}") from None
        except ValueError as err:
            raise PromptError(str(err)) from None

    def filler_token_ids(self, seed: int, prompt_ids: Sequence[int], n: int) -> list[int]:
        """``n`` output token ids, a function of ``seed`` and the prompt only."""
        rng = random.Random(hash((seed, tuple(prompt_ids))))
        outputs = self._outputs
        return [outputs[rng.randrange(len(outputs))] for _ in range(n)]

    def token_text(self, token: int) -> str:
        """The text of an output token id."""
        return self._text.get(token, "")
