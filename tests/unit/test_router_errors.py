"""Errors in OpenAI's format: engine errors of every shape vLLM (and its HTTP stack) sends are
relayed as `{"error": {"message", "type", "param", "code"}}` with the status kept, and error
events inside an SSE stream too (router.protocol.errors); nesting-depth checks of JSON text
(router.protocol.jsonlimit)."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from router.protocol.errors import MAX_MESSAGE_CHARS, error_body, relayed_error, relayed_stream_errors
from router.protocol.jsonlimit import JsonTooDeep, depth_exceeds, loads_bounded


def fields(raw: bytes) -> dict[str, Any]:
    doc = json.loads(raw)
    assert list(doc) == ["error"] and set(doc["error"]) == {"message", "type", "param", "code"}
    return doc["error"]  # type: ignore[no-any-return]


VLLM_CONTEXT = ("This model's maximum context length is 512 tokens. However, you requested 1210 tokens "
                "(1200 in the messages, 10 in the completion). Please reduce the length of the messages or "
                "completion.")  # fmt: skip


@pytest.mark.parametrize(("status", "body", "content_type", "expected"), [
    # vLLM's ErrorResponse: numeric code, class-name type.
    (400, {"error": {"message": "bad n", "type": "BadRequestError", "param": "n", "code": 400}}, "application/json",
     {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": "bad_request"}),
    (400, {"error": {"message": VLLM_CONTEXT, "type": "BadRequestError", "param": None, "code": 400}},
     "application/json",
     {"message": VLLM_CONTEXT, "type": "invalid_request_error", "param": None, "code": "context_length_exceeded"}),
    (404, {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model",
                     "code": 404}}, "application/json",
     {"message": "The model `x` does not exist.", "type": "not_found_error", "param": "model",
      "code": "model_not_found"}),
    # vLLM 0.32's other classes (create_error_response in
    # vllm/entrypoints/serve/exception_handling/error_response.py): the type follows the status.
    (422, {"error": {"message": "guided_json is not a valid schema", "type": "UnprocessableEntityError",
                     "param": "guided_json", "code": 422}}, "application/json",
     {"message": "guided_json is not a valid schema", "type": "invalid_request_error", "param": "guided_json",
      "code": "invalid_request"}),
    (503, {"error": {"message": "request aborted, retry", "type": "ServiceUnavailableError", "param": None,
                     "code": 503}}, "application/json",
     {"message": "request aborted, retry", "type": "server_error", "param": None, "code": "service_unavailable"}),
    (501, {"error": {"message": "beam search is not supported", "type": "NotImplementedError", "param": None,
                     "code": 501}}, "application/json",
     {"message": "beam search is not supported", "type": "server_error", "param": None, "code": "not_implemented"}),
    # FastAPI's own validation answer.
    (422, {"detail": [{"type": "missing", "loc": ["body", "model"], "msg": "Field required", "input": {}}]},
     "application/json",
     {"message": "body.model: Field required", "type": "invalid_request_error", "param": None,
      "code": "invalid_request"}),
    # vLLM's HTTPException handler: the status phrase as the type.
    (405, {"error": {"message": "Method Not Allowed", "type": "Method Not Allowed", "param": None, "code": 405}},
     "application/json",
     {"message": "Method Not Allowed", "type": "invalid_request_error", "param": None, "code": "method_not_allowed"}),
    # Older vLLM: the fields at the top level.
    (500, {"object": "error", "message": "engine died", "type": "InternalServerError", "param": None, "code": 500},
     "application/json", {"message": "engine died", "type": "server_error", "param": None, "code": "internal_error"}),
    # vLLM's --api-key middleware.
    (401, {"error": "Unauthorized"}, "application/json",
     {"message": "Unauthorized", "type": "authentication_error", "param": None, "code": "unauthorized"}),
    # Plain text: uvicorn, Starlette, aiohttp.
    (400, b"Invalid HTTP request received.", "text/plain",
     {"message": "Invalid HTTP request received.", "type": "invalid_request_error", "param": None,
      "code": "bad_request"}),
    (500, b"Internal Server Error", "text/plain; charset=utf-8",
     {"message": "Internal Server Error", "type": "server_error", "param": None, "code": "internal_error"}),
    (413, b"Maximum request body size 1048576 exceeded", None,
     {"message": "Maximum request body size 1048576 exceeded", "type": "invalid_request_error", "param": None,
      "code": "request_too_large"}),
    # Already OpenAI's: unchanged.
    (429, {"error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}},
     "application/json",
     {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}),
    # JSON that is no error document, an empty body, bytes that are not UTF-8.
    (502, {"choices": []}, "application/json",
     {"message": "engine answered HTTP 502", "type": "server_error", "param": None, "code": "bad_gateway"}),
    (503, b"", None, {"message": "engine answered HTTP 503", "type": "server_error", "param": None,
                      "code": "service_unavailable"}),
    (418, b"\xff\xfe", "text/plain", {"message": "\ufffd\ufffd", "type": "invalid_request_error", "param": None,
                                      "code": None}),
])  # fmt: skip
def test_engine_errors_are_relayed_in_openai_format(status: int, body: Any, content_type: str | None,
                                                    expected: dict[str, Any]) -> None:  # fmt: skip
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert fields(relayed_error(status, raw, content_type)) == expected


def test_a_long_or_deep_engine_error_is_cut_and_never_raises() -> None:
    message = fields(relayed_error(400, json.dumps({"error": {"message": "x" * 100_000, "code": 400}}).encode()))
    assert len(message["message"]) < MAX_MESSAGE_CHARS + 50 and "100000 characters" in message["message"]
    deep = b"[" * 50_000 + b"]" * 50_000
    assert fields(relayed_error(500, deep, "application/json"))["type"] == "server_error"


def test_error_events_in_a_stream_are_rewritten_and_others_left_alone() -> None:
    vllm = {"error": {"message": "engine failed", "type": "InternalServerError", "param": None, "code": 500}}
    token = b'data: {"choices":[{"text":"an \\"error\\" word","finish_reason":"error"}]}\n\n'
    stream = token + b"data: " + json.dumps(vllm).encode() + b"\n\ndata: [DONE]\n\n"
    out = relayed_stream_errors(stream)
    events = out.split(b"\n\n")
    assert events[0] + b"\n\n" == token and events[2] == b"data: [DONE]"
    assert fields(events[1].removeprefix(b"data: ")) == {"message": "engine failed", "type": "server_error",
                                                         "param": None, "code": "internal_error"}  # fmt: skip
    crlf = b"data: " + json.dumps({"error": {"message": "bad", "code": 400}}).encode() + b"\r\n\r\n"
    rewritten = relayed_stream_errors(crlf)
    assert rewritten.endswith(b"\r\n\r\n") and fields(rewritten[6:-4])["type"] == "invalid_request_error"
    router_own = b"data: " + error_body("cut", type_="server_error", code="upstream_interrupted") + b"\n\n"
    assert relayed_stream_errors(router_own) == router_own
    assert relayed_stream_errors(b'data: {"error": not json}\n\n') == b'data: {"error": not json}\n\n'


# --- nesting depth -------------------------------------------------------------------------


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    return 0


def _random_doc(rng: random.Random, levels: int) -> Any:
    if levels == 0:
        return rng.choice([1, None, "", "a[{", '\\"[', "]}", "x\n\\", '"'])
    if rng.random() < 0.5:
        return [_random_doc(rng, levels - 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(["", "k", 'k"[', "]", "\\"]) + str(i): _random_doc(rng, levels - 1)
            for i in range(rng.randint(0, 3))}  # fmt: skip


def test_depth_is_measured_like_the_parsed_document_brackets_in_strings_ignored() -> None:
    rng = random.Random(22)
    for _ in range(2000):
        doc = _random_doc(rng, rng.randint(0, 8))
        text = json.dumps(doc).encode()
        depth = _depth(doc)
        for limit in range(10):
            assert depth_exceeds(text, limit) == (depth > limit), (text, limit)


def test_loads_bounded_refuses_a_deep_document_before_parsing_it() -> None:
    assert loads_bounded(b'{"endpoints": [{"id": "a"}]}', 3) == {"endpoints": [{"id": "a"}]}
    for deep in (b"[" * 50_000 + b"]" * 50_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"[" * 8_000_000):
        with pytest.raises(JsonTooDeep, match="deeper than 16 levels"):
            loads_bounded(deep, 16)
    with pytest.raises(ValueError):
        loads_bounded(b"{not json", 16)
