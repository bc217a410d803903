"""The router's listening socket outlives the router process (fleet/local/routerproc.py): `kill -9`
of the router while a client opens a new connection every few milliseconds refuses none of
them; the connections made while no router ran wait in the socket's backlog and are answered by
the next router, which `ensure_running` starts on the same socket with the same admin token. After
a deliberate stop the port refuses, so the probe does see a refusal when there is one.

A real router process (`python -m router`) on loopback, no engine; killed at the end.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest

from fleet.local.routerproc import RouterProcess
from fleet.local.state import StateStore
from tests.support.faults import kill_9_router
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.timeout(120)

PROBE_INTERVAL_S = 0.005


def probe(host: str, port: int, timeout_s: float = 30.0) -> str:
    """One `GET /health` on a new connection: "ok" (200), "refused", "reset" or the status."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as conn:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n")
            head = conn.recv(64)
    except ConnectionRefusedError:
        return "refused"
    except (ConnectionResetError, BrokenPipeError):
        return "reset"
    if not head:
        return "reset"
    status = head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/1.1 ") else "?"
    return "ok" if status == "200" else status


@dataclass
class ProbeLoop:
    """Opens a connection every `PROBE_INTERVAL_S` from its own thread until stopped; each
    probe runs in a thread of its own, so one waiting in the backlog holds up no other."""

    host: str
    port: int
    sent_s: list[float] = field(default_factory=list)                # when each probe was sent
    results: list[tuple[float, str]] = field(default_factory=list)   # (sent at, outcome)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> ProbeLoop:
        self._threads: list[threading.Thread] = []
        self._loop = threading.Thread(target=self._run, daemon=True)
        self._loop.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._loop.join(timeout=10)
        for t in self._threads:
            t.join(timeout=35)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sent_s.append(time.monotonic())
            t = threading.Thread(target=self._one, args=(self.sent_s[-1],), daemon=True)
            t.start()
            self._threads.append(t)
            self._stop.wait(PROBE_INTERVAL_S)

    def _one(self, sent_at_s: float) -> None:
        self.results.append((sent_at_s, probe(self.host, self.port)))

    def sent_after(self, at_s: float) -> int:
        return sum(1 for s in list(self.sent_s) if s > at_s)

    def answered_after(self, at_s: float) -> int:
        return sum(1 for s, o in list(self.results) if s > at_s and o == "ok")

    def count(self, outcome: str) -> int:
        return sum(1 for _, o in list(self.results) if o == outcome)


async def test_a_killed_router_refuses_no_connection_and_its_successor_answers_the_queued_ones(tmp_path):
    store = StateStore(tmp_path)
    router = RouterProcess(store, "127.0.0.1", 0)
    try:
        await router.start()
        first_pid, token = router.record.pid, store.admin_token()
        with ProbeLoop(router.host, router.port) as probes:
            await async_wait_until(lambda: probes.count("ok") >= 20, 30, what="20 probes answered before the kill")
            killed_at_s = await asyncio.to_thread(kill_9_router, store.root)
            # Nothing accepts now: probes queue in the backlog for as long as the restart takes.
            await async_wait_until(lambda: probes.sent_after(killed_at_s) >= 20, 30,
                                   what="20 probes sent while no router runs")  # fmt: skip
            assert await router.ensure_running() is True
            restarted_at_s = time.monotonic()
            await async_wait_until(lambda: probes.answered_after(restarted_at_s) >= 20, 30,
                                   what="20 probes answered by the new router")
        gap = [o for at, o in probes.results if killed_at_s < at < restarted_at_s]
        after_kill = [o for at, o in probes.results if at > killed_at_s]
        print(f"\nFIGURE router kill -9 with the socket handed over: {len(probes.results)} connections, "
              f"{probes.count('refused')} refused, {probes.count('reset')} reset; {len(gap)} opened while no "
              f"router ran, {gap.count('ok')} of them answered by the next one")  # fmt: skip
        assert probes.count("refused") == 0, probes.results
        assert gap and set(after_kill) == {"ok"}, f"connections after the kill: {sorted(set(after_kill))}"
        assert router.record.pid != first_pid and store.admin_token() == token == router.token
        assert await router.admin.pools() is not None   # the controller's token still opens the admin API
        port = router.port
    finally:
        await router.stop()
    assert probe("127.0.0.1", port, timeout_s=5) == "refused"   # stopped: the socket is gone with it
