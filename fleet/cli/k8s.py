"""`fleet crd` and `fleet operator`: Fleet on Kubernetes, from the command line.

Owns the two commands' arguments and help; the work is done by `fleet.k8s.crd` (the CRD from
the pydantic spec), `fleet.k8s.operator` (the operator loop) and `fleet.k8s.routerpod` (the router
pod). Registered on the `fleet` app by `fleet.cli`. The `kubernetes` client is imported only by
`fleet operator`, by `fleet endpoint-picker --lease` and by `fleet router-pod --picker-endpoints`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Optional

import typer

app = typer.Typer()


@app.command("crd")
def crd(
    kube_version: Annotated[Optional[str], typer.Option(
        help="The Kubernetes it is for, MAJOR.MINOR (default: the newest). Before 1.29 the CEL rules' "
        "messages name the values' fields instead of rendering them.")] = None,
) -> None:
    """Print the InferenceDeployment CustomResourceDefinition, generated from Fleet's spec.

    The same YAML file `fleet up` reads is what `kubectl apply` takes once this CRD is
    installed: `fleet crd | kubectl apply --server-side -f -`. The Helm chart ships the same
    text (charts/fleet/files/crd-inferencedeployments*.yaml) and upgrades it with the release.
    """
    from fleet.k8s.crd import crd_yaml

    version = None
    if kube_version:
        major, _, minor = kube_version.removeprefix("v").partition(".")
        if not (major.isdigit() and minor.split(".")[0].isdigit()):
            raise typer.BadParameter(f"{kube_version!r} is not MAJOR.MINOR, e.g. 1.28", param_hint="--kube-version")
        version = (int(major), int(minor.split(".")[0]))
    typer.echo(crd_yaml(version), nl=False)


@app.command("operator")
def operator(
    namespace: Annotated[Optional[str], typer.Option(
        envvar="FLEET_NAMESPACE", help="Namespace to watch and run replicas in (default: the pod's own, "
        "else the kubeconfig context's).")] = None,
    router_admin_url: Annotated[str, typer.Option(
        envvar="FLEET_ROUTER_ADMIN_URL", help="Router admin API base URL, e.g. http://fleet-router-admin:9090; "
        "every router pod behind it gets every pool (see --router-selector).")] = "",
    router_selector: Annotated[str, typer.Option(
        envvar="FLEET_ROUTER_SELECTOR", help="Label selector of the router pods: each one is sent every pool "
        "update. `none`: only --router-admin-url.")] = "app.kubernetes.io/component=router",
    router_admin_port: Annotated[int, typer.Option(envvar="FLEET_ROUTER_ADMIN_PORT",
                                                   help="Admin port of each router pod.")] = 9090,
    identity: Annotated[Optional[str], typer.Option(
        envvar="POD_NAME", help="Leader-election identity (default: the pod name, else the host name).")] = None,
    lease_name: Annotated[str, typer.Option(envvar="FLEET_LEASE_NAME", help="coordination.k8s.io Lease name.")]
    = "fleet-operator",
    resync_s: Annotated[float, typer.Option(help="Seconds between full relists (level-triggered resync).")] = 300.0,
    tick_s: Annotated[float, typer.Option(help="Seconds between reconcile ticks.")] = 1.0,
    engine_image: Annotated[str, typer.Option(
        envvar="FLEET_ENGINE_IMAGE", help="Image of replicas whose spec.engine.image is unset "
        "(Fleet's own image for engine.kind: sim).")] = "",
    metrics_port: Annotated[int, typer.Option(envvar="FLEET_METRICS_PORT",
                                              help="Port of the operator's /metrics and /healthz (0: off).")] = 8081,
    engine_pod_json: Annotated[str, typer.Option(
        envvar="FLEET_ENGINE_POD_JSON", help="Pod settings of every replica as JSON (the chart's engine: values: "
        "runtimeClassName, tolerations, shmSize, extraEnv, migStrategy, ...).")] = "",
    lease_duration_s: Annotated[float, typer.Option(help="Seconds a Lease holder that stopped renewing keeps it "
                                                    "(a standby takes over after that).")] = 15.0,
    renew_deadline_s: Annotated[Optional[float], typer.Option(
        help="Seconds after its last renewal that the holder stops acting; below --lease-duration-s "
        "(default: two thirds of it).")] = None,
    retry_period_s: Annotated[Optional[float], typer.Option(
        help="Seconds between two acquire-or-renew rounds; below --renew-deadline-s (default: 2, or half "
        "the renew deadline when that is shorter).")] = None,
    prices_json: Annotated[str, typer.Option(
        envvar="FLEET_PRICES_JSON", help="GPU prices as JSON (the chart's prices: value; keys as a `fleet "
        "simulate --prices` file: source, gpuHourUsd), exported as fleet_gpu_price_usd_per_hour{product} for "
        "the dashboard's cost row. Empty: none.")] = "",
) -> None:
    """Run the Fleet operator: watch InferenceDeployment resources and run each one's replicas
    as pods, through the same controller `fleet up` uses.

    One pod acts at a time (leader election through a coordination.k8s.io Lease); others wait.
    Reads the in-cluster service account, else the kubeconfig. The router admin token:
    $FLEET_ROUTER_ADMIN_TOKEN, else the Secret $FLEET_ROUTER_ADMIN_SECRET names (made when
    missing: fleet/k8s/admin_token.py). See docs/kubernetes.md.
    """
    import asyncio

    from fleet.k8s.operator import OperatorSettings
    from fleet.k8s.operator_process import run_operator

    settings = OperatorSettings(
        namespace=namespace, router_admin_url=router_admin_url, router_selector=router_selector,
        router_admin_port=router_admin_port, identity=identity, lease_name=lease_name, resync_s=resync_s,
        tick_s=tick_s, engine_image=engine_image, metrics_port=metrics_port, engine_pod_json=engine_pod_json,
    )  # fmt: skip
    deadline_s = renew_deadline_s if renew_deadline_s is not None else lease_duration_s * 2 / 3
    retry_period_s = retry_period_s if retry_period_s is not None else min(2.0, deadline_s / 2)
    settings = replace(settings, renew_deadline_s=deadline_s, retry_period_s=retry_period_s)
    if not 0 < retry_period_s < deadline_s < lease_duration_s:
        typer.echo(f"lease timings: need 0 < --retry-period-s ({retry_period_s:g}) < --renew-deadline-s "
                   f"({deadline_s:g}) < --lease-duration-s ({lease_duration_s:g})", err=True)
        raise typer.Exit(2)
    if prices_json.strip():
        from fleet.pricing import PricesError, prices_from_json

        try:
            prices = prices_from_json(prices_json)
        except PricesError as err:
            typer.echo(f"--prices-json: {err}", err=True)
            raise typer.Exit(2) from None
        settings = replace(settings, prices=tuple(sorted(prices.gpu_hour_usd.items())))
    try:
        from fleet.k8s.pod_settings import EnginePodSettings

        EnginePodSettings.from_json(engine_pod_json)
    except ValueError as err:
        typer.echo(f"--engine-pod-json: {err}", err=True)
        raise typer.Exit(2) from None
    raise typer.Exit(asyncio.run(run_operator(settings)))


@app.command("router-pod", short_help="Run the router as the chart's router pods do (admin API on its own port).")
def router_pod(
    port: Annotated[int, typer.Option(help="Port of the OpenAI API (the public Service's target).")] = 8080,
    admin_port: Annotated[int, typer.Option(help="Port of the admin API (the operator's pool updates).")] = 9090,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    drain_timeout_s: Annotated[Optional[float], typer.Option(
        help="Seconds the requests in flight may take to finish once SIGTERM came (no new connection is "
             "accepted); then they are cut. Keep it under the pod's terminationGracePeriodSeconds less its "
             "preStop sleep (the chart does). Default: router.http.server.DRAIN_TIMEOUT_S (30).")] = None,
    picker: Annotated[str, typer.Option(
        help="HOST:PORT of the endpoint picker every pool asks for its picks (docs/routing.md, 'Endpoint "
             "picker'); the router then follows no KV event stream itself. Empty: none.")] = "",
    picker_endpoints: Annotated[str, typer.Option(
        help="SERVICE:PORT: the endpoint picker is the ready address of this Service's Endpoints (a Service in "
             "the pod's namespace: $POD_NAMESPACE, else the service account's namespace file), read through the "
             "Kubernetes API with the pod's service account (RBAC: get on that Endpoints object) before each "
             "connection and every 2 s while connected; PORT: the picker's port. No cluster DNS or kube-proxy "
             "needed. Instead of --picker. Empty: none.")] = "",
) -> None:
    """Run the router as the chart's router pods do: the OpenAI API on --port, the admin API on
    --admin-port only (404 under /admin on --port). The admin token is read from
    $FLEET_ROUTER_ADMIN_TOKEN."""
    import asyncio
    import os

    from fleet.k8s.routerpod import serve_router_pod
    from fleet.k8s.service_endpoints import parse_endpoints_target
    from router.picker.client import parse_address

    token = os.environ.get("FLEET_ROUTER_ADMIN_TOKEN", "")
    if not token:
        typer.echo("FLEET_ROUTER_ADMIN_TOKEN is not set: the admin API needs a token.", err=True)
        raise typer.Exit(2)
    try:
        picker_at = parse_address(picker) if picker else None
        endpoints = parse_endpoints_target(picker_endpoints) if picker_endpoints else None
        drain = {} if drain_timeout_s is None else {"drain_timeout_s": drain_timeout_s}
        asyncio.run(serve_router_pod(host, port, admin_port, token, picker=picker_at, picker_endpoints=endpoints,
                                     **drain))
    except ValueError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None


@app.command("endpoint-picker")
def endpoint_picker(
    port: Annotated[int, typer.Option(help="Port the routers connect to.")] = 8090,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    metrics_port: Annotated[int | None, typer.Option(help="Port of /metrics, /ready (200 while answering "
                                                     "picks) and /healthz. Default: none.")] = None,
    lease: Annotated[str, typer.Option(help="HA: the coordination.k8s.io/v1 Lease the picker replicas share; "
                                       "only its holder answers picks. Empty: no HA.")] = "",
    namespace: Annotated[str, typer.Option(help="The Lease's namespace (default $POD_NAMESPACE, else the "
                                           "service account's).")] = "",
    identity: Annotated[str, typer.Option(help="This candidate's name in the Lease (default: the host name).")] = "",
    lease_duration_s: Annotated[float, typer.Option(help="Seconds a standby waits on an unrenewed Lease "
                                                    "(client-go's LeaseDuration).")] = 15.0,
    renew_deadline_s: Annotated[float, typer.Option(help="Seconds after its last renewal the holder stops "
                                                    "answering (client-go's RenewDeadline).")] = 10.0,
    retry_period_s: Annotated[float, typer.Option(help="Seconds between two acquire-or-renew rounds "
                                                  "(client-go's RetryPeriod).")] = 2.0,
    log_level: Annotated[str, typer.Option(help="Logging level.")] = "warning",
) -> None:
    """Run the endpoint picker as the chart's picker pods do (`python -m router.picker`): the
    routers started with --picker or --picker-endpoints ask it for every pick (docs/routing.md, 'Endpoint picker').
    With --lease, several replicas run active-passive (fleet/k8s/picker_pod.py)."""
    import asyncio
    import logging

    from fleet.k8s.picker_pod import PickerLease, serve_picker_pod
    from fleet.k8s.service_endpoints import pod_namespace

    logging.basicConfig(level=log_level.upper())
    try:
        held = PickerLease(lease, namespace or pod_namespace(flag="--lease"), identity, lease_duration_s,
                           renew_deadline_s, retry_period_s) if lease else None  # fmt: skip
        asyncio.run(serve_picker_pod(host, port, metrics_port, held))
    except ValueError as err:
        typer.echo(str(err), err=True)
        raise typer.Exit(2) from None
