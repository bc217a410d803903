"""Wildcard binds without a pod network: a TEST STAND-IN for the per-pod network namespace a
container runtime gives every pod (docs/kubernetes.md, "The cluster in a box").

In a cluster two engine pods can each bind ``tcp://*:5557`` (vLLM's ``--kv-events-config``
endpoint, `fleet.engines.kinds.KvEventsBind`): each pod has its own network namespace. The
stand-in kubelets run a pod's containers as local processes in the machine's one network
namespace, each pod on its own loopback address, so the second wildcard bind would fail with
EADDRINUSE. As a runtime's port mapping does, the kubelet rewrites each ``tcp://*:P`` in a pod's
arguments (also inside a JSON argument) to ``tcp://*:H`` for a free host port H, and relays TCP
from the pod's address, port P (what the pod declares and what its peers dial) to H.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket

WILDCARD_TCP = re.compile(r"tcp://\*:(\d+)")


class WildcardPorts:
    """The wildcard ports of one pod at ``pod_ip``: a host port per pod port, and a relay each.

    ``rewrite`` is pure bookkeeping (it picks host ports); ``serve`` starts the relays that are
    not yet listening; ``close`` stops them all. A port keeps its host port across container
    restarts."""

    def __init__(self, pod_ip: str) -> None:
        self.pod_ip = pod_ip
        self.host_ports: dict[int, int] = {}
        self._servers: dict[int, asyncio.AbstractServer] = {}
        self._pipes: set[asyncio.Task] = set()

    def rewrite(self, argv: list[str]) -> list[str]:
        """``argv`` with every ``tcp://*:P`` turned into ``tcp://*:H``."""

        def sub(m: re.Match) -> str:
            port = int(m.group(1))
            if port not in self.host_ports:
                self.host_ports[port] = _free_port()
            return f"tcp://*:{self.host_ports[port]}"

        return [WILDCARD_TCP.sub(sub, a) for a in argv]

    async def serve(self) -> None:
        """Listen on ``pod_ip:P`` for every rewritten port P not yet relayed."""
        for port, host_port in self.host_ports.items():
            if port not in self._servers:
                self._servers[port] = await asyncio.start_server(
                    lambda r, w, h=host_port: self._relay(r, w, h), self.pod_ip, port)

    async def close(self) -> None:
        for server in self._servers.values():
            server.close()
        for task in list(self._pipes):
            task.cancel()
        self._servers.clear()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host_port: int) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", host_port)
        except OSError:   # the engine is not listening (yet): the peer sees a refused connection
            writer.close()
            return
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.get_running_loop().create_task(_pipe(src, dst))
            self._pipes.add(task)
            task.add_done_callback(self._pipes.discard)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            dst.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]
