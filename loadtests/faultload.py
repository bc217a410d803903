"""Open-loop streamed load for fault injection: one streamed completion every 1/rate s through a
router, whatever the earlier ones are doing, each request classified by *when* it failed.

Owns `FaultLoad` (the generator, run in a thread of its own with its own event loop), `Request`
(one request's record) and `RETRY_BUDGET_S`. Used by the fault-injection suite
(tests/integration/test_control_faults.py); its rows and the table command are in
`loadtests.fault_table` and docs/crash-safety.md.

What a request's outcome means, and why the split matters: a request that failed **before its
stream started** (no `200` status line and headers yet: an HTTP error, a connection reset before
the answer) is one the fleet could have served elsewhere, and the suite asserts there are none;
a **cut** stream (`200` came, then the connection broke or the stream ended without
``data: [DONE]``) had an engine or router die under it while it was being answered, which no
proxy can undo, and is counted apart.

The client retries only what every client may retry safely, as OpenAI's SDKs do
(openai-python ``_should_retry``: connection errors, 408, 409, 429 and 5xx, with
``Retry-After`` honoured), narrowed to what never reached an engine: a **refused connection**
(nothing listens: a router being restarted) and **503 / 429** (the server says "not now", e.g.
a router that has not yet heard from its controller), waiting ``Retry-After`` seconds (capped
at 2 s) or 0.25 s, for at most `RETRY_BUDGET_S` after the first try. A 404, a 5xx other than
503, a reset connection and a cut stream are never retried: they count.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

RETRY_BUDGET_S = 15.0
"""How long after its first try a request may still be retried (refused connection, 503, 429)."""

RETRY_AFTER_CAP_S = 2.0
"""Longest wait between two tries, whatever ``Retry-After`` says."""

RETRY_DEFAULT_S = 0.25
"""Wait between two tries when the server gave no ``Retry-After``."""

RETRIED_STATUSES = (429, 503)


@dataclass
class Request:
    """One request of the load. Times are `time.monotonic` seconds.

    ``outcome``: "ok" (a 200 stream ending with ``data: [DONE]`` and no error event), "failed"
    (failed before its stream started: ``detail`` is the HTTP status or the client error's name)
    or "cut" (the stream started, then broke, or ended with the router's OpenAI error event:
    ``detail`` says how). ``token_events``: the events carrying text the stream brought.
    ``attempts``: tries made (1 = no retry); ``last_try_at_s``: when the last try was sent;
    ``refused``: tries whose connection was refused (nothing listened: no router held the socket);
    ``router``: the index in ``FaultLoad.urls``
    of the router the last try went to (0 with one URL); ``first_byte_at_s``: when the first
    chunk of a 200 stream's body arrived (its first token event), else None."""

    sent_at_s: float
    outcome: str = "pending"
    detail: str = ""
    attempts: int = 0
    last_try_at_s: float = 0.0
    ended_at_s: float = 0.0
    router: int = 0
    first_byte_at_s: float | None = None
    refused: int = 0
    token_events: int = 0


@dataclass
class FaultLoad:
    """``with FaultLoad(url, model) as load: ...``: open-loop streamed completions at
    ``rate_per_s`` until the block ends (then the requests in flight finish, up to ``timeout_s``).

    ``requests`` holds every request sent, finished ones with their outcome. ``urls``, when
    given, replaces ``url`` with several routers taken in turn; ``timeout_s`` bounds one try."""

    url: str
    model: str
    rate_per_s: float = 25.0
    max_tokens: int = 8
    prompt: str = "hello " * 16
    requests: list[Request] = field(default_factory=list)
    urls: tuple[str, ...] = ()
    prompt_for: Callable[[int], str | list[int]] | None = None
    timeout_s: float = 60.0
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> FaultLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="fault-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 30)

    # ----- what happened --------------------------------------------------------------------

    @property
    def done(self) -> list[Request]:
        return [r for r in list(self.requests) if r.outcome != "pending"]

    @property
    def failed(self) -> list[Request]:
        """Requests that failed before their stream started."""
        return [r for r in self.done if r.outcome == "failed"]

    @property
    def cut(self) -> list[Request]:
        """Streams that started and broke."""
        return [r for r in self.done if r.outcome == "cut"]

    @property
    def retried(self) -> list[Request]:
        return [r for r in self.done if r.attempts > 1]

    @property
    def refused(self) -> int:
        """Tries whose connection was refused, over every request (retried ones included)."""
        return sum(r.refused for r in list(self.requests))

    def first_ok_try_after(self, at_s: float) -> float | None:
        """When the first try sent after ``at_s`` that succeeded was sent, or None."""
        tries = [r.last_try_at_s for r in self.done if r.outcome == "ok" and r.last_try_at_s > at_s]
        return min(tries) if tries else None

    def summary(self) -> str:
        retried = self.retried
        return (f"{len(self.done)} requests at {self.rate_per_s:g}/s: {len(self.failed)} failed before streaming, "
                f"{len(self.cut)} streams cut, {len(retried)} retried "
                f"({sum(r.attempts - 1 for r in retried)} retries, {self.refused} tries refused)")

    def wait_for_more(self, n: int, what: str, timeout_s: float = 120.0) -> None:
        """Wait until ``n`` more requests than now have an outcome: the load ran through
        ``what``, however slow the machine. Raises TimeoutError naming ``what`` after ``timeout_s``."""
        target = len(self.done) + n
        deadline = time.monotonic() + timeout_s
        while len(self.done) < target:
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {n} more requests answered "
                                   f"({what}); {self.summary()}")
            time.sleep(0.05)

    # ----- the generator --------------------------------------------------------------------

    async def _run(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True,
                "ignore_eos": True}  # fmt: skip
        connector = aiohttp.TCPConnector(limit=0, force_close=True)   # a new connection each: a restarted router is met at once
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            tasks: set[asyncio.Task] = set()
            next_s = time.monotonic()
            while not self._stop.is_set():
                req = Request(sent_at_s=time.monotonic())
                index = len(self.requests)
                self.requests.append(req)
                one_body = body if self.prompt_for is None else {**body, "prompt": self.prompt_for(index)}
                task = asyncio.create_task(self._one(session, one_body, req, index))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_s += 1.0 / self.rate_per_s
                await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=60)

    async def _one(self, session: aiohttp.ClientSession, body: dict, req: Request, index: int = 0) -> None:
        urls = self.urls or (self.url,)
        while True:
            req.router = (index + req.attempts) % len(urls)
            req.attempts += 1
            req.last_try_at_s = time.monotonic()
            retry_in_s = await self._try(session, body, req, urls[req.router])
            if retry_in_s is None:
                break
            if time.monotonic() + retry_in_s - req.sent_at_s > RETRY_BUDGET_S:
                req.detail += f" (no retry left after {RETRY_BUDGET_S:g} s)"
                break
            await asyncio.sleep(retry_in_s)
        req.ended_at_s = time.monotonic()

    async def _try(self, session: aiohttp.ClientSession, body: dict, req: Request, url: str) -> float | None:
        """One try against the router at ``url``; sets ``req.outcome``/``detail``. Returns the
        seconds to wait before a retry, or None when the outcome is final."""
        try:
            async with session.post(f"{url}/v1/completions", json=body) as r:
                if r.status != 200:
                    await r.read()
                    req.outcome, req.detail = "failed", str(r.status)
                    if r.status in RETRIED_STATUSES:
                        return _retry_after_s(r.headers.get("Retry-After"))
                    return None
                data = b""
                try:
                    async for chunk in r.content.iter_any():
                        if req.first_byte_at_s is None and chunk:
                            req.first_byte_at_s = time.monotonic()
                        req.token_events += chunk.count(b'"text":')
                        data = (data + chunk)[-1024:]   # the tail: an error event? data: [DONE]?
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    req.outcome, req.detail = "cut", type(err).__name__
                    return None
        except aiohttp.ClientConnectorError as err:     # nothing listens (refused) or no route: never reached anyone
            req.outcome, req.detail = "failed", f"{type(err).__name__}: {err.os_error.strerror or err}"
            req.refused += isinstance(err.os_error, ConnectionRefusedError)
            return RETRY_DEFAULT_S
        except (aiohttp.ClientError, asyncio.TimeoutError) as err:   # reset or closed before the answer
            req.outcome, req.detail = "failed", type(err).__name__
            return None
        if b'"error"' in data:
            req.outcome, req.detail = "cut", "error event"
        elif data.rstrip().endswith(b"data: [DONE]"):
            req.outcome, req.detail = "ok", ""
        else:
            req.outcome, req.detail = "cut", "no data: [DONE]"
        return None


def _retry_after_s(header: str | None) -> float:
    """Seconds to wait from a ``Retry-After`` header (delay-seconds form, RFC 9110 10.2.3),
    capped at `RETRY_AFTER_CAP_S`; `RETRY_DEFAULT_S` without one (or an HTTP-date)."""
    try:
        return min(RETRY_AFTER_CAP_S, max(0.0, float(header))) if header else RETRY_DEFAULT_S
    except ValueError:
        return RETRY_DEFAULT_S
