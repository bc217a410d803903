"""The unit tier's guards (tests/support/guards.py, switched on by tests/unit/conftest.py) fire:
each way of starting a process, a connect to an external address or to a loopback port no
fixture of this process opened, and the raw Kubernetes client raise `TierGuardError` naming the
tier the test belongs in; the test's own loopback servers stay reachable; and a trip that the
code under test swallowed still fails the test."""

from __future__ import annotations

import asyncio
import concurrent.futures
import multiprocessing
import os
import socket
import subprocess

import pytest

import tests.support.guards as guards_module
from tests.support.guards import TierGuardError, UnitTierGuards

pytest_plugins = ["pytester"]

UNROUTABLE = ("192.0.2.1", 80)     # TEST-NET-1 (RFC 5737): never a real host


def _unused_loopback_port() -> int:
    """A low loopback port no socket of this process bound (a test run as root may bind port 1)."""
    return next(port for port in range(1, 1024) if port not in guards_module._bound_ports)


def _tripped(guards: UnitTierGuards, fragment: str) -> None:
    """The trip was recorded, named the tier, and is taken back so the test passes."""
    trips = guards.consume_trips()
    assert trips and fragment in trips[-1], trips
    assert "move this test to tests/integration" in trips[-1]


def _noop() -> None:
    pass


def test_popen_and_everything_built_on_it_is_refused(tier_guards):
    with pytest.raises(TierGuardError, match="tests/integration"):
        subprocess.Popen(["true"])
    with pytest.raises(TierGuardError, match="subprocess.Popen: true"):
        subprocess.run(["true"], check=True)
    with pytest.raises(TierGuardError):
        subprocess.check_output(["echo", "hi"])
    with pytest.raises(TierGuardError):
        os.popen("true")
    _tripped(tier_guards, "tried to start a process")


async def test_asyncio_subprocesses_are_refused(tier_guards):
    with pytest.raises(TierGuardError, match="asyncio.create_subprocess_exec: true"):
        await asyncio.create_subprocess_exec("true")
    with pytest.raises(TierGuardError, match="asyncio.create_subprocess_shell"):
        await asyncio.create_subprocess_shell("true")
    loop = asyncio.get_running_loop()
    with pytest.raises(TierGuardError, match="loop.subprocess_exec"):
        await loop.subprocess_exec(asyncio.SubprocessProtocol, "true")
    _tripped(tier_guards, "tried to start a process")


def test_fork_spawn_and_system_are_refused(tier_guards):
    try:
        pid = os.fork()
    except TierGuardError:
        pass
    else:  # pragma: no cover - the guard did not fire: never let a forked pytest run on
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        pytest.fail("os.fork was not refused")
    with pytest.raises(TierGuardError, match="os.posix_spawn"):
        os.posix_spawn("/bin/true", ["true"], os.environ)
    with pytest.raises(TierGuardError, match="os.system"):
        os.system("true")
    _tripped(tier_guards, "tried to start a process")


def test_multiprocessing_processes_and_process_pools_are_refused(tier_guards):
    p = multiprocessing.Process(target=_noop)
    with pytest.raises(TierGuardError, match="multiprocessing Process.start"):
        p.start()
    with concurrent.futures.ProcessPoolExecutor(max_workers=1) as pool:
        with pytest.raises(TierGuardError):
            pool.submit(_noop).result(timeout=30)
    _tripped(tier_guards, "multiprocessing Process.start")


def test_connects_to_external_addresses_are_refused(tier_guards):
    with socket.socket() as s:
        s.settimeout(1)
        with pytest.raises(TierGuardError, match="outside this machine's loopback"):
            s.connect(UNROUTABLE)
        with pytest.raises(TierGuardError, match="192.0.2.1:80"):
            s.connect_ex(UNROUTABLE)
    with pytest.raises(TierGuardError):
        socket.create_connection(UNROUTABLE, timeout=1)
    _tripped(tier_guards, "outside this machine's loopback")


async def test_asyncio_connects_to_external_addresses_are_refused(tier_guards):
    with pytest.raises(TierGuardError, match="outside this machine's loopback"):
        await asyncio.wait_for(asyncio.open_connection(*UNROUTABLE), timeout=10)
    _tripped(tier_guards, "outside this machine's loopback")


def test_a_loopback_port_no_fixture_opened_is_refused_unless_registered(tier_guards):
    port = _unused_loopback_port()
    with socket.socket() as s:
        with pytest.raises(TierGuardError, match="a loopback port no fixture of this test process opened"):
            s.connect(("127.0.0.1", port))
    _tripped(tier_guards, f"127.0.0.1:{port}")
    tier_guards.allow_port(port)
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0      # registered: the connect is made (and refused)
    assert tier_guards.consume_trips() == []


def test_the_tests_own_loopback_servers_are_reachable():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            conn, _ = server.accept()
            client.sendall(b"ping")
            assert conn.recv(4) == b"ping"
            conn.close()
        with socket.create_connection(("localhost", port), timeout=10):
            pass


async def test_the_in_process_router_helpers_are_reachable():
    from aiohttp import web

    from tests.support.router import running_app

    async def app(scope, receive, send):
        assert scope["type"] in ("http", "lifespan")
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with running_app(app) as url:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
    assert web  # aiohttp (FakeEngine's server) imports under the guards too


def test_the_raw_kubernetes_client_is_refused(tier_guards):
    from kubernetes.client import ApiClient

    with pytest.raises(TierGuardError, match="raw Kubernetes client.*tests/support/fake_kube.py"):
        ApiClient().call_api("/api/v1/namespaces/fleet/pods", "GET")
    _tripped(tier_guards, "ApiClient.call_api")


def test_a_trip_the_code_under_test_swallowed_still_fails_the_test(pytester: pytest.Pytester):
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest("from tests.unit.conftest import pytest_runtest_setup, pytest_runtest_teardown, tier_guards\n")
    pytester.makepyfile(test_swallowed="""
        import subprocess

        def test_probe():
            try:
                subprocess.run(["nvidia-smi"])
            except Exception:
                pass   # product code that treats any failure as "no GPU"
    """)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*unit-tier guard: test_swallowed.py::test_probe tried to start a process "
                                 "(subprocess.Popen: nvidia-smi)*move this test to tests/integration*"])
