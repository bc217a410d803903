"""The unit tier's guards: while a test of tests/unit runs (its setup, the test and its teardown,
module- and session-scoped fixtures it sets up included), starting a process, connecting a
socket to anything but a loopback port this pytest process opened, or calling the raw
Kubernetes client fails the test with a message naming the tier it belongs in.

In the style of kopf's ``k8s_mocked`` fixture, but for side effects that are refused rather than
recorded. `tests/unit/conftest.py` activates the guards around every unit test and hands the
active `UnitTierGuards` to a test through the ``tier_guards`` fixture.

What is refused:

* processes: ``subprocess.Popen`` (its ``_execute_child``, so ``run``, ``check_output``, ``call``
  and asyncio's subprocess transports too, and any ``from subprocess import Popen``),
  ``asyncio.create_subprocess_exec/shell`` (and the event loop's ``subprocess_exec/shell``),
  ``os.fork``/``forkpty``/``posix_spawn``/``posix_spawnp``/``system`` and
  ``multiprocessing`` process start (``BaseProcess.start``: ``Process``, ``Pool``,
  ``ProcessPoolExecutor``, managers);
* sockets: ``socket.socket.connect``/``connect_ex`` (sync clients and asyncio's
  ``sock_connect`` alike) to anything but a LOOPBACK port (127.0.0.0/8, ::1, ``localhost``)
  or a Unix socket path that a socket of this pytest process bound: the test's own in-process
  fixtures (`tests/support/router.py` ``running_app``, ``FakeEngine``, ``dead_endpoint``; aiohttp
  and uvicorn servers; a test's ``free_port``) register themselves by binding. Bound ports are
  remembered for the whole session, so a module-scoped server counts. A test that must connect
  to a loopback port it did not bind registers it with ``tier_guards.allow_port(port)``.
  External addresses always fail;
* the raw Kubernetes client: ``kubernetes.client.ApiClient.call_api`` and
  ``kubernetes.client.rest.RESTClientObject.request``. Unit tests use the in-repo fake
  (`tests/support/fake_kube.py` ``FakeKube``), which never reaches it.

A trip raises `TierGuardError` at the call, and is also remembered: a test whose code under test
swallowed the error (``except Exception``) still fails, at teardown, with the same message.
"""

from __future__ import annotations

import asyncio
import asyncio.base_events
import asyncio.subprocess
import ipaddress
import multiprocessing.process
import os
import socket
import subprocess
import threading
from typing import Any

import pytest

INTEGRATION_HINT = ("tests/unit runs no process, opens no socket but to its own loopback fixtures and never "
                    "reaches a Kubernetes API: move this test to tests/integration (real processes on loopback, "
                    "simulated engines, the API-server stand-in, Prometheus, helm), or to tests/e2e if it needs "
                    "real vLLM")


class TierGuardError(AssertionError):
    """A unit test did what only an integration (or end-to-end) test may do."""


# ----- loopback ports this process bound (recorded for the whole session, in every tier) -----------

_bound_lock = threading.Lock()
_bound_ports: set[int] = set()
_bound_paths: set[str] = set()
_original_bind = socket.socket.bind


def _recording_bind(self: socket.socket, address: Any) -> None:
    _original_bind(self, address)
    try:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            port = self.getsockname()[1]
            with _bound_lock:
                _bound_ports.add(port)
        elif self.family == getattr(socket, "AF_UNIX", None) and isinstance(address, (str, bytes)):
            with _bound_lock:
                _bound_paths.add(os.fsdecode(address))
    except OSError:
        pass


def record_bound_ports() -> None:
    """Remember every port (and Unix socket path) a socket of this process binds. Installed once,
    for the session, by tests/conftest.py: a server a fixture of any scope opened is known."""
    if socket.socket.__dict__.get("bind") is not _recording_bind:
        socket.socket.bind = _recording_bind  # type: ignore[method-assign]


def _is_loopback(host: Any) -> bool:
    if isinstance(host, bytes):
        host = host.decode()
    if not isinstance(host, str):
        return False
    if host.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


class UnitTierGuards:
    """The guards of one unit test: `activate` before its setup, `deactivate` after its teardown."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.trips: list[str] = []
        self.allowed_ports: set[int] = set()
        self._mp = pytest.MonkeyPatch()

    # --- for tests ---------------------------------------------------------------------------

    def allow_port(self, port: int) -> None:
        """Let this test connect to loopback ``port`` though no socket of this process bound it."""
        self.allowed_ports.add(port)

    def consume_trips(self) -> list[str]:
        """The trips so far, forgotten: a test that provokes a trip on purpose takes them back."""
        trips, self.trips = self.trips, []
        return trips

    # --- tripping ----------------------------------------------------------------------------

    def trip(self, what: str) -> TierGuardError:
        message = f"unit-tier guard: {self.nodeid} {what}. {INTEGRATION_HINT}."
        self.trips.append(message)
        return TierGuardError(message)

    def _refuse_process(self, what: str):
        guards = self

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise guards.trip(f"tried to start a process ({what}{_args_hint(args)})")

        return refuse

    def _refuse_process_async(self, what: str):
        guards = self

        async def refuse(*args: Any, **kwargs: Any) -> Any:
            raise guards.trip(f"tried to start a process ({what}{_args_hint(args)})")

        return refuse

    def _check_address(self, sock: socket.socket, address: Any) -> None:
        family = sock.family
        if family == getattr(socket, "AF_UNIX", None):
            path = os.fsdecode(address) if isinstance(address, (str, bytes)) else address
            with _bound_lock:
                known = path in _bound_paths
            if not known:
                raise self.trip(f"tried to connect to the Unix socket {path!r}, which no socket of this test "
                                f"process bound")
            return
        if family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(address, tuple):
            raise self.trip(f"tried to connect a socket of family {family!r} to {address!r}")
        host, port = address[0], address[1]
        if not _is_loopback(host):
            raise self.trip(f"tried to connect to {host}:{port}, an address outside this machine's loopback")
        with _bound_lock:
            known = port in _bound_ports
        if not (known or port in self.allowed_ports):
            raise self.trip(f"tried to connect to {host}:{port}, a loopback port no fixture of this test process "
                            f"opened (another process's server?)")

    # --- installing --------------------------------------------------------------------------

    def activate(self) -> None:
        mp = self._mp
        guards = self
        # Processes.
        mp.setattr(subprocess.Popen, "_execute_child", self._refuse_process("subprocess.Popen"))
        for mod in (asyncio, asyncio.subprocess):
            mp.setattr(mod, "create_subprocess_exec", self._refuse_process_async("asyncio.create_subprocess_exec"))
            mp.setattr(mod, "create_subprocess_shell", self._refuse_process_async("asyncio.create_subprocess_shell"))
        mp.setattr(asyncio.base_events.BaseEventLoop, "subprocess_exec",
                   self._refuse_process_async("loop.subprocess_exec"))
        mp.setattr(asyncio.base_events.BaseEventLoop, "subprocess_shell",
                   self._refuse_process_async("loop.subprocess_shell"))
        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                mp.setattr(os, name, self._refuse_process(f"os.{name}"))
        mp.setattr(multiprocessing.process.BaseProcess, "start", self._refuse_process("multiprocessing Process.start"))

        # Sockets.
        original_connect = socket.socket.connect
        original_connect_ex = socket.socket.connect_ex

        def connect(sock: socket.socket, address: Any) -> None:
            guards._check_address(sock, address)
            return original_connect(sock, address)

        def connect_ex(sock: socket.socket, address: Any) -> int:
            guards._check_address(sock, address)
            return original_connect_ex(sock, address)

        mp.setattr(socket.socket, "connect", connect)
        mp.setattr(socket.socket, "connect_ex", connect_ex)

        # The raw Kubernetes client.
        try:
            import kubernetes.client
            import kubernetes.client.rest
        except ImportError:  # pragma: no cover - a dependency of fleet
            return

        def refuse_k8s(what: str):
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise guards.trip(f"called the raw Kubernetes client ({what}); unit tests use the in-repo fake, "
                                  f"tests/support/fake_kube.py FakeKube")
            return refuse

        mp.setattr(kubernetes.client.ApiClient, "call_api", refuse_k8s("ApiClient.call_api"))
        mp.setattr(kubernetes.client.rest.RESTClientObject, "request", refuse_k8s("RESTClientObject.request"))

    def deactivate(self) -> None:
        self._mp.undo()


def _args_hint(args: tuple) -> str:
    """The command, when the first argument looks like one (for the message)."""
    for a in args:
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, (str, bytes, os.PathLike)) for x in a):
            return ": " + " ".join(os.fsdecode(x) for x in a)[:200]
        if isinstance(a, (str, bytes)) and a:
            return ": " + os.fsdecode(a)[:200]
    return ""
