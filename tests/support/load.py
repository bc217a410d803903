"""Open-loop load for the integration and end-to-end tests: one completion every 1/rate s through
a router, whatever the earlier ones are doing, each outcome recorded with the time it was sent.
Used by the fault-injection and rollout tests to count every request. `StreamedLoad`: the
rollout tests' streamed variant."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import aiohttp

from tests.support.waits import wait_until


@dataclass
class OpenLoopLoad:
    """``with OpenLoopLoad(url, model) as load: ...``. ``results``: ``(sent_at_s, outcome)`` in
    `time.monotonic` seconds, outcome "ok", "cut" (a stream that did not end with
    ``data: [DONE]``), an HTTP status, or the client error's name."""

    url: str
    model: str
    rate_per_s: float = 20.0
    max_tokens: int = 4
    stream: bool = False
    prompt: str = "hello"
    results: list[tuple[float, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> OpenLoopLoad:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    async def _run(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": self.max_tokens, "stream": self.stream}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            async def one() -> None:
                sent = time.monotonic()
                try:
                    async with session.post(f"{self.url}/v1/completions", json=body) as r:
                        data = await r.read()
                        if r.status != 200:
                            outcome = str(r.status)
                        elif self.stream and not data.rstrip().endswith(b"data: [DONE]"):
                            outcome = "cut"
                        else:
                            outcome = "ok"
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    outcome = type(err).__name__
                self.results.append((sent, outcome))

            tasks: set[asyncio.Task] = set()
            next_s = time.monotonic()
            while not self._stop.is_set():
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_s += 1.0 / self.rate_per_s
                await asyncio.sleep(max(0.0, next_s - time.monotonic()))
            if tasks:
                await asyncio.wait(tasks, timeout=30)

    @property
    def failed(self) -> list[tuple[float, str]]:
        return [r for r in self.results if r[1] != "ok"]

    def wait_for_more(self, n: int, what: str, timeout_s: float = 120.0) -> None:
        """Wait until ``n`` more requests than now have an outcome (of any kind): the load ran
        through ``what``, however slow the machine; fails naming ``what`` after ``timeout_s``."""
        target = len(self.results) + n
        wait_until(lambda: len(self.results) >= target, timeout_s,
                   what=f"{n} more requests answered ({what}); {len(self.results)} before")


def StreamedLoad(url: str, model: str, rate_per_s: float = 8.0, max_tokens: int = 24) -> OpenLoopLoad:
    """Open-loop streamed completions; a reply counts as whole when its stream ends with `data: [DONE]`."""
    return OpenLoopLoad(url, model, rate_per_s=rate_per_s, max_tokens=max_tokens, stream=True, prompt="hello " * 20)
