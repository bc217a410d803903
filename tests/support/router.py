"""In-process helpers for tests and benchmarks of the router: real sockets, no mocks.

Owns `running_app` (serve any ASGI app with uvicorn on a free loopback port inside the
current event loop) and `FakeEngine` (an aiohttp.web server that answers
`/v1/completions` and `/v1/chat/completions` like a vLLM OpenAI server, streamed or not).
Called by tests/unit/test_router_*.py and usable by integration tests of the fleet. Their
servers bind loopback ports in this process, which the unit tier's socket guard allows
(tests/support/guards.py).
Not imported by the router itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from router.http.server import ListeningServer, uvicorn_config


@contextlib.asynccontextmanager
async def running_app(app: Any, host: str = "127.0.0.1", **server: Any) -> AsyncIterator[str]:
    """Serve the ASGI `app` with the router's server settings (`router.http.server.uvicorn_config`:
    httptools with the request-head guard, lifespan on) on a free port of `host`; yield its base
    URL (`http://host:port`); shut it down on exit (at most 5 s grace). `server`: further
    arguments of `uvicorn_config` (e.g. `head_timeout_s`)."""
    config = uvicorn_config(app, host, 0, loop="auto", timeout_graceful_shutdown=5, **server)
    bound: asyncio.Future[tuple[str, int]] = asyncio.get_running_loop().create_future()

    def on_listening(bound_host: str, bound_port: int) -> None:
        if not bound.done():
            bound.set_result((bound_host, bound_port))

    server = ListeningServer(config, on_listening)
    task: asyncio.Task[None] = asyncio.create_task(server.serve())
    await asyncio.wait([bound, task], return_when=asyncio.FIRST_COMPLETED)  # type: ignore[type-var]
    if not bound.done():
        await task  # startup failed: surface its exception (uvicorn raises SystemExit)
        raise RuntimeError("uvicorn stopped before listening")
    bound_host, port = bound.result()
    try:
        yield f"http://{bound_host}:{port}"
    finally:
        server.should_exit = True
        await task


def dead_endpoint(host: str = "127.0.0.1") -> tuple[socket.socket, str]:
    """A bound but non-listening socket and its URL: connecting is refused at once, and the
    port stays reserved while the socket is open. Close the socket when done."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    return sock, f"http://{host}:{sock.getsockname()[1]}"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeEngine:
    """A stand-in for a vLLM OpenAI server on a free loopback port.

    Answers POST `/v1/completions` and `/v1/chat/completions`: with `"stream": true` an
    SSE stream of `chunks` events (`event_interval_s` apart) then `data: [DONE]`, otherwise one JSON document with a
    Content-Length. Every body names the engine (`"served_by": name`). `status` forces the
    response status. `handler` replaces the built-in behaviour entirely. Received bodies
    are kept in `requests` (parsed JSON). Use as `async with FakeEngine("a") as engine:`;
    `engine.url` is its base URL.
    """

    def __init__(self, name: str = "engine", *, chunks: int = 3, status: int = 200,
                 handler: Handler | None = None, host: str = "127.0.0.1", event_interval_s: float = 0.0) -> None:  # fmt: skip
        self.name = name
        self.chunks = chunks
        self.event_interval_s = event_interval_s
        self.status = status
        self.requests: list[Any] = []
        self._handler = handler
        self._host = host
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeEngine:
        app = web.Application()
        handler = self._handler or self._answer
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)  # a stuck test fails fast
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, 0))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://{self._host}:{sock.getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        model = body.get("model", "")
        if not body.get("stream"):
            doc = {"id": "cmpl-fake", "object": "text_completion", "model": model, "served_by": self.name,
                   "choices": [{"index": 0, "text": f"hello from {self.name}", "finish_reason": "stop"}]}  # fmt: skip
            return web.json_response(doc, status=self.status)
        resp = web.StreamResponse(status=self.status, headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            event = {"id": "cmpl-fake", "model": model, "served_by": self.name,
                     "choices": [{"index": 0, "text": str(i)}]}  # fmt: skip
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.event_interval_s:
                await asyncio.sleep(self.event_interval_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
