"""What the router knows about one request before routing it: its prompt's blocks and size.

Owns `RouteRequest` (the request as routing policies see it), `route_request` (built from a
parsed completion or chat body and the request headers, on the request path's hot path) and the two
block hashers, `token_id_block_hashes` and `text_block_hashes`. Called by `router.request.prepare` for
every request and by the trace simulator (`fleet.tracesim.engine`) with the same token-id
prompts it hands the engine models, so both feed `router.pools.policies` the same way.

**Blocks without a tokenizer.** vLLM caches KV in blocks of 16 tokens whose hash chains the
parent block's hash with the block's token ids, so equal block hashes mean equal prefixes
(vllm/v1/core/kv_cache_utils.py, `hash_block_tokens`). The router cannot tokenize, so it
hashes what it has, chained the same way:

* token-id prompts (`"prompt": [ids]`): blocks of `ROUTER_BLOCK_TOKENS` ids, exact;
* text prompts and chat messages: blocks of `TEXT_BLOCK_BYTES` UTF-8 bytes (about
  `ROUTER_BLOCK_TOKENS` tokens at the usual ~4 bytes per token of English text); a chat is
  first serialized as role and content per message, in order, so turn n+1 of a conversation
  (turn n's messages, the reply, a new message) begins with turn n's bytes.

The tokenizer is a deterministic function of the text, so two prompts that share their first
k text blocks share (about) their first k x 64 tokens, and the engine has cached those tokens
wherever the earlier prompt ran: a match of text blocks predicts a KV-cache hit, to within one
block. Only the prediction is approximate; routing needs no more. A router block is 4 of
vLLM's 16-token blocks: hashing is linear in the prompt either way, and 64-token blocks cost a
quarter of the dict work per request and of the index's memory, for a match resolution (64
tokens) far below the prompt lengths where affinity pays (loadtests/bench_prompt_hash.py
measures the cost).

Hashes are 64-bit ints that do not depend on the process (no `PYTHONHASHSEED`): Python's hash
of a tuple of ints is fixed, and text blocks use zlib's CRC-32 and Adler-32, each chained over
the whole prefix. Two routers therefore compute the same hashes for the same prompt.
Pure: no I/O, no clock; never raises on odd input (a body it cannot read gives no blocks).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.kv.exact_index import Claim

ROUTER_BLOCK_TOKENS = 64
"""Token ids per router block (4 of vLLM's default 16-token KV blocks)."""

BYTES_PER_TOKEN = 4
"""Bytes of UTF-8 text per token, the usual estimate for English text with BPE tokenizers
(OpenAI: "one token generally corresponds to ~4 characters of text")."""

TEXT_BLOCK_BYTES = ROUTER_BLOCK_TOKENS * BYTES_PER_TOKEN
"""Bytes of text per router block: about `ROUTER_BLOCK_TOKENS` tokens."""

DEFAULT_OUTPUT_TOKENS = 256
"""Output tokens assumed for a request that sets no `max_tokens` / `max_completion_tokens`."""

SESSION_HEADER = "x-session-id"
"""Request header naming a conversation or agent session (lower case, as ASGI gives headers)."""

MAX_SESSION_KEY_CHARS = 256
"""Longer session keys are cut: a key only has to tell sessions apart."""

_ROOT = 0x5EED_F1EE7


@dataclass(slots=True)
class RouteRequest:
    """One request as the routing policies see it.

    Attributes:
        block_hashes: chained hashes of the prompt's full router blocks, in prompt order (see
            the module docstring); empty when the prompt is shorter than one block.
        prompt_tokens: prompt tokens, exact for token-id prompts, estimated from bytes for text.
        output_tokens: tokens the request may generate (`max_tokens`; else a default).
        session_key: `x-session-id` header, else the OpenAI `user` field; None without either.
        cached_tokens: written by the policy that routed the request: the prompt tokens it
            expects the chosen endpoint to find in its prefix cache (0 if it does not know).
            `prefill_tokens` follows from it; `router.request.attempt` charges that to the
            endpoint's load.
        token_ids: the prompt's token ids as the engine computes them, for matching against the
            engines' KV events: a token-id prompt's ids (the first of a batch), or a text or chat
            prompt tokenized with the pool's own tokenizer (`router.kv.tokenize`, set by
            `router.request.prepare`; `prompt_tokens` is then their count); None when neither is
            known. What the exact index (`router.kv.exact_index.ExactIndex.match`) matches.
        claim: written by `kv-aware`: the blocks it claimed at the chosen endpoint while the
            engine prefills them (`router.kv.exact_index.Claim`; the endpoint picker keeps it with
            the pick, `router.picker.state`); None when nothing was claimed.
    """

    block_hashes: tuple[int, ...] = ()
    prompt_tokens: int = 0
    output_tokens: int = DEFAULT_OUTPUT_TOKENS
    session_key: str | None = None
    cached_tokens: int = 0
    token_ids: Sequence[int] | None = None
    claim: Claim | None = None

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the chosen endpoint is expected to compute (not cached there)."""
        return max(0, self.prompt_tokens - self.cached_tokens)

    def affinity_key(self) -> int | None:
        """What two routers hash to agree on an endpoint without talking: the session key if
        there is one, else the first block's hash (a conversation's first block is the same in
        every turn); None without either. Deterministic across processes."""
        if self.session_key is not None:
            return zlib.crc32(self.session_key.encode("utf-8", "replace")) | 1 << 40
        return self.block_hashes[0] if self.block_hashes else None


def token_id_block_hashes(ids: Sequence[int], block_tokens: int = ROUTER_BLOCK_TOKENS) -> list[int]:
    """Chained hashes of the full `block_tokens`-id blocks of `ids` (a partial tail has none).

    Raises TypeError if `ids` holds something unhashable (callers check the element type)."""
    h = _ROOT
    out = []
    for start in range(0, len(ids) - block_tokens + 1, block_tokens):
        h = hash((h, tuple(ids[start:start + block_tokens])))
        out.append(h)
    return out


def text_block_hashes(data: bytes, block_bytes: int = TEXT_BLOCK_BYTES) -> list[int]:
    """Chained 64-bit hashes (CRC-32 and Adler-32 of the whole prefix) of the full
    `block_bytes`-byte blocks of `data`."""
    view = memoryview(data)
    crc = 0
    adler = 1
    out = []
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        chunk = view[start:start + block_bytes]
        crc = zlib.crc32(chunk, crc)
        adler = zlib.adler32(chunk, adler)
        out.append(crc << 32 | adler)
    return out


def _chat_bytes(messages: list) -> bytes:
    """A chat's messages as bytes, role then content per message, in order. Text parts of a
    multi-part content are taken in order; an image part contributes its URL (equal images
    give equal bytes). Anything else is skipped."""
    parts: list[str] = []
    for message in messages:
        if not isinstance(message, Mapping):
            continue
        role = message.get("role")
        parts.append(f"\x1e{role if isinstance(role, str) else ''}\x1f")
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if not isinstance(part, Mapping):
                    continue
                text = part.get("text")
                if isinstance(text, str):
                    parts.append(text)
                    continue
                image = part.get("image_url")
                url = image.get("url") if isinstance(image, Mapping) else image
                if isinstance(url, str):
                    parts.append(url)
    return "".join(parts).encode("utf-8", "replace")


def _id_hashes(ids: list) -> list[int]:
    """`token_id_block_hashes` of a list that should hold token ids. Elements are not checked
    one by one (a Python loop over every id would cost more than the hashing): whatever is
    hashable hashes, and the engine answers 400 to a prompt that is not token ids; an
    unhashable element (a list, a dict) gives no blocks."""
    try:
        return token_id_block_hashes(ids)
    except TypeError:
        return []


def _count(value: object) -> int:
    return value if type(value) is int and value > 0 else 0


def route_request(doc: Mapping, session_header: str | None = None, hash_blocks: bool = True) -> RouteRequest:
    """The `RouteRequest` of a parsed `/v1/completions` or `/v1/chat/completions` body.

    `doc` is the JSON object (already checked to be one); `session_header` the value of the
    `x-session-id` header, if any. `prompt` may be text, a list of token ids, or a batch (a
    list of texts or of token-id lists: the first gives the blocks, all count as tokens);
    `messages` a chat. Output tokens: `max_completion_tokens`, else `max_tokens`, else
    `DEFAULT_OUTPUT_TOKENS`. ``hash_blocks`` False: no block hashes (the pool's policy does not
    read them; the token counts are still made). `RouteRequest.token_ids` is set for token-id
    prompts only (the list as parsed, not copied or checked element by element); `router.request.prepare`
    fills it for text and chat from the pool's tokenizer. Never raises: a field of an
    unexpected type contributes nothing.
    """
    hashes: list[int] = []
    prompt_tokens = 0
    token_ids = None
    prompt = doc.get("prompt")
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "replace")
        hashes = text_block_hashes(data) if hash_blocks else []
        prompt_tokens = len(data) // BYTES_PER_TOKEN + 1
    elif isinstance(prompt, list) and prompt:
        first = prompt[0]
        if type(first) is int:
            hashes = _id_hashes(prompt) if hash_blocks else []
            prompt_tokens = len(prompt)
            token_ids = prompt
        elif isinstance(first, str):
            hashes = text_block_hashes(first.encode("utf-8", "replace")) if hash_blocks else []
            prompt_tokens = sum(len(p) // BYTES_PER_TOKEN + 1 for p in prompt if isinstance(p, str))
        elif isinstance(first, list):
            hashes = _id_hashes(first) if hash_blocks else []
            prompt_tokens = sum(len(p) for p in prompt if isinstance(p, list))
            token_ids = first
    else:
        messages = doc.get("messages")
        if isinstance(messages, list):
            data = _chat_bytes(messages)
            hashes = text_block_hashes(data) if hash_blocks else []
            prompt_tokens = len(data) // BYTES_PER_TOKEN + 1
    output_tokens = _count(doc.get("max_completion_tokens")) or _count(doc.get("max_tokens")) or DEFAULT_OUTPUT_TOKENS
    session = session_header
    if not session:
        user = doc.get("user")
        session = user if isinstance(user, str) and user else None
    if session is not None:
        session = session[:MAX_SESSION_KEY_CHARS]
    return RouteRequest(tuple(hashes), prompt_tokens, output_tokens, session, token_ids=token_ids)
