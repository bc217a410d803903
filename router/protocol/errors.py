"""Errors in OpenAI's format: the ones the router answers itself and the ones it relays.

Owns `error_body` (the router's own errors: `{"error": {"message", "type", "param", "code"}}`),
`relayed_error` (an engine's error answer rewritten to that shape, its status kept),
`relayed_stream_errors` (the same for error events inside an SSE stream; `has_stream_error` finds
one), and the status-to-type and status-to-code tables both use. Called by the request path (`router.request.refuse`,
`router.request.attempt`, `router.request.relay`, `router.request.asgi_io`), `router.http.app` and
`router.http.server` (errors before the proxy), and `router.protocol.sse` (error events). No I/O.

OpenAI's error document has exactly four fields: `message` (text), `type` (a snake_case class:
`invalid_request_error`, `authentication_error`, `permission_error`, `not_found_error`,
`rate_limit_error`, `server_error`), `param` (the request field at fault, or null) and `code` (a
string such as `model_not_found` or `context_length_exceeded`, or null); the HTTP status says the
rest. What engines send instead, and how each is mapped (status always kept):

- vLLM's `ErrorResponse` (vLLM 0.32: `ErrorResponse` / `ErrorInfo` in
  `vllm/entrypoints/serve/engine/protocol.py`, built by `create_error_response` in
  `vllm/entrypoints/serve/exception_handling/error_response.py`):
  `{"error": {"message", "type": "BadRequestError" | "NotFoundError" | "UnprocessableEntityError" |
  "InternalServerError" | "ServiceUnavailableError" | "NotImplementedError" | "Not Found" (an HTTP
  phrase, for its `GracefulHTTPError`s and `http_exception_handler`) ..., "param", "code": 400}}`;
  older vLLM sends the same fields flat with `"object": "error"`. Type from the status; a numeric code becomes
  `context_length_exceeded` when the message is vLLM's (and OpenAI's) "maximum context length"
  text, `model_not_found` for a 404 about a model, else the status' code (`bad_request`, ...).
- vLLM's `--api-key` middleware: `{"error": "Unauthorized"}` (a string): the string is the message.
- FastAPI's own validation answer `{"detail": [{"loc": [...], "msg": ...}, ...]}` (a route vLLM
  does not wrap) or `{"detail": "text"}`: the details are the message.
- Plain text (uvicorn's "Invalid HTTP request received.", Starlette's "Internal Server Error",
  aiohttp's 413): the text is the message.

Messages are cut to `MAX_MESSAGE_CHARS`.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_MESSAGE_CHARS = 4096
"""Most characters of an engine's error message relayed to the client."""

MAX_ERROR_BODY_BYTES = 1024 * 1024
"""Most bytes of an engine's error body the proxy reads to rewrite it (the rest is dropped)."""

ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
    413: "invalid_request_error", 414: "invalid_request_error", 415: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error",
}  # fmt: skip
"""OpenAI error `type` by HTTP status; any other 4xx is `invalid_request_error`, 5xx `server_error`."""

ERROR_CODES: dict[int, str] = {
    400: "bad_request", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed",
    408: "request_timeout", 409: "conflict", 413: "request_too_large", 414: "uri_too_long",
    415: "unsupported_media_type", 422: "invalid_request", 429: "rate_limit_exceeded",
    431: "request_header_fields_too_large", 500: "internal_error", 501: "not_implemented", 502: "bad_gateway",
    503: "service_unavailable", 504: "gateway_timeout",
}  # fmt: skip
"""Default `code` by HTTP status, when nothing more precise is known."""

_CONTEXT_LENGTH = re.compile(r"maximum context length|context length of|exceeds? the max(imum)? model length", re.I)


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status (`ERROR_TYPES`; 5xx and unknown: `server_error`)."""
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if 400 <= status < 500 else "server_error"


def error_body(message: str, *, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> bytes:  # fmt: skip
    """An OpenAI-style error document: `{"error": {"message", "type", "param", "code"}}`."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _details(value: Any) -> str | None:
    """FastAPI's validation details (`[{"loc": [...], "msg": "..."}, ...]`) as one line, else None."""
    if not isinstance(value, list):
        return None
    parts = []
    for item in value[:20]:
        if isinstance(item, dict) and isinstance(item.get("msg"), str):
            loc = item.get("loc")
            where = ".".join(str(p) for p in loc) if isinstance(loc, list) else ""
            parts.append(f"{where}: {item['msg']}" if where else item["msg"])
    return "; ".join(parts) or None


def _openai_fields(status: int, fields: dict[str, Any]) -> dict[str, Any]:
    """The four OpenAI fields from an engine's error fields (see the module docstring)."""
    message = (_text(fields.get("message")) or _text(fields.get("detail")) or _details(fields.get("detail"))
               or f"engine answered HTTP {status}")  # fmt: skip
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
    type_ = fields.get("type")
    if not (isinstance(type_, str) and type_.islower() and type_.replace("_", "").isalpha()):
        type_ = error_type(status)  # vLLM's "BadRequestError", an HTTP phrase, a number, nothing
    code = fields.get("code")
    if not isinstance(code, str) or not code:
        if status == 400 and _CONTEXT_LENGTH.search(message):
            code = "context_length_exceeded"
        elif status == 404 and "model" in message.lower():
            code = "model_not_found"
        else:
            code = ERROR_CODES.get(status)
    param = fields.get("param")
    return {"message": message, "type": type_, "param": param if isinstance(param, str) else None, "code": code}


def relayed_error(status: int, body: bytes, content_type: str | None = None) -> bytes:
    """An engine's error answer (`status` >= 400, `body` as received) as an OpenAI error
    document, for the router to relay with the same status.

    A body already in OpenAI's shape with a string (or null) code and a snake_case type comes
    out with the same values; anything else is mapped as the module docstring says. Never
    raises: an undecodable body becomes the message text."""
    doc: Any = None
    if content_type is None or "json" in content_type or body[:1] in (b"{", b"["):
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            doc = None
    if isinstance(doc, dict):
        inner = doc.get("error")
        if isinstance(inner, dict):
            fields = inner                      # OpenAI's and vLLM's current shape
        elif isinstance(inner, str):
            fields = {"message": inner}         # vLLM's --api-key middleware
        else:
            fields = doc                        # older vLLM: the fields at the top level
    else:
        text = body.decode("utf-8", "replace").strip()
        fields = {"message": text}
    return json.dumps({"error": _openai_fields(status, fields)}).encode()


_ERROR_EVENT = re.compile(rb'(?m)^data: ?(\{"error"[^\r\n]*)')


def has_stream_error(events: bytes) -> bool:
    """Whether the SSE `events` hold an error event (`data: {"error": ...}`, as vLLM ends a stream
    that failed mid-way)."""
    return _ERROR_EVENT.search(events) is not None


def relayed_stream_errors(events: bytes) -> bytes:
    """Complete SSE events with every `data: {"error": ...}` event rewritten to OpenAI's shape
    (vLLM ends a stream that fails mid-way with such an event, its `code` numeric). The status
    of an error event is its own `code` when numeric, else 500. Events without an error are
    returned as they are; callers check `b'"error"' in events` first (cheap: in JSON text the
    key cannot appear unescaped inside a string)."""

    def rewrite(match: re.Match[bytes]) -> bytes:
        try:
            doc = json.loads(match.group(1))
        except (ValueError, RecursionError):
            return match.group(0)
        inner = doc.get("error") if isinstance(doc, dict) else None
        if not isinstance(inner, (dict, str)):
            return match.group(0)
        fields = inner if isinstance(inner, dict) else {"message": inner}
        code = fields.get("code")
        status = code if isinstance(code, int) and 400 <= code < 600 else 500
        return b"data: " + json.dumps({"error": _openai_fields(status, fields)}).encode()

    return _ERROR_EVENT.sub(rewrite, events)
