"""Hollow nodes for the real control plane (fleet/testing/k8s/kube.py), as Kubernetes' kubemark
and kwok make them: Node objects a test registers and keeps Ready, with the capacity a kubelet
and a device plugin would report (fleet/testing/k8s/nodes.py builds them), and no kubelet behind
them. A TEST STAND-IN for nodes: the real scheduler places pods on them, nothing runs the pods.

Owns `heartbeat` (one node's Ready condition kept fresh) and `HollowNodes` (the nodes registered
as themselves, their heartbeats on a thread of their own). Called by
tests/integration/test_real_control_plane.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading

from fleet.k8s.client import NODES, ApiError, KubeClient
from fleet.testing.k8s.kube import RealControlPlane


async def heartbeat(client: KubeClient, name: str, stop: asyncio.Event, interval_s: float = 10.0) -> None:
    """Keep Node ``name``'s Ready condition fresh until ``stop`` is set, as a kubelet's status
    loop does (every ``nodeStatusUpdateFrequency``, 10 s by default): a status patch with
    ``lastHeartbeatTime`` now (``lastTransitionTime`` kept while it stays Ready). ``client``
    should be the node's own identity (``system:node:NAME``), so Node authorization and
    NodeRestriction admit it. A failed patch is tried again at the next beat."""
    while not stop.is_set():
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "hollow node (tests)",
                 "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
        try:
            conditions = (await client.get(NODES, None, name)).get("status", {}).get("conditions", [])
            old = next((c for c in conditions if c["type"] == "Ready"), {})
            if old.get("status") == "True" and old.get("lastTransitionTime"):
                ready["lastTransitionTime"] = old["lastTransitionTime"]
            others = [c for c in conditions if c["type"] != "Ready"]
            await client.patch_status(NODES, None, name, {"status": {"conditions": [*others, ready]}})
        except (ApiError, OSError):
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)


class HollowNodes:
    """``nodes`` (name -> Node object) on ``plane``: a context manager. ``__enter__`` creates each
    Node as that node (``system:node:NAME``, a token ``plane`` was made with) and starts their
    heartbeats on an event loop in a thread of its own, so they go on between a test's calls;
    ``__exit__`` stops them (the Node objects stay). Raises ApiError when a node is refused."""

    def __init__(self, plane: RealControlPlane, nodes: dict[str, dict], interval_s: float = 10.0) -> None:
        self.plane, self.nodes, self.interval_s = plane, nodes, interval_s
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="hollow-nodes", daemon=True)
        self._error: BaseException | None = None

    def __enter__(self) -> HollowNodes:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    async def _run(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        clients = {name: self.plane.client(self.plane.tokens[f"system:node:{name}"]) for name in self.nodes}
        try:
            try:
                for name, obj in self.nodes.items():
                    await clients[name].create(NODES, None, obj)
            except BaseException as err:  # noqa: BLE001 - handed to __enter__
                self._error = err
                return
            finally:
                self._started.set()
            await asyncio.gather(*(heartbeat(c, n, self._stop, self.interval_s) for n, c in clients.items()))
        finally:
            for c in clients.values():
                c.close()
