"""vLLM's OpenAI request side as the engine SIMULATOR checks it: errors and what a request may ask.

Owns `ApiError` (vLLM's error document), `http_errors_as_json` (aiohttp's own errors in that
shape), `read_body` (the JSON body and its ``model``) and `output_limits` (``max_tokens`` and
``min_tokens`` against the context length, with vLLM's messages). Called by
`fleet.enginesim.server` (`SimReplica`'s handlers); pure apart from reading the request body.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from aiohttp import web


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self, kind: str | None = None) -> web.Response:
        """vLLM's error document (`ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`,
        `code` the numeric status); `kind` overrides the `type` derived from the status."""
        kind = kind or {400: "BadRequestError", 404: "NotFoundError"}.get(self.status, "InternalServerError")
        return web.json_response(
            {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}},
            status=self.status,
        )


@web.middleware
async def http_errors_as_json(request: web.Request, handler: Callable) -> web.StreamResponse:
    """aiohttp's own errors (a body over `client_max_size`: 413; unknown path 404; 405) in vLLM's
    JSON shape, as vLLM's `http_exception_handler` answers FastAPI's: `type` the status' phrase,
    `code` the status (aiohttp's are `text/plain`)."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text if exc.text and not exc.text.startswith(f"{exc.status}:") else exc.reason
        return ApiError(exc.status, message or exc.reason).response(HTTPStatus(exc.status).phrase)


async def read_body(request: web.Request, served_model_name: str) -> dict[str, Any]:
    """The request's JSON object. Raises `ApiError` 400 (not JSON, not an object) or 404 (a
    ``model`` other than ``served_model_name``, vLLM's message)."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model_name:
        raise ApiError(404, (f"The model `{model}` does not exist. Valid aliases: "
                             f"{served_model_name}."), "model")  # fmt: skip
    return body


def output_limits(prompt_ids: list[int], body: dict[str, Any], max_model_len: int,
                  default_max_tokens: int | None) -> tuple[int, int]:  # fmt: skip
    """``(max_tokens, min_tokens)`` of a request with a prompt of ``prompt_ids`` tokens.

    ``max_completion_tokens`` wins over ``max_tokens``, else ``default_max_tokens`` (16 for
    completions, as vLLM), else what the context has left. Raises `ApiError` 400 naming the
    field, with vLLM's messages: empty prompt, prompt or prompt + output over ``max_model_len``,
    ``max_tokens`` not an int >= 1, ``n`` other than 1, ``min_tokens`` outside 0..max_tokens.
    """
    if not prompt_ids:
        raise ApiError(400, "The prompt is empty; send at least one token.", "prompt")
    if len(prompt_ids) >= max_model_len:
        raise ApiError(400, (
            f"This model's maximum context length is {max_model_len} tokens. However, your request has "
            f"{len(prompt_ids)} input tokens. Please reduce the length of the input messages."), "input_tokens")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", default_max_tokens))
    if max_tokens is None:
        max_tokens = max_model_len - len(prompt_ids)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ApiError(400, f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if max_tokens > max_model_len:
        raise ApiError(400, (
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. "
            f"Please request fewer output tokens. (parameter=max_tokens, value={max_tokens})"), "max_tokens")
    if len(prompt_ids) + max_tokens > max_model_len:
        raise ApiError(400, (
            f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
            f"context length is {max_model_len} tokens and your request has {len(prompt_ids)} input "
            f"tokens ({max_tokens} > {max_model_len} - {len(prompt_ids)})."), "max_tokens")
    n = body.get("n", 1)
    if n != 1:
        raise ApiError(400, "the simulator supports n=1 only", "n")
    min_tokens = body.get("min_tokens", 0) or 0
    if not isinstance(min_tokens, int) or min_tokens < 0 or min_tokens > max_tokens:
        raise ApiError(400, f"min_tokens must be an integer in 0..max_tokens, got {min_tokens!r}", "min_tokens")
    return max_tokens, min_tokens
