"""Tokens of the engine SIMULATOR: a deterministic stand-in for a tokenizer, and filler text.

Owns how prompts become token ids and output ids become text. No real tokenizer is loaded; the
rules are simple enough for a trace replayer to hit exact lengths:

- Text is split on whitespace; each word is one token, and a word longer than
  ``MAX_CHARS_PER_TOKEN`` (8) characters is one token per 8 characters. So ``"hi " * N`` is
  exactly N tokens.
- A prompt may also be a list of token ids (OpenAI's and vLLM's ``prompt: [int, ...]``): used
  as is, so its length is exact.
- A token's id depends only on its text (CRC-32), so equal text means equal ids and a repeated
  prefix really hits the prefix cache.
- Chat messages become ``<|role|>`` (one token) + content tokens per message, then one
  ``<|assistant|>`` token to open the reply: a single user message of N words is N + 2 tokens.
  With vLLM's ``continue_final_message`` and a last message of the assistant, no token opens a
  reply: the generation continues that message (how the router migrates a chat stream).
- Output tokens are words of a fixed filler vocabulary, each emitted as ``" " + word``. Their
  ids are the ids the tokenizer gives those words, so a client that sends a reply back in the
  next turn (multi-turn chat) hits the blocks the reply filled, as with a real tokenizer.
- Which filler words come out is a function of (seed, prompt), like greedy decoding.

Used by `fleet.enginesim.server`. Pure.
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Sequence

VOCAB_SIZE = 32_000
MAX_CHARS_PER_TOKEN = 8
_RESERVED = 16          # ids 0..15: role markers and specials
_ROLE_IDS = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "developer": 5}
_OPEN_REPLY_ID = 6      # "<|assistant|>" that opens the generated reply


def _filler_words() -> list[str]:
    consonants = "bdfgklmnprstvz"
    vowels = "aeiou"
    syllables = [c + v for c in consonants for v in vowels]          # 70
    words = []
    for a in syllables:
        for b in syllables:
            words.append(a + b)                                       # 4 letters, 4,900 words
    return words[:2048]


FILLER_WORDS: tuple[str, ...] = tuple(_filler_words())
_FILLER_INDEX = {w: i for i, w in enumerate(FILLER_WORDS)}
_HASHED_BASE = _RESERVED + len(FILLER_WORDS)


def token_id(piece: str) -> int:
    """Id of one token's text (a word of at most 8 characters)."""
    i = _FILLER_INDEX.get(piece)
    if i is not None:
        return _RESERVED + i
    return _HASHED_BASE + zlib.crc32(piece.encode("utf-8")) % (VOCAB_SIZE - _HASHED_BASE)


def encode(text: str) -> list[int]:
    """Token ids of ``text`` (rules in the module docstring)."""
    ids = []
    for word in text.split():
        for start in range(0, len(word), MAX_CHARS_PER_TOKEN):
            ids.append(token_id(word[start:start + MAX_CHARS_PER_TOKEN]))
    return ids


def count_tokens(text: str) -> int:
    """How many tokens `encode` gives ``text``, without building the list."""
    return sum(-(-len(w) // MAX_CHARS_PER_TOKEN) for w in text.split())


class PromptError(ValueError):
    """A prompt or message list the simulator cannot take; the message says why (HTTP 400)."""


def _content_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise PromptError(f"{where}.content[{i}]: only text parts are supported by the simulator")
        return " ".join(parts)
    raise PromptError(f"{where}.content: must be a string or a list of text parts")


def encode_chat(messages: Sequence[object], continue_final: bool = False) -> list[int]:
    """Token ids of a chat: per message ``<|role|>`` + content, then ``<|assistant|>``. With
    ``continue_final`` (vLLM's ``continue_final_message``, for a chat whose last message is the
    assistant's partial reply) no ``<|assistant|>`` follows: the reply goes on from that message.

    Raises:
        PromptError: empty list, a message that is not an object with a known role.
    """
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages: must be a non-empty list")
    ids: list[int] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise PromptError(f"{where}: must be an object")
        role = m.get("role")
        if role not in _ROLE_IDS:
            raise PromptError(f"{where}.role: must be one of {', '.join(_ROLE_IDS)}, got {role!r}")
        ids.append(_ROLE_IDS[role])
        ids.extend(encode(_content_text(m.get("content"), where)))
    last = messages[-1]
    if not (continue_final and isinstance(last, dict) and last.get("role") == "assistant"):
        ids.append(_OPEN_REPLY_ID)
    return ids


def encode_prompt(prompt: object) -> list[int]:
    """Token ids of a completions ``prompt``: a string, or a list of token ids.

    Raises:
        PromptError: a batch of prompts (list of strings or of lists), ids out of range, or
            another type.
    """
    if isinstance(prompt, str):
        return encode(prompt)
    if isinstance(prompt, list):
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return encode_prompt(prompt[0])
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < VOCAB_SIZE]
            if bad:
                raise PromptError(f"prompt: token id {bad[0]} is out of range 0..{VOCAB_SIZE - 1}")
            return list(prompt)
        raise PromptError("prompt: batched prompts are not supported by the simulator; send one request per prompt")
    raise PromptError("prompt: must be a string or a list of token ids")


def filler_token_ids(seed: int, prompt_ids: Sequence[int], n: int) -> list[int]:
    """``n`` output token ids, a function of ``seed`` and the prompt only."""
    rng = random.Random(hash((seed, tuple(prompt_ids))))
    return [_RESERVED + rng.randrange(len(FILLER_WORDS)) for _ in range(n)]


def token_text(token: int) -> str:
    """The text of an output token id (``" " + word``)."""
    i = token - _RESERVED
    if 0 <= i < len(FILLER_WORDS):
        return " " + FILLER_WORDS[i]
    return f" <{token}>"


def eos_length(seed: int, prompt_ids: Sequence[int], mean_tokens: float) -> int:
    """Where an end-of-sequence token falls (>= 1): geometric with mean ``mean_tokens``, a
    function of ``seed`` and the prompt (so reproducible)."""
    p = 1.0 / max(1.0, mean_tokens)
    if p >= 1.0:
        return 1
    u = random.Random(hash((seed, tuple(prompt_ids), 1))).random()
    return 1 + int(math.log1p(-u) / math.log1p(-p))
