"""`fleet` commands for SREs: `prometheus-config`, `dashboard`, `rules`, `top`.

Owns their arguments and output; the work is done by `fleet.observability` (scrape, dashboard,
rules, top). Registered on the `fleet` app by `fleet.cli`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fleet.local.state import default_state_dir

_out = Console(width=None if sys.stdout.isatty() else 200, soft_wrap=True)


def _top_console() -> Console:
    """`fleet top`'s output: the terminal's width, or $COLUMNS where set (`COLUMNS=80 fleet top
    --once | less`), else 200 columns."""
    columns = os.environ.get("COLUMNS", "")
    return Console(width=None if sys.stdout.isatty() else int(columns) if columns.isdigit() else 200, soft_wrap=True)
_err = Console(stderr=True)

app = typer.Typer()

StateDir = Annotated[
    Optional[Path],
    typer.Option("--state-dir", envvar="FLEET_STATE_DIR", help="State directory of the local fleet (as for `fleet up`)."),
]
TtftSlo = Annotated[float, typer.Option("--ttft-slo-seconds",
                                        help="TTFT SLO threshold (s): a bucket bound of the router's histogram.")]
TtftObjective = Annotated[float, typer.Option("--ttft-objective", help="Share of requests that must meet it.")]
Availability = Annotated[float, typer.Option("--availability-objective",
                                             help="Share of requests that must be answered without a 5xx.")]


def _slo(ttft_s: float, ttft_objective: float, availability: float):
    from fleet.observability.rules import SLO

    try:
        return SLO(ttft_s, ttft_objective, availability)
    except ValueError as err:
        _err.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None


@app.command("prometheus-config", short_help="Print a prometheus.yml that scrapes the local fleet.")
def prometheus_config(
    state_dir: StateDir = None,
    scrape_interval: Annotated[str, typer.Option(help="Prometheus scrape and rule evaluation interval.")] = "15s",
    rules: Annotated[Optional[Path], typer.Option(help="Rules file to load (see `fleet rules`).")] = None,
) -> None:
    """Print a prometheus.yml that scrapes the local fleet: the router, `fleet up`'s metrics, its
    node agent (GPU health, quarantine) and every engine, found through the file_sd file `fleet up` keeps current in the state directory
    (labels job, deployment, version, replica). Run: `fleet prometheus-config > prometheus.yml &&
    prometheus --config.file=prometheus.yml`."""
    from fleet.observability.discovery import targets_path
    from fleet.observability.scrape import prometheus_config as render

    root = (state_dir or default_state_dir()).resolve()
    sys.stdout.write(render(targets_path(root), scrape_interval=scrape_interval,
                            rule_files=[rules.resolve()] if rules else None))  # fmt: skip


@app.command("dashboard", short_help="Print the Grafana dashboard JSON.")
def dashboard(
    ttft_slo_seconds: TtftSlo = 1.0, ttft_objective: TtftObjective = 0.99, availability_objective: Availability = 0.999,
) -> None:
    """Print the Grafana dashboard JSON (tail latency, SLO burn, replicas, autoscaling, engines, GPU
    health and quarantine); import it in Grafana or load it through the sidecar. Shipped as
    docs/observability/fleet-dashboard.json and charts/fleet/dashboards/fleet-dashboard.json."""
    from fleet.observability.dashboard import render_dashboard

    sys.stdout.write(render_dashboard(_slo(ttft_slo_seconds, ttft_objective, availability_objective)))


@app.command("rules", short_help="Print the Prometheus rules file: SLO recording rules and alerts.")
def rules(
    ttft_slo_seconds: TtftSlo = 1.0, ttft_objective: TtftObjective = 0.99, availability_objective: Availability = 0.999,
    kubernetes: Annotated[bool, typer.Option("--kubernetes", help="Add the cluster-only group (operator down): "
                                             "the chart's copy, charts/fleet/files/fleet-rules.yaml.")] = False,
) -> None:
    """Print the Prometheus rules file: SLO recording rules and multiwindow, multi-burn-rate alerts
    (TTFT and errors), no ready endpoint, replicas failing repeatedly, deployment below desired,
    autoscaler pinned at max, admission queue rejecting, GPUs quarantined, quarantine cap reached,
    target down. Shipped as docs/observability/fleet-rules.yaml."""
    from fleet.observability.rules import render_rules

    sys.stdout.write(render_rules(_slo(ttft_slo_seconds, ttft_objective, availability_objective), kubernetes=kubernetes))


@app.command("top", short_help="Live view of the local fleet: rates, TTFT, TPOT, errors, replicas, rollouts.")
def top(
    state_dir: StateDir = None,
    interval_s: Annotated[float, typer.Option("--interval-s", min=0.2, help="Seconds between refreshes.")] = 2.0,
    window_s: Annotated[float, typer.Option("--window-s", min=1.0, max=600.0,
                                            help="Statistics window of the router (s).")] = 30.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
) -> None:
    """Live view of the local fleet: per deployment and version, request rate, TTFT p50/p99,
    TPOT p99, queue time, errors, replicas by state, last scaling decision and rollout step.
    Reads state.json and the router's /admin/v1/stats. Ctrl-C to leave."""
    from fleet.local.state import StateStore
    from fleet.observability.top import run_top

    store = StateStore(state_dir or default_state_dir())
    try:
        token = store.token_path.read_text().strip()
    except OSError:
        token = ""
    raise typer.Exit(run_top(store.read_or_none, token, where=str(store.root), interval_s=interval_s, window_s=window_s,
                             once=once, console=_top_console()))  # fmt: skip
