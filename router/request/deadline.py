"""The first-token deadline of one attempt: how long the router waits for an engine's first token.

Owns `FirstTokenBudget` (the defaults and the formula) and `first_token_timeout_s`. Called by
`router.request.proxy.Proxy` once per attempt; the trace simulator may call it too. Pure.

What the deadline covers: from dispatching the request to an endpoint until the first body
chunk of a streamed (SSE) answer, which for vLLM is its first token (vLLM's OpenAI server sends
the response head at once and its first event, the chat role chunk included, with the first
generated token: `chat_completion_stream_generator` in vLLM 0.32's
vllm/entrypoints/openai/chat_completion/serving.py);
for a non-streamed answer, until its response head, which vLLM sends when generation is done,
so the deadline of a non-streamed request adds `max_tokens x decode_s_per_token` (and there is
none when the request sets no `max_tokens`: the engine may then generate up to its context).
An attempt past its deadline is given up: `router.request.attempt.Attempts` closes it and counts a
stall against the endpoint (`router.pools.outlier`), and, while nothing was sent to the client,
`router.request.proxy.Proxy` retries elsewhere.

The pool's `first_token_timeout_s` (`router.pools.spec.PoolSpec`, from a deployment's
`routing.firstTokenTimeoutSeconds`) is used as it is when set. Unset, the deadline is the
expected prefill time with a wide margin:

    base_s + (prompt tokens + prefill tokens already queued at the endpoint) / prefill_tokens_per_s

`base_s` (10 s) absorbs the engine's own queue and scheduling, which the router cannot see
(other routers' requests, decodes sharing steps); the queued prefill tokens are the ones this
router sent the endpoint that have no first token yet (`EndpointState.prefill_tokens`).
`prefill_tokens_per_s` (1,000 tokens/s) is a floor, not an estimate: a tenth of the slowest
prefill rate among the engine simulator's measured profiles (fleet/enginesim/profiles.py:
`h100x4-llama-70b`, 102.7 us per prefill token = 9,700 tokens/s, from Lambda Labs'
vllm-benchmark results for Llama 3 70B at TP 4 on H100 SXM with vLLM 0.6.0), and 1/45 of the
CPU build's (`cpu-tiny-llama`, 22.3 us per token, fitted to vLLM 0.32.0 on 2 CPU cores). A real
model on CPU vLLM prefills slower than the tiny one; its contexts are short (examples use
`max_model_len` 1024-4096), so 4,096 tokens add 4 s to the 10 s base: an engine has to be some
50x slower than its profile to be cut off. `decode_s_per_token` (0.2 s) is likewise about ten
times the slowest decode step measured (17.5 ms, the same 70B profile). A pool that knows its
engine better sets `firstTokenTimeoutSeconds`.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_BASE_S = 10.0
"""Seconds of a default first-token deadline before any prefill (see the module docstring)."""
DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
"""Prefill rate (tokens/s) a default deadline assumes: a floor (see the module docstring)."""
DEFAULT_DECODE_S_PER_TOKEN = 0.2
"""Seconds per requested output token added to a non-streamed request's deadline."""


@dataclass(frozen=True)
class FirstTokenBudget:
    """The default deadline's parameters (seconds, tokens/s); ValueError if not positive."""

    base_s: float = DEFAULT_BASE_S
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    decode_s_per_token: float = DEFAULT_DECODE_S_PER_TOKEN

    def __post_init__(self) -> None:
        for name in ("base_s", "prefill_tokens_per_s", "decode_s_per_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


def first_token_timeout_s(pool_timeout_s: float | None, prompt_tokens: int, queued_prefill_tokens: int = 0, *,
                          stream: bool = True, max_tokens: int | None = None,
                          budget: FirstTokenBudget = FirstTokenBudget()) -> float | None:  # fmt: skip
    """Seconds an attempt may wait for its first token (streamed) or its response head (not
    streamed); None: no deadline (a non-streamed request without `max_tokens`).

    `pool_timeout_s`: the pool's `first_token_timeout_s` (None: the default formula of the module
    docstring); `prompt_tokens`: the request's prompt tokens (`RouteRequest.prompt_tokens`);
    `queued_prefill_tokens`: prefill tokens already waiting at the endpoint; `max_tokens`: the
    request's `max_tokens` / `max_completion_tokens` when it sets one (one too large for a float:
    no deadline).
    """
    if pool_timeout_s is not None:
        first_s = pool_timeout_s
    else:
        first_s = budget.base_s + (max(0, prompt_tokens) + max(0, queued_prefill_tokens)) / budget.prefill_tokens_per_s
    if stream:
        return first_s
    if max_tokens is None:
        return None
    try:
        return first_s + max_tokens * budget.decode_s_per_token
    except OverflowError:   # a max_tokens past a float's range (JSON ints are unbounded): no deadline,
        return None         # and the engine answers 400
