"""The admission queue of one model: requests waiting in the router for a free endpoint slot.

Owns `AdmissionQueue`, a FIFO of waiting requests. A pool whose spec sets
`max_concurrency_per_endpoint` never sends an endpoint more requests at once than that; a
request that finds every ready endpoint full waits here (at most `max_queue_length` of them,
each at most `queue_timeout_s`) instead of queueing inside an engine. The time it waits is the
router's queue time (`router.stats.windows.ModelStats.queue_time`), the signal the autoscaler scales on,
and a replica that joins the pool takes the queued requests at once, where requests already
sent to a saturated engine would have stayed behind that engine's own queue.

`router.pools.pool.PoolTable` keeps one queue per model across pool replacements and wakes waiters
when a new pool has free slots; `router.request.proxy` waits here and `router.request.attempt` wakes
the next waiter whenever a request leaves a ready endpoint. Single event loop, no locks: a woken
waiter re-checks for a slot and, having lost it (a retry took it), waits again at the head of the
queue. New arrivals queue behind existing waiters, so the order is first come, first served.
"""

from __future__ import annotations

import asyncio
from collections import deque


class AdmissionQueue:
    """FIFO of futures, one per waiting request; `len()` counts the requests waiting now and not
    yet woken. A woken waiter no longer counts: it has a slot coming, so a slot freed before it
    runs goes to the next waiter or, if none is left, to the next arrival (`has_waiters` false),
    instead of a wake-up that finds nobody and leaves the slot idle while requests queue."""

    __slots__ = ("_waiters", "_waiting")

    def __init__(self) -> None:
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def has_waiters(self) -> bool:
        return self._waiting > 0

    async def wait(self, timeout_s: float, *, front: bool = False) -> bool:
        """Wait until woken (True) or ``timeout_s`` passes (False). ``front``: queue at the head
        (a woken request that lost its slot). A waiter cancelled after it was woken passes the
        wake-up on, so a free slot is never left unclaimed."""
        if timeout_s <= 0:
            return False
        waiters = self._waiters
        while waiters and waiters[0].done():  # timed out or cancelled ones, oldest first
            waiters.popleft()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(future)
        else:
            self._waiters.append(future)
        self._waiting += 1
        try:
            await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return False
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.wake(1)
            raise
        finally:
            if future.cancelled() or not future.done():   # left unwoken (`wake` uncounted the woken)
                self._waiting -= 1
        return True

    def wake(self, n: int = 1) -> int:
        """Wake up to ``n`` waiters, oldest first; return how many were woken."""
        woken = 0
        waiters = self._waiters
        while waiters and woken < n:
            future = waiters.popleft()
            if not future.done():
                future.set_result(None)
                self._waiting -= 1
                woken += 1
        return woken

    def wake_all(self) -> int:
        """Wake every waiter (the pool's limit was lifted or the pool was deleted)."""
        return self.wake(len(self._waiters))
