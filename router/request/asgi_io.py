"""The client side of the request path: ASGI message I/O and the cheap checks of a request.

Owns what `router.request.proxy.Proxy`, `router.request.parse` and `router.http.app` do with the
client's connection before and after routing: the ASGI types, `read_body` (bounded; `BodyTooLarge`),
`send_json`, `check_request` / `parse_request` (the JSON checks routing needs, errors in OpenAI's
shape: `router.protocol.errors.error_body`), `reflect` (what an error may echo of client input) and
`ClientWatch` (cancels a request whose client went away). No routing, no upstream I/O. Hot path:
keep it cheap (docs/benchmarks.md, "The router against `vllm-router`").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from router.protocol.errors import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

PROXIED_PATHS: dict[str, str] = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}
"""Paths the proxy serves (POST only), and the body field each one requires."""

MAX_REFLECTED_CHARS = 256
"""Most characters of a client-supplied value (a model name) echoed back in an error message."""


def reflect(value: str, limit: int = MAX_REFLECTED_CHARS) -> str:
    """`repr(value)` cut to about `limit` characters, saying how long the value was: what an error
    message may echo of client input."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


CLOSE = [(b"connection", b"close")]
"""Response header that makes the server close the connection after the response (a request
whose body was not read, or not in time, must not leave its connection usable)."""


async def send_json(send: Send, status: int, body: bytes,
                    extra_headers: list[tuple[bytes, bytes]] | None = None) -> None:  # fmt: skip
    """Send a complete JSON response through ASGI `send`."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if extra_headers:
        headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class BodyTooLarge(Exception):
    """A request body longer than the caller's limit (raised by `read_body`)."""


async def read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The whole request body from ASGI `receive`; None if the client disconnected first.

    Raises `BodyTooLarge` as soon as more than `max_bytes` arrived. Does not time out: the
    server bounds the time (`router.http.server.RequestGuardProtocol`)."""
    message = await receive()
    if message["type"] == "http.disconnect":
        return None
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):  # the usual case: the whole body in one message
        if len(body) > max_bytes:
            raise BodyTooLarge
        return body
    chunks = [body]
    size = len(body)
    if size > max_bytes:
        raise BodyTooLarge
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        if chunk:
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise BodyTooLarge
        if not message.get("more_body", False):
            return b"".join(chunks)


def check_request(body: bytes, path: str) -> tuple[str, None] | tuple[None, bytes]:
    """Validate a completion request body; return `(model, None)` or `(None, error_body)`.

    Checks only what routing needs and what is cheap: a JSON object, a non-empty string
    `model`, and `prompt` (completions) or a list `messages` (chat). The engine validates
    the rest.
    """
    model, _, problem = parse_request(body, path)
    return (model, None) if model is not None else (None, problem)  # type: ignore[return-value]


def parse_request(body: bytes, path: str) -> tuple[str | None, dict | None, bytes | None]:
    """`check_request`, also returning the parsed body: `(model, doc, None)` or
    `(None, None, error_body)`."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return None, None, error_body(f"request body is not valid JSON: {exc}", code="invalid_json")
    if not isinstance(data, dict):
        return None, None, error_body("request body must be a JSON object", code="invalid_json")
    model = data.get("model")
    if model is None:
        return None, None, error_body("you must provide a model parameter", param="model",
                                      code="missing_required_parameter")  # fmt: skip
    if not isinstance(model, str) or not model:
        return None, None, error_body("model must be a non-empty string", param="model", code="invalid_type")
    field = PROXIED_PATHS[path]
    value = data.get(field)
    if value is None:
        return None, None, error_body(f"you must provide a {field} parameter", param=field,
                                      code="missing_required_parameter")  # fmt: skip
    if field == "messages" and not isinstance(value, list):
        return None, None, error_body("messages must be a list", param="messages", code="invalid_type")
    return model, data, None


DISCONNECT_WATCH_DELAY_S = 0.05
"""A request still running after this many seconds starts watching for a client
disconnect. Requests answered sooner (most non-streamed ones through a fast engine) never
pay for the watcher task: started for every request it cost tens of microseconds of CPU
per request, a large share of the router's own overhead (loadtests/bench_proxy_hop.py)."""


class ClientWatch:
    """Cancels the request task when the client disconnects before the response is done.

    ASGI servers report a disconnect only through `receive()`, and uvicorn's `send()`
    silently drops data for a gone client, so without this the proxy would keep the
    engine generating for nobody. The watching task starts only after `delay_s`; a
    disconnect before then is seen when it starts. Set `finishing` before the final `send`.
    """

    __slots__ = ("gone", "finishing", "_owner", "_receive", "_timer", "_task")

    def __init__(self, receive: Receive, delay_s: float) -> None:
        self.gone = False
        self.finishing = False
        owner = asyncio.current_task()
        assert owner is not None  # always inside the ASGI request task
        self._owner = owner
        self._receive = receive
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(delay_s, self._start)

    def _start(self) -> None:
        self._timer = None
        if not self.finishing:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.finishing:
            self.gone = True
            self._owner.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
