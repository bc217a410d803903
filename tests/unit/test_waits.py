"""The one wait helper (tests/support/waits.py): it returns the predicate's first truthy value at
once or after polls, and on a timeout fails the test with what it waited for, the last value seen
and the last ignored error; errors it is not told to ignore propagate at once; the async form
awaits an async predicate and lets the loop's other tasks run between polls."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from tests.support.waits import async_wait_until, wait_until, zmq_connected


def test_returns_the_first_truthy_value_without_waiting_when_it_holds_at_once() -> None:
    began_s = time.monotonic()
    assert wait_until(lambda: {"ready": 1}, 30) == {"ready": 1}
    assert time.monotonic() - began_s < 1.0


def test_polls_until_the_predicate_holds_and_returns_its_value() -> None:
    answers = iter([None, 0, [], "third"])
    assert wait_until(lambda: next(answers), 30, interval_s=0.001) == "third"


def test_times_out_naming_what_it_waited_for_and_the_last_value() -> None:
    seen = iter(range(1_000_000))
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_until(lambda: next(seen) < 0 and "never", 0.05, interval_s=0.005, what="the queue to drain",
                   explain=lambda: "queue: [a, b]")
    message = str(failed.value)
    assert message.startswith("timed out after 0.05 s waiting for the queue to drain; last value: False")
    assert message.endswith("\nqueue: [a, b]")


def test_an_ignored_error_counts_as_not_yet_and_is_named_on_a_timeout() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("nothing listens on 127.0.0.1:9")

    with pytest.raises(pytest.fail.Exception, match="last error: ConnectionRefusedError: nothing listens"):
        wait_until(refused, 0.05, interval_s=0.005, what="the server", ignoring=(OSError,))


def test_an_error_not_ignored_propagates_at_once() -> None:
    began_s = time.monotonic()
    with pytest.raises(KeyError):
        wait_until(lambda: {}["missing"], 30, ignoring=(OSError,))
    assert time.monotonic() - began_s < 1.0


async def test_the_async_form_awaits_an_async_predicate_and_runs_other_tasks_between_polls() -> None:
    done = asyncio.Event()

    async def finish() -> None:
        await asyncio.sleep(0.01)
        done.set()

    async def is_done() -> str | None:
        return "done" if done.is_set() else None

    task = asyncio.create_task(finish())
    assert await async_wait_until(is_done, 30, what="the other task") == "done"
    await task


async def test_the_async_form_times_out_with_the_same_message() -> None:
    with pytest.raises(pytest.fail.Exception, match=r"^timed out after 0.05 s waiting for nothing; last value: 0$"):
        await async_wait_until(lambda: 0, 0.05, what="nothing")


async def test_zmq_connected_returns_once_the_handshake_is_done_and_times_out_without_a_peer() -> None:
    ctx = zmq.asyncio.Context()
    try:
        pub = ctx.socket(zmq.PUB)
        pub.bind("tcp://127.0.0.1:0")
        sub = ctx.socket(zmq.SUB)
        await zmq_connected(sub, pub.getsockopt_string(zmq.LAST_ENDPOINT))
        lonely = ctx.socket(zmq.SUB)
        with pytest.raises(pytest.fail.Exception, match="waiting for the ZMTP handshake with ipc://"):
            await zmq_connected(lonely, "ipc:///nonexistent/fleet-test-socket", timeout_s=0.05)
    finally:
        ctx.destroy(linger=0)
