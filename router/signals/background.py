"""One background loop a router component runs while it is started.

Owns `BackgroundLoop`: `start` creates the named task unless it runs, `stop` cancels it and waits
for it to end. Used by the engine-load poller (`router.signals.engine_poll`), started and closed by
`router.http.app.RouterApp`'s lifespan; and `wake`, the callback that resolves a future a loop
waits on (a file descriptor's), used by `router.signals.kv_subscriber`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any


class BackgroundLoop:
    """The task of ``run()`` named ``name``, at most one at a time."""

    def __init__(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._run = run
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the task unless it is running (needs a running event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        """Cancel the task and wait for it to end; nothing when it is not running."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def wake(fut: asyncio.Future[None]) -> None:
    """Resolve `fut` unless it is done already (cancelled, or woken by another source)."""
    if not fut.done():
        fut.set_result(None)
