"""Tokens in and out of one answered request, as the router counts them for cost.

Owns `TokenCount` and the two readers the request path calls once per answered (< 400) request:
`body_tokens` for a whole (non-streamed) JSON body (`router.request.relay`) and `stream_tokens` for
an SSE stream (`router.request.attempt`) relayed through `router.protocol.sse.SseRelay`.
`router.stats.endpoint_metrics.EndpointMetrics.count_tokens` adds the result to
`fleet_router_prompt_tokens_total` and `fleet_router_generation_tokens_total` (model, version),
named after vLLM's `vllm:prompt_tokens_total` / `vllm:generation_tokens_total`
(vllm/v1/metrics/loggers.py).

Where the figures come from, in order:

1. The engine's ``usage`` object (OpenAI's ``prompt_tokens`` / ``completion_tokens``): always in a
   non-streamed completion; in a stream only when the client asked for it
   (``stream_options: {"include_usage": true}``: vLLM sends a last chunk with empty ``choices``
   and the usage, vllm/entrypoints/openai/serving_chat.py and serving_completion.py) or the
   engine forces it (vLLM ``--enable-force-include-usage``). Exact.
2. Without a usage chunk, a stream's generated tokens are the count of its events carrying text
   (`SseRelay.token_events`): exact for vLLM's default of one event per token, an undercount when
   the engine batches tokens per event (``--stream-interval``, speculative decoding). Its prompt
   tokens are not counted (the router does not tokenize here), and the response is counted in
   `fleet_router_responses_without_usage_total`, so a dashboard can say how much of the token
   figure is estimated.

The usage's ``prompt_tokens_details.cached_tokens`` (OpenAI's field; vLLM fills it with
``--enable-prompt-tokens-details``: the prompt tokens its prefix cache held) is read too, for
`fleet_router_prefix_cache_hits_total` and the policy's prediction beside it
(`EndpointMetrics.count_tokens`).

A whole body without usage (not an OpenAI completion) counts no tokens, only as without usage.
The usage is read with byte-level regular expressions, not a JSON parse, as in `router.protocol.sse`: in
JSON text ``"prompt_tokens":`` can only appear unescaped as a key. The last match wins (a body
holds one usage object; a stream's last usage chunk is its total). Nothing here does I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from router.protocol.sse import USAGE_CACHED_TOKENS, USAGE_COMPLETION_TOKENS, USAGE_PROMPT_TOKENS, SseRelay


@dataclass(frozen=True, slots=True)
class TokenCount:
    """Tokens of one response. ``prompt``: prompt tokens, None when the response had no usage
    (not counted). ``generated``: output tokens. ``from_usage``: both came from the engine's
    usage object (False: ``generated`` is the stream's text-carrying event count, or 0).
    ``cached``: prompt tokens the engine found in its prefix cache
    (``usage.prompt_tokens_details.cached_tokens``), None when the usage does not say."""

    prompt: int | None
    generated: int
    from_usage: bool
    cached: int | None = None


def _last(pattern: re.Pattern[bytes], data: bytes) -> int | None:
    found = pattern.findall(data)
    return int(found[-1]) if found else None


def body_tokens(body: bytes) -> TokenCount:
    """Tokens of a whole JSON response body (``usage.prompt_tokens`` / ``completion_tokens``;
    an embeddings answer has no ``completion_tokens``: 0 generated)."""
    if b'"prompt_tokens"' not in body:
        return TokenCount(None, 0, False)
    prompt = _last(USAGE_PROMPT_TOKENS, body)
    if prompt is None:
        return TokenCount(None, 0, False)
    cached = _last(USAGE_CACHED_TOKENS, body) if b'"cached_tokens"' in body else None
    return TokenCount(prompt, _last(USAGE_COMPLETION_TOKENS, body) or 0, True, cached)


def stream_tokens(sse: SseRelay) -> TokenCount:
    """Tokens of a relayed SSE stream: its usage chunk when it had one, else the text-carrying
    events as generated tokens and no prompt tokens (module docstring)."""
    if sse.usage_tokens is not None and sse.usage_prompt_tokens is not None:
        return TokenCount(sse.usage_prompt_tokens, sse.usage_tokens, True, sse.usage_cached_tokens)
    return TokenCount(None, sse.output_tokens(), False)
