"""`fleet operator` as a process: the cluster client, the router admin token, the router pods'
fan-out, /healthz and /metrics, signals, around one `fleet.k8s.operator.Operator`.

Owns `run_operator` (called by `fleet.cli.k8s`) and `serve_health` (the operator's HTTP endpoint:
its own gauges always, the control plane's series while it leads).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
import time
from pathlib import Path

from fleet.k8s.client import PODS, ApiError
from fleet.k8s.informer import Informer
from fleet.k8s.operator import Operator, OperatorSettings

log = logging.getLogger("fleet.k8s.operator")


def _own_namespace() -> str | None:
    try:
        return Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip() or None
    except OSError:
        return None


CONTROLLER_METRICS_EVERY_S = 5.0
"""Seconds a rendering of the controller's series on /metrics is served again (see `serve_health`)."""


async def serve_health(operator: Operator, port: int, controller_metrics_every_s: float = CONTROLLER_METRICS_EVERY_S):
    """/healthz (the process runs; says whether it leads) and /metrics (Prometheus text: the
    operator's own gauges and, while it leads, the autoscaler's `fleet_autoscaler_*` and the
    controller's `fleet_replicas` / `fleet_deployment_*` / `fleet_replica_failures_total` from
    `fleet.observability.discovery.ControllerStateCollector`, the series `fleet up` exports,
    which the chart's dashboard and PrometheusRule read). A standby exports neither the
    autoscaler's nor the controller's series (an operator that lost the Lease would export
    stale ones): summed over operators, they count the leader's once."""
    from aiohttp import web
    from prometheus_client import CollectorRegistry, Gauge, generate_latest

    registry = CollectorRegistry()
    leader = Gauge("fleet_operator_leader", "1 while this operator holds the Lease.", registry=registry)
    ticks = Gauge("fleet_operator_reconcile_ticks", "Reconcile ticks run since start.", registry=registry)
    tick_s = Gauge("fleet_operator_last_reconcile_seconds", "Duration of the last reconcile tick.", registry=registry)
    longest_tick = Gauge("fleet_operator_longest_reconcile_seconds", "Longest reconcile tick since start.",
                         registry=registry)  # fmt: skip
    stall = Gauge("fleet_operator_longest_event_loop_stall_seconds", "Longest time the operator's event loop was "
                  "held (a 0.1 s timer's longest delay) since start.", registry=registry)  # fmt: skip
    renew_gap = Gauge("fleet_operator_longest_lease_renewal_gap_seconds", "Longest time between two renewals of "
                      "the Lease while held, since start (must stay below the renew deadline).", registry=registry)
    events = Gauge("fleet_operator_watch_events", "Watch events handled since start, by informer.", ["informer"],
                   registry=registry)  # fmt: skip
    # The controller's series (fleet_replicas by deployment, version and state: ~20,000 at 1,000
    # deployments, ~0.5 s to render) are rendered off the event loop, at most every
    # CONTROLLER_METRICS_EVERY_S; scrapes in between get that rendering (Prometheus scrapes every
    # 15-30 s). The operator's own series above are always fresh.
    controller_body = {"at_s": float("-inf"), "body": b""}
    rendering = asyncio.Lock()

    async def healthz(request):
        return web.json_response({"ok": True, "leader": operator.elector.holds(), "identity": operator.identity})

    async def metrics(request):
        leader.set(1 if operator.elector.holds() else 0)
        ticks.set(operator.ticks)
        tick_s.set(operator.last_tick_s)
        longest_tick.set(operator.longest_tick_s)
        stall.set(operator.longest_loop_stall_s)
        renew_gap.set(operator.elector.longest_renewal_gap_s)
        for i in operator.informers():
            events.labels(i.name).set(i.events_handled)
        body = generate_latest(registry)
        if operator.controller is not None and operator.elector.holds():
            async with rendering:
                now = time.monotonic()
                if now - controller_body["at_s"] >= controller_metrics_every_s:
                    operator.plane.metrics.update(operator.controller.snapshot())   # on the loop: consistent
                    controller_body["body"] = await asyncio.to_thread(generate_latest, operator.plane.metrics.registry)
                    controller_body["at_s"] = now
            body += controller_body["body"]
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "0.0.0.0", port).start()
    return runner


async def run_operator(settings: OperatorSettings) -> int:
    """`fleet operator` until SIGINT/SIGTERM; returns the exit code (2: no cluster configuration
    or no admin token; 1: the API refused reading or making the token's Secret). The router admin
    token: `fleet.k8s.admin_token.AdminTokenSource` from the environment."""
    from fleet.k8s.admin_token import AdminTokenError, AdminTokenSource
    from fleet.k8s.client import KubeClient
    from fleet.k8s.routers import RouterFanout
    from warmup.client import EngineClient

    logging.basicConfig(level=os.environ.get("FLEET_LOG_LEVEL", "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")  # fmt: skip
    logging.getLogger("httpx").setLevel(logging.WARNING)   # one line per engine probe is noise
    try:
        token_source = AdminTokenSource.from_env(os.environ)
    except AdminTokenError as err:
        log.error("%s", err)
        return 2
    try:
        kube = KubeClient.load()
    except Exception as err:  # noqa: BLE001 - kubernetes.config.ConfigException and file errors
        log.error("no cluster configuration (in-cluster service account or kubeconfig): %s", err)
        return 2
    namespace = settings.namespace or _own_namespace() or "default"
    settings = dataclasses.replace(settings, service_account=settings.service_account or token_source.owner_service_account)
    try:
        token = await token_source.resolve(kube, namespace)
    except (AdminTokenError, ApiError) as err:
        log.error("router admin token: %s", err)
        kube.close()
        return 2 if isinstance(err, AdminTokenError) else 1
    identity = settings.identity or socket.gethostname()
    selector = settings.router_selector if settings.router_selector not in ("", "none") else None
    router_pods = Informer(kube, PODS, namespace, selector, name="router-pods") if selector else None
    fanout = RouterFanout(lambda: list(router_pods.objects.values()) if router_pods else [],
                          settings.router_admin_port, token, static_urls=(settings.router_admin_url,))  # fmt: skip
    engine_api = EngineClient()
    operator = Operator(kube, settings, namespace=namespace, identity=identity, engine_api=engine_api,
                        pool_sink=fanout, router_pods=router_pods)  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    runner = await serve_health(operator, settings.metrics_port) if settings.metrics_port else None

    async def republish_on_new_router() -> None:
        while not stop.is_set():
            if fanout.routers_changed():
                operator.wake.set()   # the tick publishes every pool to it, then marks it synced
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except asyncio.TimeoutError:
                pass

    watcher = loop.create_task(republish_on_new_router())
    log.info("fleet operator %s watching namespace %s", identity, namespace)
    try:
        await operator.run(stop)
    finally:
        watcher.cancel()
        await fanout.aclose()
        await engine_api.aclose()
        if runner is not None:
            await runner.cleanup()
        kube.close()
    return 0
