"""`fleet up`: run deployments on this machine until interrupted, then drain and stop all.

Owns the embedded runtime: preflight checks (nothing starts unless every deployment can), the
router process, the controller loop, the autoscaler loop (`fleet.autoscaling`, for deployments
with `spec.autoscaling`) and its Prometheus endpoint, progress output, signal handling and the
orderly shutdown (pool removal, in-flight drain, SIGTERM, SIGKILL after grace, router last).
Called by `fleet.cli`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

from prometheus_client import start_http_server
from rich.console import Console

from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import Direction, ScalingDecision
from fleet.autoscaling import AutoscalerLoop
from fleet.backends.base import LaunchError, LaunchSpec, ProcessHandle
from fleet.backends.local import LocalBackend
from fleet.controller import Controller, ControllerSettings, ReplicaEvent
from fleet.engines import ModelUnavailable, get_engine
from fleet.inventory import Inventory, NodeInventory, discover_local
from fleet.lifecycle import ReplicaStatus
from fleet.observability.discovery import LocalObservability
from fleet.placement import ReplicaShape, get_strategy
from fleet.router_admin import RouterAdminClient
from fleet.spec import LoadedDeployment
from fleet.state import StateStore
from warmup.client import EngineClient

_STYLE = {
    ReplicaStatus.READY: "bold green",
    ReplicaStatus.DRAINING: "yellow",
    ReplicaStatus.TERMINATED: "dim",
}


class PreflightError(Exception):
    """A deployment cannot run on this machine; ``problems`` lists why, one per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def preflight(loaded: list[LoadedDeployment], node: NodeInventory, router_host: str, router_port: int,
              metrics_port: int | None = None) -> None:  # fmt: skip
    """Check everything that would make `fleet up` half-start. Raises PreflightError."""
    problems = []
    placer = get_strategy()
    inventory = Inventory((node,))
    for ld in loaded:
        dep = ld.deployment
        where = f"{ld.path}[{ld.index}] ({dep.name})"
        engine = get_engine(dep.spec.engine.kind)
        problem = engine.preflight()
        if problem:
            problems.append(f"{where} spec.engine.kind: {problem}")
        try:
            engine.model_argument(dep, ld.base_dir)
        except ModelUnavailable as err:
            problems.append(f"{where} spec.model.source: {err}")
        unfit = placer.fits_at_all(ReplicaShape.of(dep), inventory)
        if unfit is not None:
            problems.append(f"{where} spec.resources: cannot place a replica on this machine: {unfit.reason}")
    ports = [("router", router_port)] + ([("metrics", metrics_port)] if metrics_port else [])
    for what, port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((router_host, port))
            except OSError as err:
                problems.append(f"{what} port {router_host}:{port} is not free: {err.strerror}")
    if problems:
        raise PreflightError(problems)


class ProgressPrinter:
    """Prints each replica transition, and a reminder every ``every_s`` for slow phases."""

    def __init__(self, console: Console, clock, every_s: float = 15.0) -> None:
        self.console = console
        self.clock = clock
        self.every_s = every_s
        self._last_note_s: dict[str, float] = {}
        self._all_ready_said = False

    def event(self, e: ReplicaEvent) -> None:
        style = "bold red" if e.new.failed() else _STYLE.get(e.new, "cyan")
        self.console.print(
            f"{time.strftime('%H:%M:%S')} {e.replica_id:<20} [{style}]{e.new.value:<16}[/] {e.detail}",
            highlight=False,
        )
        self._last_note_s[e.replica_id] = e.at_s

    def decision(self, deployment: str, d: ScalingDecision) -> None:
        """One line per scale-up or scale-down decision (holds are logged, not printed)."""
        if d.direction is Direction.HOLD:
            return
        style = "bold magenta" if d.direction is Direction.UP else "magenta"
        self.console.print(
            f"{time.strftime('%H:%M:%S')} {deployment:<20} [{style}]SCALE {d.direction.value.upper():<10}[/] "
            f"{d.previous} -> {d.desired} replica(s): {d.reason}: {d.detail}",
            highlight=False,
        )

    def failure_details(self, controller: Controller, e: ReplicaEvent) -> None:
        r = controller.replicas.get(e.replica_id)
        if r is None or r.failure is None or not r.failure.log_tail:
            return
        self.console.print(f"    last engine log lines ({r.log_path}):", style="dim", highlight=False)
        for line in r.failure.log_tail[-8:]:
            self.console.print(f"    | {line}", style="dim", highlight=False, markup=False)

    def tick(self, controller: Controller, router_url: str) -> None:
        now = self.clock()
        for r in controller.replicas.values():
            status = r.status
            if status not in (ReplicaStatus.PENDING, ReplicaStatus.STARTING, ReplicaStatus.WARMING):
                continue
            if now - self._last_note_s.get(r.id, now) >= self.every_s:
                self._last_note_s[r.id] = now
                since_s = now - (r.launched_at_s or r.created_at_s)
                where = f" (log: {r.log_path})" if r.log_path and status is ReplicaStatus.STARTING else ""
                self.console.print(
                    f"{time.strftime('%H:%M:%S')} {r.id:<20} still {status.value} after {since_s:.0f} s{where}",
                    style="dim", highlight=False,
                )
        want = sum(ds.desired for ds in controller.deployments.values())
        ready = sum(1 for r in controller.replicas.values() if r.status is ReplicaStatus.READY)
        if want and ready == want and not self._all_ready_said:
            self._all_ready_said = True
            self.console.print(
                f"[bold green]All {ready} replica(s) READY.[/] OpenAI API: {router_url}/v1  "
                "(Ctrl-C or `fleet down` to stop)", highlight=False,
            )
        elif ready < want:
            self._all_ready_said = False


async def _wait_router(admin: RouterAdminClient, backend: LocalBackend, handle: ProcessHandle, timeout_s: float) -> str | None:
    """None when the router answers /health; else why not."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = backend.poll(handle)
        if code is not None:
            tail = "\n".join(backend.log_tail(handle, 15))
            return f"router exited with code {code}:\n{tail}"
        if await admin.healthy():
            return None
        await asyncio.sleep(0.2)
    return f"router did not answer /health within {timeout_s:g} s"


async def run_up(
    loaded: list[LoadedDeployment],
    *,
    store: StateStore,
    console: Console,
    host: str = "127.0.0.1",
    port: int = 8080,
    metrics_port: int | None = None,
    settings: ControllerSettings | None = None,
) -> int:
    """Serve ``loaded`` until SIGINT/SIGTERM; return the process exit code.

    ``metrics_port``: where the autoscaler's Prometheus metrics are served (on ``host``; None
    or 0: not served). Deployments with `spec.autoscaling` are scaled by `AutoscalerLoop`.

    Raises:
        PreflightError: when any deployment cannot run here (nothing has been started).
        fleet.state.AlreadyRunning: when another `fleet up` holds the state directory.
    """
    node = discover_local()
    preflight(loaded, node, host, port, metrics_port)
    store.acquire()
    backend = LocalBackend()
    clock = time.monotonic
    router_url = f"http://{host}:{port}"
    token = store.new_admin_token()
    store.set_extra(pid=os.getpid(), router_url=router_url, phase="starting", log_dir=str(store.log_dir))
    console.print(f"Node: {node.describe()}", highlight=False)
    console.print(f"State and logs: {store.root}", highlight=False)
    router_handle = None
    metrics_server = None
    admin = RouterAdminClient(router_url, token)
    engine_api = EngineClient()
    try:
        try:
            router_handle = backend.launch(LaunchSpec(
                replica_id="router",
                argv=[sys.executable, "-m", "router", "--host", host, "--port", str(port)],
                env={"FLEET_ROUTER_ADMIN_TOKEN": token},
                port=port,
                log_path=store.log_dir / "router.log",
            ))
        except LaunchError as err:
            console.print(f"[red]cannot start the router: {err}[/]")
            return 1
        problem = await _wait_router(admin, backend, router_handle, timeout_s=30.0)
        if problem:
            console.print(f"[red]{problem}[/]", highlight=False)
            return 1
        console.print(f"Router listening on {router_url} (log: {store.log_dir / 'router.log'})", highlight=False)

        progress = ProgressPrinter(console, clock)
        controller: Controller

        def on_event(e: ReplicaEvent) -> None:
            progress.event(e)
            if e.new.failed():
                progress.failure_details(controller, e)

        controller = Controller(
            loaded, backend=backend, engine_api=engine_api, pool_sink=admin, node=node, clock=clock,
            state_sink=store, settings=settings, on_event=on_event, log_dir=store.log_dir,
        )
        stop = asyncio.Event()
        _install_signal_handlers(stop, console, controller)
        autoscaler_task = None
        autoscaler_metrics = AutoscalerMetrics()
        observability = LocalObservability(store.root, router_url, metrics_port and f"http://{host}:{metrics_port}",
                                           registry=autoscaler_metrics.registry)  # fmt: skip
        if metrics_port:
            metrics_server, _ = start_http_server(metrics_port, addr=host, registry=autoscaler_metrics.registry)
            console.print(f"Controller and autoscaler metrics on http://{host}:{metrics_port}/metrics", highlight=False)
        if any(ld.deployment.spec.autoscaling is not None for ld in loaded):
            autoscaler = AutoscalerLoop(controller, router=admin, engine_api=engine_api, clock=clock,
                                        metrics=autoscaler_metrics, on_decision=progress.decision)  # fmt: skip
            autoscaler_task = asyncio.get_running_loop().create_task(autoscaler.run(stop), name="autoscaler")
        store.set_extra(phase="running")
        await controller.run(stop, interval_s=1.0, after_tick=lambda: (
            progress.tick(controller, router_url), observability.tick(controller.snapshot())))
        if autoscaler_task is not None:
            await autoscaler_task  # returns once `stop` is set: no new target during the drain
        console.print("Draining: replicas leave the router, in-flight requests finish, engines stop...")
        store.set_extra(phase="stopping")
        await controller.shutdown()
        return 0
    finally:
        if metrics_server is not None:
            metrics_server.shutdown()
            metrics_server.server_close()
        if router_handle is not None:
            backend.stop(router_handle)
            for _ in range(50):
                if backend.poll(router_handle) is not None:
                    break
                await asyncio.sleep(0.1)
            else:
                backend.kill(router_handle)
                backend.poll(router_handle)
        for pid in backend.live_pids():  # belt and braces: nothing outlives `fleet up`
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await admin.aclose()
        await engine_api.aclose()
        store.set_extra(phase="stopped")
        state = store.read() or {}
        store.save({k: v for k, v in state.items() if k not in ("updated_at_unix",)})
        store.release()
        console.print("Stopped.")


def _install_signal_handlers(stop: asyncio.Event, console: Console, controller: Controller) -> None:
    loop = asyncio.get_running_loop()
    presses = {"n": 0}

    def on_signal(signum: int) -> None:
        presses["n"] += 1
        if presses["n"] == 1:
            console.print(f"\n{signal.Signals(signum).name}: shutting down (again to force)...")
            stop.set()
            controller.wake()
        else:
            console.print("Forcing: killing every replica now.")
            controller.kill_all()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
