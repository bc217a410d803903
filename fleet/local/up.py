"""`fleet up` and `fleet down`: run deployments on this machine until told to stop, survive
the controller's own crash, and stop everything in order.

Owns the embedded runtime: the pre-flight checks run once (`fleet.local.preflight`: nothing
starts unless every deployment can), taking over from a previous controller on the same state
directory (its router and its replicas are adopted, not restarted:
`fleet.controller.reconcile.Controller.start`), the router process and its supervision
(`fleet.local.routerproc`: restarted, with every pool published again, if it dies), the control
channel (`fleet.local.control`: `fleet apply`, `fleet rollout`), the node agent's thread and its
/metrics (a target of its own in the file_sd file, `fleet.observability.discovery`), the
controller loop, the autoscaler loop run as a task, the control plane's Prometheus endpoint,
progress output (`fleet.local.progress`), signal handling and the orderly shutdown (pools
drained, in-flight requests finished, engines stopped, router last). The controller, the
autoscaler loop and the metrics are built by `fleet.control_plane.ControlPlane`, the assembly the
operator uses too; this module hands it the local backend, the router's admin API and the state
store. `run_down` is `fleet down` for a fleet whose
controller is gone: it adopts what still runs and shuts it down the same way. Called by
`fleet.cli`.

Fails soft (docs/crash-safety.md, "When the control plane cannot write"): its output, its log
and every record it writes go through `fleet.local.failsoft` (counted, backed off, never raised);
only SIGINT/SIGTERM drains; any other failure ends `fleet up` and leaves the data plane serving.
A state file that cannot be read is taken over from the other records (`fleet.local.rebuild`).

What outlives what: engines and the router run in their own sessions and do not die with the
controller. A `fleet up` that is killed (or crashes) leaves them serving, with the pools they
had; the next `fleet up` on the same state directory adopts them; `fleet status` shows them
while no controller runs and `fleet down` stops them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import start_http_server
from rich.console import Console

from fleet.agent.cache import WeightCache, default_cache_root
from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy
from fleet.agent.runner import NodeAgent, local_health_checker, serve as serve_agent
from fleet.control_plane import ControlPlane, ControlPlaneMetrics
from fleet.controller.arrival_history import ARRIVAL_HISTORY_FILE, FileHistoryStore
from fleet.controller.autoscaling import AutoscalerLoop
from fleet.controller.reconcile import Controller, ControllerSettings, ReplicaEvent
from fleet.inventory import NodeInventory, discover_local
from fleet.local.backend import LocalBackend
from fleet.local.control import ControlServer
from fleet.local.failsoft import WRITE_ERRORS, FailSoftStream, WriteErrors, same_file
from fleet.local.preflight import preflight
from fleet.local.progress import ProgressPrinter
from fleet.local.rebuild import pooled_endpoint_ids, rebuild_snapshot
from fleet.local.routerproc import PickerProcess, RouterProcess, RouterStartError, marked_router, recorded_url, \
    stop_recorded_picker
from fleet.local.state import StateStore, StateUnreadable
from fleet.observability.discovery import LocalObservability
from fleet.rollout.metrics import RolloutCollector
from fleet.spec import LoadedDeployment
from warmup.client import EngineClient

log = logging.getLogger("fleet.local.up")

AGENT_INTERVAL_S = 30.0
"""How often the node agent checks GPU health in `fleet up` (Xid events are drained every second between)."""

ROUTER_CHECK_INTERVAL_S = 0.25
"""How often `fleet up` checks that the router process still runs (a dead router is restarted)."""


async def _supervise_router(router: RouterProcess, controller: Controller, stop: asyncio.Event,
                            progress: ProgressPrinter, picker: PickerProcess | None = None) -> None:  # fmt: skip
    """Restart the router whenever its process is gone and have every pool published again, then
    tell the router it is synced (`POST /admin/v1/synced`: until then it answers 503 + Retry-After
    for the models it served, not 404); write its record and token once the disk takes them
    (`RouterProcess.persist`). Never raises before ``stop``: whatever a check raises is logged and
    the next check comes (the supervisor outlives its parts, as the controller loop does). The
    endpoint picker, when there is one, is restarted the same way (the router reconnects to it)."""
    synced = False                 # the router in use was told it has every pool
    seen_starts = router.starts
    while not stop.is_set():
        try:
            if picker is not None and await picker.ensure_running():
                progress.say(f"endpoint picker restarted on {picker.address} (restart {picker.restarts})",
                             style="yellow")  # fmt: skip
            if await router.ensure_running():
                progress.say(f"router restarted on {router.url} (restart {router.restarts}); pools published again",
                             style="yellow")  # fmt: skip
        except RouterStartError as err:
            progress.say(f"router did not restart: {err}", style="bold red")
        except Exception:  # noqa: BLE001 - the supervisor survives its parts
            log.exception("router supervisor: the check failed (again in %.0f s)", ROUTER_CHECK_INTERVAL_S)
        if router.starts != seen_starts:   # a started router knows no pool (also one whose start timed out)
            controller.forget_published_pools()
            controller.wake()
            seen_starts, synced = router.starts, False
        try:
            router.persist()
            if not synced and router.admin is not None and controller.pools_published():
                await router.admin.mark_synced()
                synced = True
        except Exception as err:  # noqa: BLE001 - told again at the next check
            log.warning("router supervisor: %s", err)
        try:   # sooner while the router waits for its pools
            await asyncio.wait_for(stop.wait(), timeout=ROUTER_CHECK_INTERVAL_S if synced else 0.2)
        except asyncio.TimeoutError:
            pass


@dataclass
class _Machine:
    """What `fleet up` makes on this machine before the pre-flight checks; none of it runs yet:
    the node's inventory, the weight cache, the node agent (None without NVIDIA GPUs, and why),
    the local backend and the router process (adopted when a previous controller left one)."""

    node: NodeInventory
    weights: WeightCache
    agent: NodeAgent | None
    agent_off: str | None
    backend: LocalBackend
    router: RouterProcess
    adopting_router: bool
    picker: PickerProcess | None = None

    @classmethod
    def make(cls, store: StateStore, host: str, port: int, picker_port: int | None = None,
             picker_metrics_port: int | None = None) -> _Machine:  # fmt: skip
        node = discover_local()
        weights = WeightCache(default_cache_root())
        agent, agent_off = _node_agent(node, weights, store)
        backend = LocalBackend(store.root, store.fleet_id(), node, weights=weights, agent=agent,
                               write_errors=store.write_errors)  # fmt: skip
        if agent is not None:
            agent.serving = backend.gpu_replicas   # the usage series' deployment / replica labels
        router = RouterProcess(store, host, port)
        picker = PickerProcess(store, host, picker_port, metrics_port=picker_metrics_port) if picker_port else None
        router.picker = picker.address if picker is not None else None
        return cls(node, weights, agent, agent_off, backend, router, router.recorded() is not None, picker)

    def ports(self, host: str, port: int, metrics_port: int | None) -> dict[str, tuple[str, int]]:
        """The ports `fleet up` will listen on (an adopted router's is in use already)."""
        ports = {} if self.adopting_router else {"router": (host, port)}
        if self.picker is not None and not self.adopting_router:
            ports["picker"] = (host, self.picker.port)
            if self.picker.metrics_port:
                ports["picker metrics"] = (host, self.picker.metrics_port)
        if metrics_port:
            ports["metrics"] = (host, metrics_port)
        return ports


async def run_up(
    loaded: list[LoadedDeployment],
    *,
    store: StateStore,
    console: Console,
    host: str = "127.0.0.1",
    port: int = 8080,
    metrics_port: int | None = None,
    settings: ControllerSettings | None = None,
    fail_soft_output: bool = True,
    prices: dict[str, float] | None = None,
    picker_port: int | None = None,
    picker_metrics_port: int | None = None,
) -> int:
    """Serve ``loaded`` until SIGINT/SIGTERM; return the process exit code.

    Takes over from a previous controller of ``store`` when there was one (its router and
    replicas are adopted); when its state file cannot be read, from what the other records say
    (`fleet.local.rebuild`). ``metrics_port``: where the control plane's Prometheus metrics are
    served (on ``host``; None or 0: not served). ``fail_soft_output``: stdout and stderr are
    replaced by `fleet.local.failsoft.FailSoftStream` while it runs (a copy goes to
    ``logs/fleet-up.log``, the log of `fleet logs controller`). ``prices``: USD per GPU-hour by
    product (`fleet.pricing.GpuPrices.gpu_hour_usd`), exported with the controller's metrics.
    ``picker_port``: run the endpoint picker there (on ``host``) and have the router ask it
    (`fleet.local.routerproc.PickerProcess`); None: the router picks alone. ``picker_metrics_port``:
    where the picker serves ``/metrics`` (a ``fleet-picker`` target in the file_sd file); None: not
    served.

    Only SIGINT/SIGTERM (Ctrl-C, `fleet down`) drains and stops the replicas and the router. A
    failure of the control plane itself (an exception that escapes despite the fail-soft writes)
    ends this process with 1 and leaves them serving, for the next `fleet up` to adopt.

    Raises:
        fleet.local.preflight.PreflightError: when any deployment cannot run here (nothing has been
            started).
        fleet.local.state.AlreadyRunning: when another `fleet up` holds the state directory.
    """
    store.acquire()
    try:
        try:
            previous, unreadable = store.read(), None
        except StateUnreadable as err:
            previous, unreadable = None, err
        machine = _Machine.make(store, host, port, picker_port, picker_metrics_port)
        preflight(loaded, await machine.backend.inventory(), machine.ports(host, port, metrics_port))
    except BaseException:
        store.release()
        raise
    restore_output = (_fail_soft_output(store.write_errors, store.log_dir / "fleet-up.log") if fail_soft_output
                      else (lambda: None))  # fmt: skip
    up = _Up(loaded, machine, store, console, host=host, metrics_port=metrics_port, settings=settings, prices=prices)
    try:
        return await up.serve(previous, unreadable)
    finally:
        await up.close()
        restore_output()


class _Up:
    """One `fleet up` on a `_Machine` that passed the pre-flight checks: `serve` starts the router,
    the node agent and the control plane (`fleet.control_plane.ControlPlane`), runs the controller
    loop until SIGINT/SIGTERM and drains; `close` stops what must stop and releases the state
    directory."""

    def __init__(self, loaded: list[LoadedDeployment], machine: _Machine, store: StateStore, console: Console, *,
                 host: str, metrics_port: int | None, settings: ControllerSettings | None,
                 prices: dict[str, float] | None) -> None:  # fmt: skip
        self.loaded = loaded
        self.machine = machine
        self.router = machine.router
        self.store = store
        self.console = console
        self.host = host
        self.metrics_port = metrics_port
        self.settings = settings
        self.prices = prices
        self.clock = time.monotonic
        self.progress = ProgressPrinter(console, self.clock)
        self.engine_api = EngineClient()
        self.stop = asyncio.Event()
        self.asked = asyncio.Event()     # SIGINT/SIGTERM: the one way to drain and stop the data plane
        self.interrupted = False         # KeyboardInterrupt or cancellation before the handlers were in place
        self.agent_stop = threading.Event()
        self.servers: list[ThreadingHTTPServer] = []   # the metrics and node agent endpoints
        self.controller: Controller | None = None

    async def serve(self, previous: dict | None, unreadable: StateUnreadable | None) -> int:
        """Start, run until SIGINT/SIGTERM, drain; 0, or 1 when the router would not start or the
        control plane failed (the data plane keeps serving)."""
        try:
            self._announce()
            if not await self._start_router():
                return 1
            if unreadable is not None:
                self.console.print(f"[bold yellow]{unreadable}[/]: taking over from replicas.json, the engines' "
                                   "fleet-id markers and the router's pools", highlight=False)  # fmt: skip
                previous = await _rebuild(self.loaded, self.machine.backend, self.router, self.store, self.clock())
            agent_url = self._start_node_agent()
            plane = self._control_plane()
            self.controller = controller = plane.controller(self.loaded)
            await controller.start(previous)
            _never_reuse_ids(controller, self.store)
            adopted = [r.id for r in controller.replicas.values() if r.adopted_at_s is not None and r.engine_alive]
            if adopted:
                self.console.print(f"Adopted {len(adopted)} running replica(s) of the previous controller: "
                                   f"{', '.join(adopted)}", highlight=False)  # fmt: skip
            _install_signal_handlers(self.stop, self.asked, self.console, controller)
            observability = self._serve_metrics(plane.metrics, agent_url)
            tasks = self._start_tasks(plane.autoscaler(controller))
            self.store.set_extra(phase="running")
            await controller.run(self.stop, interval_s=1.0, after_tick=lambda: self._after_tick(observability))
            for task, result in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True)):
                if isinstance(result, BaseException):   # each returns once `stop` is set; none should raise
                    log.error("%s ended with %r", task.get_name(), result)
            self.console.print("Draining: replicas leave the router, in-flight requests finish, engines stop...")
            self.store.set_extra(phase="stopping")
            await controller.shutdown()
            observability.stopped()  # Prometheus: nothing left to scrape
            return 0
        except Exception as err:
            if self.asked.is_set():
                raise
            log.exception("fleet up failed")
            self.console.print(f"[bold red]fleet up failed: {err!r}.[/] The router and the engines keep serving; "
                               "`fleet up` again adopts them, `fleet down` stops them.", highlight=False)  # fmt: skip
            return 1
        except BaseException:
            self.interrupted = True
            raise

    def _announce(self) -> None:
        m = self.machine
        self.store.set_extra(pid=os.getpid(), router_url=self.router.url, phase="starting",
                             log_dir=str(self.store.log_dir))  # fmt: skip
        self.console.print(f"Node: {m.node.describe()}", highlight=False)
        self.console.print(f"State and logs: {self.store.root}; weight cache: {m.weights.root}", highlight=False)
        self.console.print(f"Node agent: GPU health checks {'on' if m.agent else f'off ({m.agent_off})'}",
                           highlight=False)  # fmt: skip

    async def _start_router(self) -> bool:
        """Adopt the router a previous controller left, else start one; False when it would not start."""
        router, picker = self.router, self.machine.picker
        try:
            if picker is not None and not picker.adopt():
                await picker.start()
                metrics = f", metrics on {picker.metrics_url}/metrics" if picker.metrics_url else ""
                self.console.print(f"Endpoint picker listening on {picker.address}{metrics} (log: {picker.log_path})",
                                   highlight=False)  # fmt: skip
        except RouterStartError as err:
            self.console.print(f"[red]{err}[/]", highlight=False)
            return False
        if self.machine.adopting_router and await router.adopt():
            self.console.print(f"Router adopted on {router.url} (pid {router.record.pid}): it kept serving",
                               highlight=False)  # fmt: skip
            return True
        try:
            await router.start()
        except RouterStartError as err:
            self.console.print(f"[red]{err}[/]", highlight=False)
            return False
        self.console.print(f"Router listening on {router.url} (log: {router.log_path})", highlight=False)
        return True

    def _start_node_agent(self) -> str | None:
        """Run the node agent on its thread and serve its /metrics (a target of its own, job
        fleet-node-agent, as the DaemonSet's pod is on Kubernetes; any free port); its URL, or
        None without an agent."""
        agent = self.machine.agent
        if agent is None:
            return None
        agent.on_decision = lambda d: self.progress.say(f"{d.target:<20} {d.action.upper()}: {d.reason}",
                                                        style="bold yellow")  # fmt: skip
        threading.Thread(target=_supervised_thread, args=(agent.run, (AGENT_INTERVAL_S, self.agent_stop),
                                                          self.agent_stop, "node agent"),
                         name="node-agent", daemon=True).start()  # fmt: skip
        server = serve_agent(agent, self.host, 0)
        self.servers.append(server)
        url = f"http://{self.host}:{server.server_address[1]}"
        self.console.print(f"Node agent metrics (GPU health, quarantine) on {url}/metrics", highlight=False)
        return url

    def _control_plane(self) -> ControlPlane:
        """The controller's and autoscaler's inputs on this machine (`fleet.control_plane`)."""
        admin = self.router.admin
        return ControlPlane(
            backend=self.machine.backend, engine_api=self.engine_api, pool_sink=admin, analysis_source=admin,
            stats_source=admin, state_sink=self.store, clock=self.clock, settings=self.settings,
            history=FileHistoryStore(self.store.root / ARRIVAL_HISTORY_FILE), metrics=ControlPlaneMetrics(self.prices),
            on_event=self._on_event, on_decision=self.progress.decision,
            on_rollout_event=lambda name, line: self.progress.say(f"{name:<20} ROLLOUT {line}", style="bold blue"),
        )  # fmt: skip

    def _on_event(self, e: ReplicaEvent) -> None:
        self.store.append_event({"replica": e.replica_id, "deployment": e.deployment,
                                 "from": e.old.value if e.old else None, "to": e.new.value, "detail": e.detail})
        self.progress.event(e)
        if e.new.failed() and self.controller is not None:
            self.progress.failure_details(self.controller, e)

    def _serve_metrics(self, metrics: ControlPlaneMetrics, agent_url: str | None) -> LocalObservability:
        """Add `fleet up`'s own series to the control plane's registry (rollouts, failed writes),
        serve it on ``metrics_port`` when set, and keep the file_sd file that points Prometheus at
        it (`fleet.observability.discovery.LocalObservability`)."""
        host, port = self.host, self.metrics_port
        metrics.registry.register(RolloutCollector(self.controller))   # fleet_rollout_* (fleet.rollout.metrics)
        metrics.registry.register(self.store.write_errors)   # fleet_control_write_errors_total (fleet.local.failsoft)
        if port:
            server, _ = start_http_server(port, addr=host, registry=metrics.registry)
            self.servers.append(server)
            self.console.print(f"Controller, autoscaler and rollout metrics on http://{host}:{port}/metrics",
                               highlight=False)  # fmt: skip
        picker = self.machine.picker
        return LocalObservability(self.store.root, self.router.url, port and f"http://{host}:{port}",
                                  node_agent_url=agent_url, collector=metrics.controller_state,
                                  write_errors=self.store.write_errors,
                                  picker_url=picker.metrics_url if picker is not None else None)  # fmt: skip

    def _start_tasks(self, autoscaler: AutoscalerLoop | None) -> list[asyncio.Task]:
        """The router's supervisor, the control channel (`fleet apply`, `fleet rollout`) and the
        autoscaler when one is built, each restarted should it fail (`_keep_running`)."""
        controller, stop = self.controller, self.stop
        assert controller is not None
        control = ControlServer(self.store.root, controller, self.progress.say, self.store.write_errors)
        loops = {"router-supervisor": ("router supervisor",
                                       lambda: _supervise_router(self.router, controller, stop, self.progress,
                                                                 self.machine.picker)),
                 "control": ("control channel", lambda: control.run(stop))}  # fmt: skip
        if autoscaler is not None:
            loops["autoscaler"] = ("autoscaler", lambda: autoscaler.run(stop))
        loop = asyncio.get_running_loop()
        return [loop.create_task(_keep_running(what, run, stop), name=name) for name, (what, run) in loops.items()]

    def _after_tick(self, observability: LocalObservability) -> None:
        assert self.controller is not None
        self.progress.tick(self.controller, self.router.url)
        try:
            observability.tick(self.controller.snapshot())
        except WRITE_ERRORS as err:
            self.store.write_errors.failed("observability", err)

    async def close(self) -> None:
        """Stop the loops, the node agent and the HTTP servers; after SIGINT/SIGTERM (or an
        interrupt) the router and every engine too, else leave them serving; record the phase
        and the last snapshot; release the state directory."""
        teardown = self.asked.is_set() or self.interrupted
        self.stop.set()
        self.agent_stop.set()
        agent, router, store = self.machine.agent, self.router, self.store
        if agent is not None and agent.checker is not None:
            agent.checker.reader.close()
        for server in self.servers:
            server.shutdown()
            server.server_close()
        if teardown:
            await router.stop()
            if self.machine.picker is not None:
                await self.machine.picker.stop()
            self.machine.backend.kill_all()   # belt and braces: nothing started by this fleet outlives an orderly stop
        elif router.admin is not None:
            await router.admin.aclose()   # the router keeps serving
        await self.engine_api.aclose()
        store.set_extra(phase="stopped" if teardown else "exited")
        if self.controller is not None:
            store.save(self.controller.snapshot(), force=True)
        store.release()
        self.console.print("Stopped." if teardown else "Exited; the router and engines still run.")


async def run_down(store: StateStore, console: Console, settings: ControllerSettings | None = None) -> int:
    """`fleet down` when no controller runs: adopt the engines and router a dead controller left
    behind, drain and stop the engines, stop the router. Works from whatever survives: when
    ``state.json`` cannot be read, from the replica records, the engines' and the router's
    markers and ``router.json`` (`fleet.local.rebuild`); a router that does not answer its admin
    API is stopped all the same. Returns 0 when all is stopped, 1 when nothing was left, 3 when
    the router process would not stop.

    Raises fleet.local.state.AlreadyRunning when a controller holds the state directory after all.
    """
    store.acquire()
    try:
        try:
            state, unreadable = store.read() or {}, None
        except StateUnreadable as err:
            state, unreadable = {}, err
            console.print(f"[yellow]{err}[/]: stopping what replicas.json, router.json and the processes' "
                          "fleet-id markers name", highlight=False)  # fmt: skip
        errors = store.write_errors
        backend = LocalBackend(store.root, store.fleet_id(), discover_local(), weights=WeightCache(default_cache_root()),
                               write_errors=errors)  # fmt: skip
        url = state.get("router_url") or recorded_url(store.root) or (marked_router(store.root) or ("",))[0]
        where = urlsplit(url)
        router = RouterProcess(store, where.hostname or "127.0.0.1", where.port or 0)
        router_record = router.recorded()
        router_answers = router_record is not None and await router.adopt()
        if router_record is not None and not router_answers:
            router.record = router_record   # stopped at the end even though its admin API does not answer
            console.print(f"The router (pid {router_record.pid}) does not answer as this fleet's: engines stop "
                          "without a drain through it; it is stopped too", highlight=False)  # fmt: skip
        if backend.live_process_count() == 0 and router_record is None:
            return 1
        engine_api = EngineClient()
        controller = ControlPlane(backend=backend, engine_api=engine_api, clock=time.monotonic, state_sink=store,
                                  pool_sink=router.admin if router_answers else _NoRouter(),
                                  settings=settings).controller([])  # fmt: skip
        previous = state if unreadable is None else await _rebuild([], backend, router if router_answers else None,
                                                                    store, time.monotonic())  # fmt: skip
        await controller.start(previous)
        console.print(f"No controller runs; stopping what it left: {backend.live_process_count()} engine(s)"
                      f"{' and the router' if router_record is not None else ''}...", highlight=False)  # fmt: skip
        await controller.shutdown(interval_s=0.2)
        gone = router.record
        await router.stop()
        await stop_recorded_picker(store)
        await engine_api.aclose()
        store.set_extra(phase="stopped", router_url=url or None, pid=state.get("pid"))
        store.save(controller.snapshot(), force=True)
        left = marked_router(store.root)
        if (gone is not None and router.processes.is_ours(gone)) or left is not None:
            console.print(f"[bold red]The router (pid {gone.pid if gone else left[1]}) is still running[/]",
                          highlight=False)  # fmt: skip
            return 3
        return 0
    finally:
        store.release()


async def _rebuild(loaded: list[LoadedDeployment], backend: LocalBackend, router: RouterProcess | None,
                   store: StateStore, now_s: float) -> dict:  # fmt: skip
    """The snapshot to take over from when state.json is unreadable (`fleet.local.rebuild`):
    the backend's records and markers, the router's pools (when it answers), the replica numbers."""
    facts = await backend.observe()
    pools = None
    if router is not None and router.admin is not None and router.record is not None:
        try:
            pools = await router.admin.pools()
        except Exception as err:  # noqa: BLE001 - unknown: every adopted replica warms again
            log.warning("cannot read the router's pools: %s", err)
    snapshot = rebuild_snapshot(loaded, facts, backend.placements(), pooled_endpoint_ids(pools),
                                store.replica_numbers(), now_s)  # fmt: skip
    log.warning("rebuilt state: %d running replica(s), %d in the router's pools", len(snapshot["replicas"]),
                sum(1 for r in snapshot["replicas"] if r.get("warmup_passed_at_s") is not None))  # fmt: skip
    return snapshot


def _never_reuse_ids(controller: Controller, store: StateStore) -> None:
    """Replica numbering continues after every number used in this state directory (also when
    state.json was lost: `StateStore.replica_numbers`)."""
    numbers = store.replica_numbers()
    for name, ds in controller.deployments.items():
        ds.next_index = max(ds.next_index, numbers.get(name, 0))


def _fail_soft_output(errors: WriteErrors, log_path: Path) -> Callable[[], None]:
    """Replace stdout and stderr with fail-soft streams (`FailSoftStream`) that copy every line
    to ``log_path`` unless they already write there (`fleet up --detach`). Returns the undo."""
    saved = sys.stdout, sys.stderr
    streams = []
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if same_file(fd, log_path):
            streams.append(FailSoftStream(fd, "log", errors))
        else:
            streams.append(FailSoftStream(fd, name, errors, tee=log_path))
    sys.stdout, sys.stderr = streams

    def restore() -> None:
        sys.stdout, sys.stderr = saved
        for stream in streams:
            stream.close()

    return restore


async def _keep_running(what: str, run: Callable[[], Awaitable[None]], stop: asyncio.Event,
                        delay_s: float = 1.0) -> None:  # fmt: skip
    """Await ``run()`` until it returns (each loop returns once ``stop`` is set); if it raises,
    log and start it again ``delay_s`` later: a supervisor that restarts itself."""
    while not stop.is_set():
        try:
            await run()
            return
        except Exception:  # noqa: BLE001 - the loop is started again
            log.exception("%s failed: restarting it in %.0f s", what, delay_s)
        try:
            await asyncio.wait_for(stop.wait(), timeout=delay_s)
        except asyncio.TimeoutError:
            pass


def _supervised_thread(run: Callable, args: tuple, stop: threading.Event, what: str, delay_s: float = 5.0) -> None:
    """Run ``run(*args)`` until ``stop`` is set, starting it again ``delay_s`` after it raised."""
    while not stop.is_set():
        try:
            run(*args)
            return
        except Exception:  # noqa: BLE001 - the supervisor restarts what it supervises
            log.exception("%s failed: restarting it in %.0f s", what, delay_s)
            stop.wait(delay_s)


def _node_agent(node, weights: WeightCache, store: StateStore) -> tuple[NodeAgent | None, str | None]:
    """This machine's node agent when it has NVIDIA GPUs (health checks, quarantine; status in
    ``<state dir>/node-agent.json`` for `fleet status`), else (None, why not)."""
    if not node.gpus:
        return None, "no NVIDIA GPU"
    checker, why = local_health_checker(node.name, time.time)
    if checker is None:
        return None, why
    agent = NodeAgent(node.name, checker, QuarantinePolicy(QuarantineConfig(), time.time), time.time, cache=weights,
                      status_path=store.root / "node-agent.json")  # fmt: skip
    return agent, None


class _NoRouter:
    """Pool sink when the router is gone too (`fleet down` of an orphaned fleet): nothing to
    publish, nothing in flight."""

    async def put_pool(self, model, pool) -> None:
        return None

    async def delete_pool(self, model) -> None:
        return None

    async def in_flight(self) -> dict[str, int]:
        return {}


def _install_signal_handlers(stop: asyncio.Event, asked: asyncio.Event, console: Console,
                             controller: Controller) -> None:  # fmt: skip
    loop = asyncio.get_running_loop()
    presses = {"n": 0}

    def on_signal(signum: int) -> None:
        presses["n"] += 1
        if presses["n"] == 1:
            asked.set()
            console.print(f"\n{signal.Signals(signum).name}: shutting down (again to force)...")
            stop.set()
            controller.wake()
        else:
            console.print("Forcing: killing every replica now.")
            loop.create_task(controller.kill_all())

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
