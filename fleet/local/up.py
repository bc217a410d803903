"""`fleet up` and `fleet down`: run deployments on this machine until told to stop, survive
the controller's own crash, and stop everything in order.

Owns the embedded runtime: preflight checks (run once; nothing starts unless every deployment
can), taking over from a previous controller on the same state directory (its router and its
replicas are adopted, not restarted: `fleet.controller.reconcile.Controller.start`), the router process
and its supervision (`fleet.local.routerproc`: restarted, with every pool published again, if it
dies), the controller loop, the control channel (`fleet.local.control`: `fleet apply`, `fleet rollout`),
the autoscaler loop (`fleet.controller.autoscaling`) and its Prometheus
endpoint, the node agent's thread and its /metrics (a target of its own in the file_sd file,
`fleet.observability.discovery`), progress output, signal handling and the orderly shutdown (pools drained, in-flight
requests finished, engines stopped, router last). `run_down` is `fleet down` for a fleet whose
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
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

from prometheus_client import start_http_server
from rich.console import Console

from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import Direction, ScalingDecision
from fleet.controller.arrival_history import ARRIVAL_HISTORY_FILE, FileHistoryStore
from fleet.controller.autoscaling import AutoscalerLoop
from fleet.agent.cache import WeightCache, default_cache_root
from fleet.agent.quarantine import QuarantineConfig, QuarantinePolicy
from fleet.models.memory import EngineArgError, MemoryNeed
from fleet.models.read import ModelSourceError, memory_need
from fleet.agent.runner import NodeAgent, local_health_checker, serve as serve_agent
from fleet.sources import SourceError, parse_source
from fleet.local.backend import REMOTE_SCHEMES, LocalBackend
from fleet.local.control import ControlServer
from fleet.controller.reconcile import Controller, ControllerSettings, ReplicaEvent
from fleet.engines.kinds import ModelUnavailable, get_engine
from fleet.inventory import Inventory, discover_local
from fleet.controller.lifecycle import ReplicaStatus
from fleet.observability.discovery import LocalObservability
from fleet.placement import PlacementRequest, get_strategy
from fleet.rollout.metrics import RolloutCollector
from fleet.local.failsoft import WRITE_ERRORS, FailSoftStream, WriteErrors, same_file
from fleet.local.rebuild import pooled_endpoint_ids, rebuild_snapshot
from fleet.local.routerproc import RouterProcess, RouterStartError, marked_router, recorded_url
from fleet.spec import LoadedDeployment
from fleet.local.state import StateStore, StateUnreadable
from warmup.client import EngineClient

log = logging.getLogger("fleet.local.up")

_STYLE = {
    ReplicaStatus.READY: "bold green",
    ReplicaStatus.STANDBY: "cyan",
    ReplicaStatus.DRAINING: "yellow",
    ReplicaStatus.TERMINATED: "dim",
}

AGENT_INTERVAL_S = 30.0
"""How often the node agent checks GPU health in `fleet up` (Xid events are drained every second between)."""

ROUTER_CHECK_INTERVAL_S = 0.25
"""How often `fleet up` checks that the router process still runs (a dead router is restarted)."""


class PreflightError(Exception):
    """A deployment cannot run on this machine; ``problems`` lists why, one per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None. Binds with SO_REUSEADDR, as the
    router's server (uvicorn) does, so sockets in TIME-WAIT after a previous run do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            return f"{host}:{port} is not free: {err.strerror}"
    return None


def _local_memory_need(ld: LoadedDeployment) -> MemoryNeed | None:
    """What one replica of ``ld`` needs per GPU (`fleet.models`), for weights on this machine; None
    for remote sources (not fetched yet) or a model whose config cannot be read."""
    if ld.deployment.spec.model.source.startswith(REMOTE_SCHEMES):
        return None
    try:
        return memory_need(ld.deployment, ld.base_dir)
    except (ModelSourceError, EngineArgError):
        return None


def preflight(loaded: list[LoadedDeployment], inventory: Inventory, ports: dict[str, tuple[str, int]]) -> None:
    """Check everything that would make `fleet up` half-start: each deployment's engine is
    installed, its weights are present and a replica fits the inventory (and, for weights on this
    machine, a GPU of it holds the model: `fleet.models.memory.MemoryNeed`; and a GPU node's NVIDIA
    driver can run the engine's CUDA: `fleet.placement.compat`); each named port
    (``{"router": (host, port)}``) is free. Raises PreflightError listing every problem."""
    problems = []
    placer = get_strategy()
    for ld in loaded:
        dep = ld.deployment
        where = f"{ld.path}[{ld.index}] ({dep.name})"
        engine = get_engine(dep.spec.engine.kind)
        problem = engine.preflight()
        if problem:
            problems.append(f"{where} spec.engine.kind: {problem}")
        if dep.spec.model.source.startswith(REMOTE_SCHEMES):   # fetched into the weight cache at start
            try:
                parse_source(dep.spec.model.source, ld.base_dir)
            except SourceError as err:
                problems.append(f"{where} spec.model.source: {err}")
        else:
            try:
                engine.model_argument(dep.engine_launch(ld.base_dir))
            except ModelUnavailable as err:
                problems.append(f"{where} spec.model.source: {err}")
        request = PlacementRequest.for_deployment(dep, 1, memory=_local_memory_need(ld))   # driver/CUDA too
        unfit = placer.fits_at_all(request.shape, inventory, memory=request.memory, cuda=request.cuda)
        if unfit is not None:
            problems.append(f"{where} spec.resources: cannot place a replica on this machine: {unfit.reason}")
    for what, (host, port) in ports.items():
        problem = port_problem(host, port)
        if problem:
            problems.append(f"{what} port {problem}")
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

    def say(self, text: str, style: str = "") -> None:
        self.console.print(f"{time.strftime('%H:%M:%S')} {text}", style=style, highlight=False)

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
        self.console.print(f"    last engine log lines ({r.detail.get('log', '-')}):", style="dim", highlight=False)
        for line in r.failure.log_tail[-8:]:
            self.console.print(f"    | {line}", style="dim", highlight=False, markup=False)

    def tick(self, controller: Controller, router_url: str) -> None:
        now = self.clock()
        for r in controller.replicas.values():
            status = r.status
            if status not in (ReplicaStatus.PENDING, ReplicaStatus.PULLING, ReplicaStatus.CACHING,
                              ReplicaStatus.STARTING, ReplicaStatus.WARMING):
                continue
            if now - self._last_note_s.get(r.id, now) >= self.every_s:
                self._last_note_s[r.id] = now
                since_s = now - (r.launched_at_s or r.created_at_s)
                log_path = r.detail.get("log")
                where = f" (log: {log_path})" if log_path and status is ReplicaStatus.STARTING else ""
                if status is ReplicaStatus.CACHING:
                    where = f": {r.detail.get('cache', '')}"
                self.say(f"{r.id:<20} still {status.value} after {since_s:.0f} s{where}", style="dim")
        want = 0 if controller.stopping else sum(ds.desired for ds in controller.deployments.values())
        ready = sum(1 for r in controller.replicas.values() if r.status is ReplicaStatus.READY)
        if want and ready == want and not self._all_ready_said:
            self._all_ready_said = True
            self.console.print(
                f"[bold green]All {ready} replica(s) READY.[/] OpenAI API: {router_url}/v1  "
                "(Ctrl-C or `fleet down` to stop)", highlight=False,
            )
        elif ready < want:
            self._all_ready_said = False


async def _supervise_router(router: RouterProcess, controller: Controller, stop: asyncio.Event,
                            progress: ProgressPrinter) -> None:  # fmt: skip
    """Restart the router whenever its process is gone and have every pool published again, then
    tell the router it is synced (`POST /admin/v1/synced`: until then it answers 503 + Retry-After
    for the models it served, not 404); write its record and token once the disk takes them
    (`RouterProcess.persist`). Never raises before ``stop``: whatever a check raises is logged and
    the next check comes (the supervisor outlives its parts, as the controller loop does)."""
    synced = False                 # the router in use was told it has every pool
    seen_starts = router.starts
    while not stop.is_set():
        try:
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
) -> int:
    """Serve ``loaded`` until SIGINT/SIGTERM; return the process exit code.

    Takes over from a previous controller of ``store`` when there was one (its router and
    replicas are adopted); when its state file cannot be read, from what the other records say
    (`fleet.local.rebuild`). ``metrics_port``: where the autoscaler's Prometheus metrics are
    served (on ``host``; None or 0: not served). ``fail_soft_output``: stdout and stderr are
    replaced by `fleet.local.failsoft.FailSoftStream` while it runs (a copy goes to
    ``logs/fleet-up.log``, the log of `fleet logs controller`). ``prices``: USD per GPU-hour by
    product (`fleet.pricing.GpuPrices.gpu_hour_usd`), exported with the controller's metrics.

    Only SIGINT/SIGTERM (Ctrl-C, `fleet down`) drains and stops the replicas and the router. A
    failure of the control plane itself (an exception that escapes despite the fail-soft writes)
    ends this process with 1 and leaves them serving, for the next `fleet up` to adopt.

    Raises:
        PreflightError: when any deployment cannot run here (nothing has been started).
        fleet.local.state.AlreadyRunning: when another `fleet up` holds the state directory.
    """
    store.acquire()
    errors = store.write_errors
    unreadable: StateUnreadable | None = None
    try:
        try:
            previous = store.read()
        except StateUnreadable as err:
            previous, unreadable = None, err
        node = discover_local()
        weights = WeightCache(default_cache_root())
        agent, agent_off = _node_agent(node, weights, store)
        backend = LocalBackend(store.root, store.fleet_id(), node, weights=weights, agent=agent, write_errors=errors)
        if agent is not None:
            agent.serving = backend.gpu_replicas   # the usage series' deployment / replica labels
        router = RouterProcess(store, host, port)
        adopting_router = router.recorded() is not None
        ports = {} if adopting_router else {"router": (host, port)}
        if metrics_port:
            ports["metrics"] = (host, metrics_port)
        preflight(loaded, await backend.inventory(), ports)
    except BaseException:
        store.release()
        raise
    restore_output = _fail_soft_output(errors, store.log_dir / "fleet-up.log") if fail_soft_output else (lambda: None)
    clock = time.monotonic
    store.set_extra(pid=os.getpid(), router_url=router.url, phase="starting", log_dir=str(store.log_dir))
    console.print(f"Node: {node.describe()}", highlight=False)
    console.print(f"State and logs: {store.root}; weight cache: {weights.root}", highlight=False)
    console.print(f"Node agent: GPU health checks {'on' if agent else f'off ({agent_off})'}", highlight=False)
    agent_stop = threading.Event()
    metrics_server = agent_server = None
    engine_api = EngineClient()
    stop = asyncio.Event()
    asked = asyncio.Event()        # SIGINT/SIGTERM: the one way to drain and stop the data plane
    interrupted = False            # KeyboardInterrupt or cancellation before the handlers were in place
    controller: Controller | None = None
    try:
        if adopting_router and await router.adopt():
            console.print(f"Router adopted on {router.url} (pid {router.record.pid}): it kept serving",
                          highlight=False)  # fmt: skip
        else:
            try:
                await router.start()
            except RouterStartError as err:
                console.print(f"[red]{err}[/]", highlight=False)
                return 1
            console.print(f"Router listening on {router.url} (log: {router.log_path})", highlight=False)
        if unreadable is not None:
            console.print(f"[bold yellow]{unreadable}[/]: taking over from replicas.json, the engines' fleet-id "
                          "markers and the router's pools", highlight=False)  # fmt: skip
            previous = await _rebuild(loaded, backend, router, store, clock())

        progress = ProgressPrinter(console, clock)
        if agent is not None:
            agent.on_decision = lambda d: progress.say(f"{d.target:<20} {d.action.upper()}: {d.reason}",
                                                       style="bold yellow")  # fmt: skip
            threading.Thread(target=_supervised_thread, args=(agent.run, (AGENT_INTERVAL_S, agent_stop), agent_stop,
                                                              "node agent"), name="node-agent", daemon=True).start()  # fmt: skip
            # Its own target (job fleet-node-agent), as the DaemonSet's pod is on Kubernetes; any free port.
            agent_server = serve_agent(agent, host, 0)
            console.print(f"Node agent metrics (GPU health, quarantine) on http://{host}:"
                          f"{agent_server.server_address[1]}/metrics", highlight=False)  # fmt: skip

        def on_event(e: ReplicaEvent) -> None:
            store.append_event({"replica": e.replica_id, "deployment": e.deployment,
                                "from": e.old.value if e.old else None, "to": e.new.value, "detail": e.detail})  # fmt: skip
            progress.event(e)
            if e.new.failed():
                progress.failure_details(controller, e)

        controller = Controller(
            loaded, backend=backend, engine_api=engine_api, pool_sink=router.admin, clock=clock,
            state_sink=store, settings=settings, on_event=on_event, analysis_source=router.admin,
            on_rollout_event=lambda name, line: progress.say(f"{name:<20} ROLLOUT {line}", style="bold blue"),
        )
        await controller.start(previous)
        _never_reuse_ids(controller, store)
        adopted = [r.id for r in controller.replicas.values() if r.adopted_at_s is not None and r.engine_alive]
        if adopted:
            console.print(f"Adopted {len(adopted)} running replica(s) of the previous controller: {', '.join(adopted)}",
                          highlight=False)  # fmt: skip
        _install_signal_handlers(stop, asked, console, controller)
        loop = asyncio.get_running_loop()
        control = ControlServer(store.root, controller, progress.say, errors)   # `fleet apply`, `fleet rollout`
        tasks = [loop.create_task(_keep_running("router supervisor", lambda: _supervise_router(
                     router, controller, stop, progress), stop), name="router-supervisor"),
                 loop.create_task(_keep_running("control channel", lambda: control.run(stop), stop),
                                  name="control")]  # fmt: skip
        autoscaler_metrics = AutoscalerMetrics()
        autoscaler_metrics.registry.register(RolloutCollector(controller))   # fleet_rollout_* (fleet.rollout.metrics)
        autoscaler_metrics.registry.register(errors)   # fleet_control_write_errors_total (fleet.local.failsoft)
        observability = LocalObservability(
            store.root, router.url, metrics_port and f"http://{host}:{metrics_port}", registry=autoscaler_metrics.registry,
            node_agent_url=agent_server and f"http://{host}:{agent_server.server_address[1]}", prices=prices)  # fmt: skip
        if metrics_port:
            metrics_server, _ = start_http_server(metrics_port, addr=host, registry=autoscaler_metrics.registry)
            console.print(f"Controller, autoscaler and rollout metrics on http://{host}:{metrics_port}/metrics",
                          highlight=False)  # fmt: skip
        if any(ld.deployment.spec.autoscaling is not None for ld in loaded):
            autoscaler = AutoscalerLoop(controller, router=router.admin, engine_api=engine_api, clock=clock,
                                        metrics=autoscaler_metrics, on_decision=progress.decision,
                                        history=FileHistoryStore(store.root / ARRIVAL_HISTORY_FILE))  # fmt: skip
            tasks.append(loop.create_task(_keep_running("autoscaler", lambda: autoscaler.run(stop), stop),
                                          name="autoscaler"))  # fmt: skip
        store.set_extra(phase="running")

        def after_tick() -> None:
            progress.tick(controller, router.url)
            try:
                observability.tick(controller.snapshot())
            except WRITE_ERRORS as err:
                errors.failed("observability", err)

        await controller.run(stop, interval_s=1.0, after_tick=after_tick)
        for task, result in zip(tasks, await asyncio.gather(*tasks, return_exceptions=True)):
            if isinstance(result, BaseException):   # each returns once `stop` is set; none should raise
                log.error("%s ended with %r", task.get_name(), result)
        console.print("Draining: replicas leave the router, in-flight requests finish, engines stop...")
        store.set_extra(phase="stopping")
        await controller.shutdown()
        observability.stopped()  # Prometheus: nothing left to scrape
        return 0
    except Exception as err:
        if asked.is_set():
            raise
        log.exception("fleet up failed")
        console.print(f"[bold red]fleet up failed: {err!r}.[/] The router and the engines keep serving; "
                      "`fleet up` again adopts them, `fleet down` stops them.", highlight=False)  # fmt: skip
        return 1
    except BaseException:
        interrupted = True
        raise
    finally:
        teardown = asked.is_set() or interrupted
        stop.set()
        agent_stop.set()
        if agent is not None and agent.checker is not None:
            agent.checker.reader.close()
        for server in (metrics_server, agent_server):
            if server is not None:
                server.shutdown()
                server.server_close()
        if teardown:
            await router.stop()
            backend.kill_all()   # belt and braces: nothing started by this fleet outlives an orderly stop
        elif router.admin is not None:
            await router.admin.aclose()   # the router keeps serving
        await engine_api.aclose()
        store.set_extra(phase="stopped" if teardown else "exited")
        if controller is not None:
            store.save(controller.snapshot(), force=True)
        store.release()
        console.print("Stopped." if teardown else "Exited; the router and engines still run.")
        restore_output()


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
        controller = Controller([], backend=backend, engine_api=engine_api, pool_sink=router.admin
                                if router_answers else _NoRouter(), clock=time.monotonic,
                                state_sink=store, settings=settings)  # fmt: skip
        previous = state if unreadable is None else await _rebuild([], backend, router if router_answers else None,
                                                                    store, time.monotonic())  # fmt: skip
        await controller.start(previous)
        console.print(f"No controller runs; stopping what it left: {backend.live_process_count()} engine(s)"
                      f"{' and the router' if router_record is not None else ''}...", highlight=False)  # fmt: skip
        await controller.shutdown(interval_s=0.2)
        gone = router.record
        await router.stop()
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
