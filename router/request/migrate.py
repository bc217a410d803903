"""Request migration: a stream whose engine failed mid-way goes on from another endpoint.

Owns `blocker` (why a request cannot be migrated, or None), `Tape` (what a stream relayed so far,
kept for a continuation), `Continuation` (the body that asks another endpoint to go on, and the
rewrite of its events into the client's stream) and the reasons counted in
`fleet_router_migrations_total` and `fleet_router_unmigrated_streams_total`. Called by
`router.request.proxy` (step 7) and `router.request.relay` (the tape, the rewrite). Pure: no I/O,
no clock.

What is re-sent. NVIDIA Dynamo's migration (its `Migrator`, `--migration-limit`) re-sends the
prompt's token ids plus the token ids generated so far. A router in front of vLLM's OpenAI server
sees text, not ids: vLLM sends ids only when a request asks for them (`return_token_ids`:
"token_ids contains the delta tokens for each chunk", vLLM 0.32's
vllm/entrypoints/openai/chat_completion/protocol.py), which would change every request's body and
answer on the hot path, and a tokenizer round trip of the streamed text does not give back the
ids the engine sampled. So a continuation re-sends text, in the form vLLM's OpenAI server takes
to go on from a partial answer:

- `/v1/completions` with a text prompt: the prompt is `prompt + text streamed so far`
  (vLLM tokenizes the whole string; OpenAI's and vLLM's `prompt` accepts a string);
- `/v1/chat/completions`: the messages plus an `assistant` message holding the text streamed so
  far, with vLLM's `continue_final_message: true` and `add_generation_prompt: false` (vLLM 0.32's
  `ChatCompletionRequest`, the same file: "the final message in the chat is open-ended, without
  any EOS tokens. The model will continue this message rather than starting a new one"), so the
  chat template renders the reply open, as the failed engine had it.

Both re-tokenize the streamed text: at the seam the ids may differ from the sampled ones (a word
split another way), which moves the next token's distribution slightly; the text the client got
stays as it was. `max_tokens` (or `max_completion_tokens`) becomes what is left, `min_tokens`
likewise; every other sampling parameter is sent unchanged (a `seed` restarts its sequence).

What is not migrated (`blocker`; the stream ends with an OpenAI error event as without migration,
and the reason is logged and counted): `n` or `best_of` above 1 (choices interleave), `logprobs`,
`top_logprobs`, `echo`, `prompt_logprobs` (the continuation's would start over), `suffix`,
`tools` and structured output (`response_format`, `guided_*`, `structured_outputs`: a tool call
or a grammar cannot resume from text), a prompt that is not one string (token ids, a batch),
and a stream whose relayed events pass `MAX_TAPE_BYTES` (Dynamo's `--migration-max-seq-len`
bounds the same memory). A non-streamed request is never migrated: nothing reached its client,
so a failed attempt is retried whole (`router.request.proxy`, step 7).

The continuation's events are rewritten into the client's stream (`Continuation.rewrite`): its
`id` and `created` become the first attempt's, chat's opening role event is dropped, and the
usage chunk counts the tokens streamed before the seam as completion tokens, not prompt tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_TAPE_BYTES = 4 * 1024 * 1024
"""Most bytes of relayed events kept per stream for a continuation (about 20,000 vLLM token
events); a longer stream is no longer migrated."""

MIGRATION_REASONS = ("interrupted", "stalled")
"""`reason` of `fleet_router_migrations_total`: the engine broke the stream (connection reset,
process gone), or the stream guard cut it (silent, too slow: `router.request.relay.StreamGuard`)."""

UNMIGRATED_REASONS = ("n", "logprobs", "echo", "suffix", "tools", "structured_output", "prompt_not_text",
                      "too_long", "limit", "duration", "no_endpoint", "nothing_left")  # fmt: skip
"""`reason` of `fleet_router_unmigrated_streams_total`: the request's field that rules it out
(module docstring), its tape past `MAX_TAPE_BYTES`, its `migration_limit` spent, its
`max_stream_duration_s` over (`router.pools.upstream`), no other ready endpoint of its revision,
or no tokens left to generate."""

_LOGPROB_FIELDS = ("logprobs", "top_logprobs", "prompt_logprobs")
_STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                      "structured_outputs")  # fmt: skip
_ID = re.compile(rb'"id"\s*:\s*"([^"\\]*)"')
_CREATED = re.compile(rb'"created"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'("prompt_tokens"\s*:\s*)(\d+)')
_COMPLETION_TOKENS = re.compile(rb'("completion_tokens"\s*:\s*)(\d+)')
_ROLE_ONLY = re.compile(rb'"delta"\s*:\s*\{\s*"role"\s*:\s*"assistant"\s*(,\s*"content"\s*:\s*"")?\s*\}')


def blocker(doc: dict[str, Any], chat: bool) -> str | None:
    """Why the streamed request `doc` (its parsed body; `chat`: a chat completion) cannot be
    migrated, as a reason of `UNMIGRATED_REASONS`; None when it can."""
    for name in ("n", "best_of"):
        value = doc.get(name)
        if value is not None and value != 1:
            return "n"
    if any(doc.get(name) not in (None, False) for name in _LOGPROB_FIELDS):
        return "logprobs"
    if doc.get("echo"):
        return "echo"
    if doc.get("suffix"):
        return "suffix"
    if doc.get("tools"):
        return "tools"
    if any(doc.get(name) is not None for name in _STRUCTURED_FIELDS):
        return "structured_output"
    if not chat and not isinstance(doc.get("prompt"), str):
        return "prompt_not_text"
    return None


class Tape:
    """The events relayed to the client so far (whole SSE events, as sent), kept until the stream
    ends: `add` one relayed piece; `full` once past `MAX_TAPE_BYTES` (then nothing more is kept)."""

    __slots__ = ("pieces", "size", "full")

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.size = 0
        self.full = False

    def add(self, events: bytes) -> None:
        if self.full:
            return
        self.size += len(events)
        if self.size > MAX_TAPE_BYTES:
            self.full = True
            self.pieces.clear()
            return
        self.pieces.append(events)

    def documents(self) -> list[dict[str, Any]]:
        """The JSON documents of the taped `data:` events (`[DONE]` and others skipped)."""
        docs = []
        for line in b"".join(self.pieces).split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                doc = json.loads(line[5:])
            except ValueError:
                continue
            if isinstance(doc, dict):
                docs.append(doc)
        return docs


def streamed_text(docs: list[dict[str, Any]], chat: bool) -> str:
    """The text the client got in the event documents `docs` (choice 0's `text`, or chat's
    `delta.content`), in order."""
    parts: list[str] = []
    for doc in docs:
        choices = doc.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            continue
        choice = choices[0]
        piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
        if isinstance(piece, str):
            parts.append(piece)
    return "".join(parts)


class Continuation:
    """A migrated stream's next attempt: `body` (the JSON to post to the same path of another
    endpoint), and `rewrite` for its events. Built by `of`; `generated` is the tokens streamed
    before the seam, over every attempt so far; `resumed_at` (loop-clock seconds) when its first
    event arrived (set by `router.request.relay.Relay.stream`; None before)."""

    __slots__ = ("body", "generated", "resumed_at", "_first_id", "_first_created", "_new_id", "_new_created")

    def __init__(self, body: bytes, generated: int, first_id: bytes | None, first_created: bytes | None) -> None:
        self.body = body
        self.generated = generated
        self.resumed_at: float | None = None
        self._first_id = first_id
        self._first_created = first_created
        self._new_id: bytes | None = None
        self._new_created: bytes | None = None

    @classmethod
    def of(cls, doc: dict[str, Any], chat: bool, tape: Tape, generated: int,
           max_tokens: int | None) -> Continuation | str:  # fmt: skip
        """The continuation of the request `doc` after `generated` tokens (every attempt's; the
        text is the `tape`'s), or the reason of `UNMIGRATED_REASONS` it cannot have one
        (`too_long`, `nothing_left`). `max_tokens`: the request's own (None: unset)."""
        if tape.full:
            return "too_long"
        if max_tokens is not None and max_tokens - generated <= 0:
            return "nothing_left"
        docs = tape.documents()
        text = streamed_text(docs, chat)
        body = dict(doc)
        if chat:
            body["messages"] = [*doc["messages"], {"role": "assistant", "content": text}]
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        else:
            body["prompt"] = doc["prompt"] + text
        if max_tokens is not None:
            for name in ("max_tokens", "max_completion_tokens"):
                if name in body:
                    body[name] = max_tokens - generated
        min_tokens = doc.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > 0:
            body["min_tokens"] = max(0, min_tokens - generated)
        first_id = first_created = None
        for event in docs:
            if isinstance(event.get("id"), str) and first_id is None:
                first_id = event["id"].encode()
            if isinstance(event.get("created"), int) and first_created is None:
                first_created = str(event["created"]).encode()
        return cls(json.dumps(body).encode(), generated, first_id, first_created)

    def rewrite(self, events: bytes) -> bytes:
        """Whole SSE events of the continuation as the client's stream goes on: the first
        attempt's `id` and `created`, no chat role event, usage counted from the first attempt
        (module docstring)."""
        if self._new_id is None and self._first_id is not None:
            found = _ID.search(events)
            if found:
                self._new_id = b'"' + found.group(1) + b'"'
        if self._new_created is None and self._first_created is not None:
            found = _CREATED.search(events)
            if found:
                self._new_created = found.group(0)
        if self._new_id is not None and self._first_id is not None:
            events = events.replace(self._new_id, b'"' + self._first_id + b'"')
        if self._new_created is not None and self._first_created is not None:
            events = events.replace(self._new_created, b'"created":' + self._first_created)
        if b'"role"' in events:
            kept = [e for e in events.split(b"\n\n") if e.strip() and not _ROLE_ONLY.search(e)]
            events = b"".join(e + b"\n\n" for e in kept)
        if b'"completion_tokens"' in events and self.generated:
            generated = self.generated
            events = _COMPLETION_TOKENS.sub(lambda m: m.group(1) + str(int(m.group(2)) + generated).encode(), events)
            events = _PROMPT_TOKENS.sub(lambda m: m.group(1) + str(max(0, int(m.group(2)) - generated)).encode(),
                                        events)  # fmt: skip
        return events
