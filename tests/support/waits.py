"""Waiting on conditions with deadlines, never for a fixed time.

`wait_until` (threads, processes) and `async_wait_until` (inside an event loop) poll a predicate
until it holds and fail the test, naming what they waited for, once ``timeout_s`` has passed.
Deadlines are generous (a slow, shared 2-core machine must not flake); a condition that holds
at once costs no wait at all."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def _explained(message: str, timeout_s: float, explain: Callable[[], object] | None, last: Any) -> str:
    text = f"timed out after {timeout_s:g} s waiting for {message}"
    if last is not None and last is not False:
        text += f" (last value: {last!r})"
    if explain is not None:
        text += f"\n{explain()}"
    return text


def wait_until(predicate: Callable[[], T], timeout_s: float = 30.0, interval_s: float = 0.05,
               message: str = "the condition", explain: Callable[[], object] | None = None) -> T:
    """Poll ``predicate`` every ``interval_s`` until it returns a truthy value, and return that
    value; after ``timeout_s`` fail the test with "timed out ... waiting for {message}" (and what
    ``explain()`` returns, when given)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            pytest.fail(_explained(message, timeout_s, explain, value))
        time.sleep(interval_s)


async def async_wait_until(predicate: Callable[[], T | Awaitable[T]], timeout_s: float = 30.0,
                           interval_s: float = 0.01, message: str = "the condition",
                           explain: Callable[[], object] | None = None) -> T:
    """`wait_until` inside an event loop: ``predicate`` may be a plain or an async callable; the
    loop runs other tasks between polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if loop.time() >= deadline:
            pytest.fail(_explained(message, timeout_s, explain, value))
        await asyncio.sleep(interval_s)
