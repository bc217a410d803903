"""The router's view of a streamed (SSE) completion: whole events only, and when tokens arrived.

Owns `SseRelay`, one per streamed response with `Content-Type: text/event-stream`, made by
`router.request.attempt.Attempts`. `router.request.relay.Relay` feeds it each chunk read from the
engine and relays what `feed` returns: every complete event, holding back a trailing partial one
until its end arrives. Because the client never holds half an event, a stream the engine cuts off
can still end with a well-formed error event (`stream_error_tail` in `router.request.relay`) that
OpenAI clients raise as an error, instead of a truncated body.

While relaying it notes, on the router clock, when the first and the last event carrying
generated text arrived and how many such events there were, and reads `usage.completion_tokens`
(and `prompt_tokens`, for the token counters of `router.protocol.tokens`) when the stream carries a usage
chunk (`stream_options.include_usage`). `router.request.attempt` turns that
into the time to first token and the time per output token:

    TPOT = (last token event's arrival - first token event's arrival) / (output tokens - 1)

Approximations (documented in the metric's help): output tokens are `usage.completion_tokens`
when present, else the number of events carrying text, which is exact for vLLM's default of one
event per token and undercounts when an engine batches tokens per event (`--stream-interval`,
speculative decoding); arrival times are those of the router's reads, so events that reach the
router in one read share a time, and a stream whose tokens all arrived in one read yields no
TPOT sample (its spread is not measurable here).

An event "carries generated text" when it has a non-empty `text` (completions), `content`,
`reasoning_content` or `reasoning` string (chat), or a `tool_calls` entry. The check is a
byte-level regular expression, not a JSON parse: in JSON text a key can only appear unescaped as
a key, so `"text":"x` cannot come from inside a string value. Chat's first event (the role, with
empty content) and the usage chunk do not count. Events are separated by a blank line (LF LF, or
CR LF CR LF); a stream using another separator is relayed as it comes once `MAX_PENDING_BYTES`
pile up, without the clean error ending. An engine's error event (`data: {"error": ...}`, vLLM's
with a numeric `code`) is relayed in OpenAI's shape (`router.protocol.errors.relayed_stream_errors`)
and counted in `error_events`: an engine that answers 200 and then reports a failure inside the
stream has failed the attempt (`router.request.attempt` counts it for outlier ejection).
Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import re

from router.protocol.errors import has_stream_error, relayed_stream_errors

MAX_PENDING_BYTES = 1024 * 1024
"""Most bytes held back waiting for the end of one event; beyond that they are relayed as they
are (an event this long, or a stream without blank-line separators) and the stream loses its
guarantee of ending on an event boundary."""

_TOKEN_EVENT = re.compile(
    rb'"(?:text|content|reasoning_content|reasoning)"\s*:\s*"[^"]|"tool_calls"\s*:\s*\[\s*\{'
)
# The usage object's counts (OpenAI's keys), read by byte pattern here and in `router.protocol.tokens`.
USAGE_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
USAGE_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
USAGE_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')   # prompt_tokens_details
_find_tokens = _TOKEN_EVENT.findall


class SseRelay:
    """Event-boundary relay and token clock of one SSE stream (see the module docstring).

    Attributes: `first_token_s` / `last_token_s` (router-clock seconds of the first and last
    read that brought a text-carrying event; None before one), `token_events` (events carrying
    text), `usage_tokens` (the last `usage.completion_tokens` seen; None without a usage chunk),
    `usage_prompt_tokens` (its `usage.prompt_tokens`, for `router.protocol.tokens`), `usage_cached_tokens`
    (its `usage.prompt_tokens_details.cached_tokens`: vLLM's ``--enable-prompt-tokens-details``;
    None without it), `error_events` (reads that brought an engine's error event), `aligned` (True while
    everything relayed so far ended on an event boundary).
    """

    __slots__ = ("_pending", "first_token_s", "last_token_s", "token_events", "usage_tokens", "usage_prompt_tokens",
                 "usage_cached_tokens", "error_events", "aligned")  # fmt: skip

    def __init__(self) -> None:
        self._pending = b""
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.token_events = 0
        self.usage_tokens: int | None = None
        self.usage_prompt_tokens: int | None = None
        self.usage_cached_tokens: int | None = None
        self.error_events = 0
        self.aligned = True

    def feed(self, chunk: bytes, now_s: float) -> bytes:
        """Take one chunk read at `now_s`; return the bytes to relay now (complete events, possibly
        empty), keeping a trailing partial event back."""
        if not self._pending and chunk.endswith(b"\n\n"):  # the usual read: whole events
            self.aligned = True
            self._count(chunk, now_s)
            return self._errors(chunk) if b'"error"' in chunk else chunk
        data = self._pending + chunk if self._pending else chunk
        cut = data.rfind(b"\n\n")
        if cut >= 0:
            cut += 2
        else:
            cut = data.rfind(b"\r\n\r\n")
            if cut >= 0:
                cut += 4
            elif len(data) <= MAX_PENDING_BYTES:
                self._pending = data
                return b""
        if cut < 0 or len(data) - cut > MAX_PENDING_BYTES:  # no boundary in sight: relay as is
            self._pending = b""
            self.aligned = False
            self._count(data, now_s)
            return data
        if cut == len(data):
            ready, self._pending = data, b""
        else:
            ready, self._pending = data[:cut], data[cut:]
        self.aligned = True
        self._count(ready, now_s)
        return self._errors(ready) if b'"error"' in ready else ready

    def _errors(self, events: bytes) -> bytes:
        """`events` with error events rewritten in OpenAI's shape, counted in `error_events`."""
        if has_stream_error(events):
            self.error_events += 1
        return relayed_stream_errors(events)

    def _count(self, events: bytes, now_s: float) -> None:
        n = len(_find_tokens(events))
        if n:
            if self.first_token_s is None:
                self.first_token_s = now_s
            self.last_token_s = now_s
            self.token_events += n
        if b'"completion_tokens"' in events:
            found = USAGE_COMPLETION_TOKENS.findall(events)
            if found:
                self.usage_tokens = int(found[-1])
                prompt = USAGE_PROMPT_TOKENS.findall(events)
                if prompt:
                    self.usage_prompt_tokens = int(prompt[-1])
                cached = USAGE_CACHED_TOKENS.findall(events)
                if cached:
                    self.usage_cached_tokens = int(cached[-1])

    def rest(self) -> bytes:
        """What is still held back (at the end of a stream that finished cleanly: relay it)."""
        pending, self._pending = self._pending, b""
        return pending

    def output_tokens(self) -> int:
        """Output tokens of the stream: `usage_tokens` if the stream had a usage chunk, else the
        count of text-carrying events."""
        return self.usage_tokens if self.usage_tokens is not None else self.token_events

    def time_per_output_token_s(self) -> float | None:
        """(last - first token arrival) / (output tokens - 1); None with fewer than two tokens
        or when every token arrived in one read."""
        first_s, last_s = self.first_token_s, self.last_token_s
        tokens = self.output_tokens()
        if first_s is None or last_s is None or tokens < 2 or last_s <= first_s:
            return None
        return (last_s - first_s) / (tokens - 1)
