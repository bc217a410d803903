"""The OpenAI response documents of the engine SIMULATOR, as vLLM 0.32 writes them.

Owns `LiveRequest` (a request being served: the queue of what the engine loop delivered for it)
and `ResponseWriter` (a whole JSON response or an SSE stream from that queue: ids, choices,
finish reasons, the usage object, ``system_fingerprint``). Called by `fleet.enginesim.server`
(`SimReplica`'s completion handlers); the engine loop puts ``("token", index)``, ``("done",
FinishedRequest)`` or ``("error", message)`` on a request's queue.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from fleet.enginesim.api import ApiError
from fleet.enginesim.model import FinishedRequest

log = logging.getLogger("fleet.enginesim.responses")


@dataclass(eq=False)
class LiveRequest:
    """A request being served: what the handler waits on."""

    request_id: str
    api_id: str                       # what clients see, random like vLLM's
    output_ids: list[int]
    max_tokens: int
    arrival_s: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    last_token_s: float = 0.0
    client_gone: bool = False         # the client went away mid-stream: not an answered request


@dataclass(frozen=True)
class ResponseWriter:
    """Writes one replica's responses.

    Attributes:
        served_model_name: the ``model`` of every document.
        fingerprint: the ``system_fingerprint`` (says it is the simulator).
        token_text: a token id's text (the simulator's word tokenizer or a real one).
        prompt_tokens_details: the usage object carries ``prompt_tokens_details.cached_tokens``.
    """

    served_model_name: str
    fingerprint: str
    token_text: Callable[[int], str]
    prompt_tokens_details: bool = False

    def head(self, live: LiveRequest, chat: bool) -> dict[str, Any]:
        """The fields every response and chunk of ``live`` opens with (``id``, ``object``, ``created``, ``model``)."""
        return {
            "id": ("chatcmpl-" if chat else "cmpl-") + live.api_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
        }

    def usage(self, prompt_tokens: int, fr: FinishedRequest) -> dict[str, Any]:
        """OpenAI's usage object as vLLM fills it (`UsageInfo`, vllm/entrypoints/openai/protocol.py);
        ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``."""
        completion_tokens = fr.num_output_tokens
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
                                 "completion_tokens": completion_tokens}  # fmt: skip
        if self.prompt_tokens_details:
            usage["prompt_tokens_details"] = {"cached_tokens": fr.num_cached_prompt_tokens}
        return usage

    async def whole(self, live: LiveRequest, prompt_tokens: int, chat: bool) -> web.Response:
        """The one JSON response once ``live`` is done (500 in vLLM's error shape if it failed)."""
        while True:
            kind, payload = await live.events.get()
            if kind == "error":
                return ApiError(500, payload).response()
            if kind == "done":
                fr: FinishedRequest = payload
                break
        text = "".join(self.token_text(t) for t in live.output_ids[:fr.num_output_tokens])
        doc = self.head(live, chat)
        if chat:
            doc["object"] = "chat.completion"
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": fr.finish_reason, "stop_reason": None}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": fr.finish_reason,
                      "stop_reason": None}
        doc.update(choices=[choice], system_fingerprint=self.fingerprint,
                   usage=self.usage(prompt_tokens, fr))
        return web.json_response(doc)

    async def stream(self, request: web.Request, live: LiveRequest, prompt_tokens: int, chat: bool,
                      include_usage: bool) -> web.StreamResponse:  # fmt: skip
        """Stream ``live`` as SSE: a chunk per token as the model emits it, the last with the
        finish reason, the usage chunk with ``include_usage``, then ``[DONE]``. A client that
        went away mid-stream ends it with one debug line (the caller aborts the request in the
        model), as vLLM aborts a disconnected request without a traceback."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        try:
            await self._stream_events(resp, live, prompt_tokens, chat, include_usage)
        except ConnectionResetError as err:   # aiohttp's ClientConnectionResetError: the client is gone
            live.client_gone = True
            log.debug("request %s: the client went away mid-stream (%s)", live.request_id, err)
        return resp

    async def _stream_events(self, resp: web.StreamResponse, live: LiveRequest, prompt_tokens: int, chat: bool,
                             include_usage: bool) -> None:  # fmt: skip
        head = self.head(live, chat)

        async def send(doc: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n")

        # vLLM sends a chat stream's role chunk with its first output, not at once
        # (chat_completion_stream_generator, vLLM 0.32's vllm/entrypoints/openai/chat_completion/serving.py): an engine that
        # stalls before the first token sends nothing but the response head.
        role_sent = not chat
        emitted = 0
        while True:
            kind, payload = await live.events.get()
            if not role_sent and kind != "error":
                role_sent = True
                await send({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})  # fmt: skip
            if kind == "token":
                # The last token is sent with the finish reason, as vLLM does.
                if payload + 1 >= len(live.output_ids):
                    continue
                emitted = payload + 1
                text = self.token_text(live.output_ids[payload])
                await send(self.chunk(head, chat, text, None))
                continue
            if kind == "error":
                await send({"error": {"message": payload, "type": "InternalServerError", "param": None, "code": 500}})
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                return
            fr: FinishedRequest = payload
            break
        if fr.num_output_tokens > emitted:
            text = "".join(self.token_text(t) for t in live.output_ids[emitted:fr.num_output_tokens])
            await send(self.chunk(head, chat, text, fr.finish_reason))
        else:
            await send(self.chunk(head, chat, "", fr.finish_reason))
        if include_usage:
            await send({**head, "choices": [], "usage": self.usage(prompt_tokens, fr),
                        "system_fingerprint": self.fingerprint})  # fmt: skip
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    @staticmethod
    def chunk(head: dict[str, Any], chat: bool, text: str, finish_reason: str | None) -> dict[str, Any]:
        if chat:
            choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return {**head, "choices": [choice]}
