"""Waiting on conditions with deadlines, never for a fixed time: the one wait helper of every tier.

`wait_until` (threads, processes) and `async_wait_until` (inside an event loop) poll a predicate
until it returns a truthy value and return that value. Once ``timeout_s`` has passed they fail the
test with a message that names what they waited for (``what``) and the last value the predicate
returned (or the last exception it raised, among the ones ``ignoring`` lists). Deadlines are
generous (a slow, shared 2-core machine must not flake); a condition that holds at once costs no
wait at all. tests/unit/test_waits.py checks this module, and tests/unit/test_wait_guard.py fails
a test file that writes its own wait helper or deadline loop instead of calling it.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import pytest

T = TypeVar("T")

_NOTHING = object()     # the predicate has not returned yet (it raised an ignored error every time)


def _fail(what: str, timeout_s: float, last: Any, error: BaseException | None,
          explain: Callable[[], object] | None) -> NoReturn:
    text = f"timed out after {timeout_s:g} s waiting for {what}"
    if last is not _NOTHING:
        text += f"; last value: {last!r}"
    if error is not None:
        text += f"; last error: {type(error).__name__}: {error}"
    if explain is not None:
        text += f"\n{explain()}"
    pytest.fail(text)


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, *, interval_s: float = 0.05,
               what: str = "the condition", explain: Callable[[], object] | None = None,
               ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``predicate()`` every ``interval_s`` seconds until it returns a truthy value, and return
    that value.

    An exception of a type in ``ignoring`` (say, ``httpx.ConnectError`` while a server starts)
    counts as "not yet"; any other propagates at once. After ``timeout_s`` seconds the test fails
    (`pytest.fail`) with "timed out after {timeout_s} s waiting for {what}", the last value
    returned, the last ignored error, and what ``explain()`` returns, when given."""
    deadline = time.monotonic() + timeout_s
    last: Any = _NOTHING
    error: BaseException | None = None
    while True:
        try:
            last = predicate()
        except ignoring as exc:
            error = exc
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            _fail(what, timeout_s, last, error, explain)
        time.sleep(interval_s)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], timeout_s: float = 30.0, *,
                           interval_s: float = 0.01, what: str = "the condition",
                           explain: Callable[[], object] | None = None,
                           ignoring: tuple[type[BaseException], ...] = ()) -> T:
    """`wait_until` inside an event loop: ``predicate`` may be a plain or an async callable, and
    the loop runs its other tasks between polls (every ``interval_s`` seconds). The deadline is on
    the running loop's clock (`loop.time()`), so a test on a virtual-time loop waits in its time."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = _NOTHING
    error: BaseException | None = None
    while True:
        try:
            value = predicate()
            last = await value if inspect.isawaitable(value) else value
        except ignoring as exc:
            error = exc
        else:
            if last:
                return last
        if loop.time() >= deadline:
            _fail(what, timeout_s, last, error, explain)
        await asyncio.sleep(interval_s)


async def zmq_connected(sock: Any, endpoint: str, timeout_s: float = 30.0) -> None:
    """Connect the pyzmq socket ``sock`` (plain or asyncio) to ``endpoint`` and wait until its
    ZMTP handshake with the peer is done (the socket monitor's ``zmq.EVENT_HANDSHAKE_SUCCEEDED``).

    A SUB sends its subscriptions on the connection as soon as the handshake is done, so a batch
    published after a round trip of its own (a completion request, say) reaches it: use this where
    the publisher is not the test's own (the engine simulator, vLLM). A test that owns the PUB side
    waits on the subscription itself (an XPUB socket receives it: tests/unit/test_kv_subscriber.py)."""
    import zmq
    from zmq.utils.monitor import parse_monitor_message

    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    raw = zmq.Socket.shadow(monitor.underlying)   # polled without blocking, whatever the socket's flavour
    try:
        sock.connect(endpoint)

        def handshake_done() -> bool:
            while raw.poll(0):
                if parse_monitor_message(raw.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    return True
            return False

        await async_wait_until(handshake_done, timeout_s, interval_s=0.01,
                               what=f"the ZMTP handshake with {endpoint}")
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
