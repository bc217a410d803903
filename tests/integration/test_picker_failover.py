"""Integration: the endpoint picker's HA failover (fleet/k8s/picker_pod.py, router/picker/) with two
real `fleet endpoint-picker --lease` processes, as the chart runs them (router.picker.ha), sharing a
coordination.k8s.io/v1 Lease on the HTTP STAND-IN for the API server (fleet/testing/k8s/apiserver.py;
not a cluster), under the chart's own picker Role (the stand-in enforces it). The picker Service is
stood in for by a TCP forwarder that sends each new connection to the picker whose `/ready` answered
200 at its last probe (every second: the chart's readinessProbe periodSeconds 1, failureThreshold 1),
as the Service's Endpoints hold the Ready pod alone. A router's client (`router.picker.client`) asks
for picks under load; the leader is killed with SIGKILL; then the new leader is stopped with SIGTERM
(it gives the Lease up). Measured: the time from each fault until picks are answered again, and the
picks that failed (none may: the router picks alone meanwhile). The figures are printed (docs/routing.md,
"Endpoint picker", HA)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq.asyncio

from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.rbac import Authorizer
from fleet.testing.k8s.resources import by_kind
from router.kv.prompt_blocks import RouteRequest
from router.picker.client import PickerClient
from tests.support.helm import helm_binary, render
from tests.support.waits import async_wait_until
from tests.unit.test_kv_subscriber import Publisher, stored   # the subscriber's unit file's engine stand-in

REPO = Path(__file__).resolve().parents[2]
NS = "fleet"
PROBE_PERIOD_S = 1.0
HA_VALUES = ("--set", "router.picker.enabled=true", "--set", "router.picker.ha.enabled=true")
pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(helm_binary() is None, reason="helm not installed: run `bash .ci/helm.sh`")]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Picker:
    """One `fleet endpoint-picker --lease fleet-picker` process (a picker pod's container)."""

    def __init__(self, work: Path, kubeconfig: Path, identity: str, namespace: str) -> None:
        self.identity = identity
        self.namespace = namespace
        self.work = work
        self.kubeconfig = kubeconfig
        self.port, self.metrics_port = _free_port(), _free_port()
        self.proc: subprocess.Popen | None = None
        self.log = work / f"picker-{identity}.log"

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}  # fmt: skip
        args = [sys.executable, "-m", "fleet.cli", "endpoint-picker", "--host", "127.0.0.1", "--port", str(self.port),
                "--metrics-port", str(self.metrics_port), "--lease", "fleet-picker", "--namespace", self.namespace,
                "--identity", self.identity, "--log-level", "info"]  # fmt: skip
        self.proc = subprocess.Popen(args, env=env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)  # fmt: skip

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)

    async def kv_live(self, http: httpx.AsyncClient, blocks: int) -> bool:
        """Whether every KV stream of this picker is live with `blocks` blocks in its view."""
        try:
            text = (await http.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=0.5)).text
        except httpx.HTTPError:
            return False
        live = [line for line in text.splitlines() if line.startswith("fleet_picker_kv_stream_live{")]
        held = [line for line in text.splitlines() if line.startswith("fleet_picker_kv_index_blocks{")]
        return len(live) == 2 and all(line.endswith(" 1.0") for line in live) and \
            all(line.endswith(f" {float(blocks)}") for line in held)

    async def ready(self, http: httpx.AsyncClient) -> bool:
        try:
            return (await http.get(f"http://127.0.0.1:{self.metrics_port}/ready", timeout=0.5)).status_code == 200
        except httpx.HTTPError:
            return False


class ServiceStandIn:
    """The picker Service: each new connection goes to the picker Ready at the last probe. While
    none is Ready it refuses connections, as a Service without endpoints does (kube-proxy's
    REJECT). `both_ready`: probes that found two pickers Ready at once (must stay 0)."""

    def __init__(self, pickers: list[Picker]) -> None:
        self.pickers = pickers
        self.ready: Picker | None = None
        self.both_ready = 0
        self.port = _free_port()
        self._task: asyncio.Task | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        async with httpx.AsyncClient() as http:
            while True:
                ready = [p for p in self.pickers if await p.ready(http)]
                self.both_ready += len(ready) > 1
                self.ready = ready[0] if len(ready) == 1 else None
                if self.ready is None and self._server is not None:
                    self._server.close()
                    self._server = None
                elif self.ready is not None and self._server is None:
                    self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port,
                                                              reuse_address=True)  # fmt: skip
                await asyncio.sleep(PROBE_PERIOD_S)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target = self.ready
        try:
            if target is None:
                raise OSError("no picker Ready")
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target.port)
        except OSError:
            writer.close()
            return

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._server is not None:
            self._server.close()


class PickLoad:
    """Picks asked without pause through `client` (each a router's request's first pick): answered,
    fell back (the router picked alone), failed (raised); the time of each answered pick."""

    def __init__(self, client: PickerClient) -> None:
        self.client = client
        self.answered = self.fell_back = 0
        self.failed: list[str] = []
        self.answered_at_s: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _run(self) -> None:
        request = RouteRequest(block_hashes=(1, 2), prompt_tokens=128, token_ids=list(range(128)))
        while not self._stop.is_set():
            try:
                _, ticket, answered = await self.client.pick("m", ["e0", "e1"], request, lambda: 0)
            except Exception as err:  # noqa: BLE001 - a failed request, counted
                self.failed.append(f"{type(err).__name__}: {err}")
                continue
            if answered:
                self.answered += 1
                self.answered_at_s.append(time.monotonic())
                assert ticket is not None
                ticket.finish()
            else:
                self.fell_back += 1
            await asyncio.sleep(0.005)   # about 150 picks a second

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def answered_after(self, t_s: float, what: str) -> float:
        """Seconds from `t_s` until a pick is answered again (waits up to 60 s)."""
        await async_wait_until(lambda: self.answered_at_s and self.answered_at_s[-1] > t_s + 0.05, 60.0,
                               what=what)  # fmt: skip
        return next(t for t in self.answered_at_s if t > t_s + 0.05) - t_s


def kubeconfig_for(path: Path, url: str, token: str, ca_file: Path | None = None) -> Path:
    """A kubeconfig at `path`: the API server at `url` (its CA: `ca_file`), the bearer `token`."""
    cluster = {"server": url, **({"certificate-authority": str(ca_file)} if ca_file else {})}
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "picker",
        "clusters": [{"name": "standin", "cluster": cluster}],
        "users": [{"name": "picker", "user": {"token": token}}],
        "contexts": [{"name": "picker", "context": {"cluster": "standin", "user": "picker", "namespace": NS}}]}))
    return path


async def failover(work: Path, kubeconfig: Path, namespace: str = NS) -> dict[str, float | str]:
    """The scenario (module docstring) with the pickers reading the Lease in `namespace` through
    `kubeconfig`; their logs under `work`. Returns the figures (seconds; counts; `leader`: the
    picker leading at the end, the first leader restarted) once checked:
    no pick failed, never two pickers Ready at once, failover times within their bounds. Also
    run on the real control plane (tests/integration/test_real_control_plane.py)."""
    pickers = [Picker(work, kubeconfig, "picker-a", namespace), Picker(work, kubeconfig, "picker-b", namespace)]
    service = ServiceStandIn(pickers)
    client = PickerClient("127.0.0.1", 0, deadline_s=0.05)
    load = PickLoad(client)
    ctx = zmq.asyncio.Context()
    engines = [Publisher(ctx), Publisher(ctx)]   # each engine's KV events, its whole history in its buffer

    def logs() -> str:
        return "\n".join(f"--- {p.identity}\n{p.log.read_text(errors='replace')[-3000:]}" for p in pickers
                         if p.log.exists())  # fmt: skip

    try:
        for p in pickers:
            p.start()
        await service.start()
        client.port = service.port
        client.put_pool("m", "kv-aware", {f"e{i}": e.source.model_dump() for i, e in enumerate(engines)})
        client.start()
        await async_wait_until(lambda: service.ready is not None and client.connected, 60.0,
                               what="one picker leading and the router connected to it", explain=logs)  # fmt: skip
        for i, engine in enumerate(engines):
            await engine.subscribed()
            for n in range(20):
                await engine.publish(stored(10_000 * i + 100 * n, 10))
        async with httpx.AsyncClient() as http:
            await async_wait_until(lambda: service.ready is not None and service.ready.kv_live(http, 200), 30.0,
                                   what="the leader's views hold both engines' 200 blocks", explain=logs)  # fmt: skip
        load.start()
        await async_wait_until(lambda: load.answered >= 50, 30.0, what="picks answered", explain=logs)
        leader = service.ready
        assert leader is not None
        standby = next(p for p in pickers if p is not leader)

        killed_at_s = time.monotonic()
        leader.signal(signal.SIGKILL)
        kill_failover_s = await load.answered_after(killed_at_s, "picks answered again after the leader's kill -9")
        assert service.ready is standby
        async with httpx.AsyncClient() as http:   # the standby was sent no pool: its views rebuild on takeover
            await async_wait_until(lambda: standby.kv_live(http, 200), 30.0, interval_s=0.05, explain=logs,
                                   what="the new leader's views rebuilt from the engines' replay")  # fmt: skip
        rebuilt_s = time.monotonic() - killed_at_s - kill_failover_s
        leader.start()   # as the kubelet restarts the container: it comes back a standby
        answered = load.answered
        await async_wait_until(lambda: load.answered >= answered + 50, 30.0, what="picks flowing", explain=logs)

        stopped_at_s = time.monotonic()
        standby.signal(signal.SIGTERM)   # an orderly stop: the Lease is given up
        stop_failover_s = await load.answered_after(stopped_at_s, "picks answered again after SIGTERM of the leader")
        await async_wait_until(lambda: service.ready is leader, 10.0, what="the restarted picker leading")
        await load.stop()
        figures = {"leader": leader.identity, "kill_failover_s": kill_failover_s, "rebuilt_s": rebuilt_s,
                   "stop_failover_s": stop_failover_s, "answered": load.answered, "fell_back": load.fell_back,
                   "failed": len(load.failed)}  # fmt: skip
        print(f"picker failover: kill -9 {kill_failover_s:.1f} s (views rebuilt {rebuilt_s:.2f} s after), SIGTERM "
              f"{stop_failover_s:.1f} s; picks answered {load.answered}, fell back {load.fell_back}, failed "
              f"{len(load.failed)}")  # fmt: skip
        assert load.failed == [] and service.both_ready == 0
        # the Lease is client-go's 15 s: a standby takes over a lease duration after the last renewal it
        # saw, then within a retry period; the probe period; the router's reconnect backoff (<= 2 s)
        assert 10.0 < kill_failover_s < 15.0 + 2.0 + PROBE_PERIOD_S + 2.0 + 3.0, kill_failover_s
        assert stop_failover_s < 2.0 + PROBE_PERIOD_S + 2.0 + 3.0, stop_failover_s
        return figures
    finally:
        await load.stop()
        await client.close()
        await service.close()
        for p in pickers:
            if p.proc is not None and p.proc.poll() is None:
                p.signal(signal.SIGKILL)
                p.proc.wait(10)
        for engine in engines:
            await engine.close()
        ctx.destroy(linger=0)


async def test_picks_fail_over_to_the_standby_with_none_failed(tmp_path):
    api = APIServerStandIn()
    api.authorizer = Authorizer(api.store)
    for obj in render(extra=HA_VALUES):
        if obj["kind"] in ("Role", "RoleBinding"):
            api.store.create(by_kind(obj["apiVersion"], obj["kind"]), obj["metadata"].get("namespace"), obj)
    await api.start()
    try:
        token = api.authorizer.service_account_token(NS, "fleet-picker")
        await failover(tmp_path, kubeconfig_for(tmp_path / "kubeconfig", api.url, token))
        assert api.authorizer.denied == []   # the chart's Role admits everything the pickers ask
    finally:
        await api.stop()
