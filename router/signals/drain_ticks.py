"""The shared drain tick of the router's KV event subscribers.

Owns `DrainTicks` and `DRAIN_INTERVAL_S`. Waking up costs far more than a batch does (an
event-loop turn and pyzmq's futures: ~300 us of CPU per message on the 2-core dev machine against
~5 us per block applied, docs/benchmarks.md "Router CPU with KV events"), so the subscribers
(`router.signals.kv_subscriber.KvEventSubscriber`) do not wake per message: all of a router's
subscribers drain their sockets together on one tick every `DRAIN_INTERVAL_S`, made by
`router.signals.kv_streams.KvEventStreams` and shared by its subscribers. Runs on the running
event loop's clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

DRAIN_INTERVAL_S = 0.02
"""Seconds between two drains of the subscribers' sockets (the shared `DrainTicks`): the most a
batch waits in the socket after it arrived. Against the seconds between a conversation's turns, a
20 ms older view changes few decisions; it makes a router with 8 busy streams wake 50 times a
second for them instead of once per batch (hundreds). 50 ms saved no CPU measurably on the
Mooncake window (docs/benchmarks.md, "Router CPU with KV events"), so the fresher view stays."""


class DrainTicks:
    """A tick every `interval_s` seconds, shared by a router's subscribers so that they wake
    together: `wait()` returns a future resolved at the next tick (one loop timer per tick,
    however many wait). Runs on the running event loop's clock.

    A waiter may pass `poll`, a plain function the tick calls in its timer callback instead of
    waking the waiter's task: True means it did the tick's work itself and waits for the next
    tick (the future stays pending), False wakes the task. A router's subscribers drain their
    in-order batches that way, so a tick costs one timer callback, not a task step per stream
    (docs/benchmarks.md, "Router CPU with KV events"). An exception from `poll` is set on its
    future (its task raises it); the other waiters are not affected.

    Raises:
        ValueError: `interval_s` < 0.
    """

    def __init__(self, interval_s: float = DRAIN_INTERVAL_S) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.interval_s = interval_s
        self.ticks = 0
        self._waiters: list[tuple[asyncio.Future[None], Callable[[], bool] | None]] = []
        self._armed = False

    def wait(self, poll: Callable[[], bool] | None = None) -> asyncio.Future[None]:
        """A future resolved at the next tick, or at the first tick whose `poll()` returns False
        (cancelling it cancels no one else's wait)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append((fut, poll))
        self._arm(loop)
        return fut

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self._armed:
            self._armed = True
            loop.call_later(self.interval_s, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._armed = False
        waiters, self._waiters = self._waiters, []
        self.ticks += 1
        for fut, poll in waiters:
            if fut.done():
                continue   # cancelled
            if poll is None:
                fut.set_result(None)
                continue
            try:
                keep = poll()
            except Exception as exc:  # the subscriber's task restarts it; the other streams go on
                fut.set_exception(exc)
                continue
            if keep and not fut.done():
                self._waiters.append((fut, poll))
            elif not fut.done():
                fut.set_result(None)
        if self._waiters:
            self._arm(loop)
