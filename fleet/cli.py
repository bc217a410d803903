"""The `fleet` command line (typer + rich).

Owns argument parsing, help texts and the rendering of results; the work is done by
`fleet.spec` (validate), `fleet.up` (up), `fleet.state` (status, down) and `router.server`
(router).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from fleet.spec import SpecError, load_deployments
from fleet.state import AlreadyRunning, StateStore, default_state_dir

app = typer.Typer(
    name="fleet",
    help="Fleet: place, warm, route and scale LLM inference replicas (vLLM) from a deployment YAML.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
# Off a terminal (pipes, CI logs) rich would wrap at 80 columns; replica lines and tables are wider.
console = Console(width=None if sys.stdout.isatty() else 160, soft_wrap=True)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160, soft_wrap=True)

StateDir = Annotated[
    Optional[Path],
    typer.Option(
        "--state-dir", envvar="FLEET_STATE_DIR",
        help="Where `fleet up` keeps state and engine logs. Default: $XDG_STATE_HOME/fleet or ~/.local/state/fleet.",
    ),
]
Files = Annotated[list[Path], typer.Argument(help="Deployment YAML files; each may hold several documents.")]


def _load(files: list[Path]):
    try:
        return load_deployments(files)
    except SpecError as err:
        err_console.print(f"[bold red]Invalid deployment spec ({len(err.problems)} problem(s)):[/]")
        for line in err.problems:
            err_console.print(f"  {line}", markup=False, highlight=False)
        raise typer.Exit(2) from None


@app.command()
def validate(files: Files) -> None:
    """Check deployment files without starting anything.

    Every problem is reported with its file, document index, field path and reason, e.g.
    `quickstart.yaml[0] spec.replicas.min: must be <= spec.replicas.max (3 > 2)`.
    Exit code 0 when all documents are valid, 2 otherwise.
    """
    loaded = _load(files)
    for ld in loaded:
        d = ld.deployment
        r = d.spec.resources
        shape = (
            f"{r.cpu_cores} CPU core(s)" if r.accelerator == "cpu"
            else f"MIG {r.mig_profile}" if r.mig_profile
            else f"TP={r.tensor_parallel_size} x {r.gpu_product or 'any GPU'}"
        )
        a = d.spec.autoscaling
        scaling = (
            f", autoscaling {a.policy} (queue time {a.queue_time_target_seconds:g} s, "
            f"p99 TTFT {a.ttft_p99_target_seconds:g} s)" if a else ""
        )
        console.print(
            f"[green]ok[/] {ld.path}[{ld.index}] {d.name}: model {d.spec.model.name!r} "
            f"({d.spec.engine.kind}), replicas {d.spec.replicas.min}..{d.spec.replicas.max}, {shape}, "
            f"routing {d.spec.routing.policy}{scaling}",
            highlight=False,
        )


@app.command()
def up(
    files: Files,
    port: Annotated[int, typer.Option(help="Router port (OpenAI-compatible API).")] = 8080,
    host: Annotated[str, typer.Option(help="Router address to listen on.")] = "127.0.0.1",
    metrics_port: Annotated[Optional[int], typer.Option(
        help="Port of the autoscaler's Prometheus metrics (default: --port + 1; 0: off). "
        "Served only when a deployment has spec.autoscaling.")] = None,
    state_dir: StateDir = None,
) -> None:
    """Run the deployments on this machine until Ctrl-C or `fleet down`.

    Checks every deployment first (spec, engine installed, weights present, devices) and starts
    nothing if one fails. Then starts the router, and for each replica: places it on GPUs (or CPU
    cores), launches the engine, waits for /health, runs the warm-up requests, and only then adds
    it to the router's pool. Failed replicas are replaced with exponential backoff. Deployments with
    spec.autoscaling are scaled between spec.replicas.min and max; a scale-down drains a replica
    before it stops. Ctrl-C drains: replicas leave the pool, in-flight requests finish, engines get
    SIGTERM, then SIGKILL.
    """
    from fleet.up import PreflightError, run_up

    loaded = _load(files)
    store = StateStore(state_dir or default_state_dir())
    autoscaled = any(ld.deployment.spec.autoscaling is not None for ld in loaded)
    if metrics_port is None:
        metrics_port = port + 1 if autoscaled else 0
    try:
        code = asyncio.run(run_up(loaded, store=store, console=console, host=host, port=port,
                                  metrics_port=metrics_port or None))  # fmt: skip
    except PreflightError as err:
        err_console.print("[bold red]Cannot start; nothing was started:[/]")
        for line in err.problems:
            err_console.print(f"  {line}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except AlreadyRunning as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _pid_alive(pid: int | None) -> bool:
    """True while process ``pid`` runs. A zombie (exited, not yet reaped by its parent) is gone."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: field 3 of /proc/PID/stat is the state; Z = zombie, X = dead
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


@app.command()
def status(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw state as JSON.")] = False,
    log_lines: Annotated[int, typer.Option(help="Engine log lines shown for a failed replica.")] = 8,
) -> None:
    """Show deployments and replicas of the local fleet: state, endpoint, devices, and for a
    failed replica the reason and the engine's last log lines."""
    store = StateStore(state_dir or default_state_dir())
    state = store.read()
    if state is None:
        err_console.print(f"No fleet state in {store.root}: `fleet up` has not run there.")
        raise typer.Exit(1)
    running = _pid_alive(state.get("pid")) and state.get("phase") != "stopped"
    if as_json:
        console.print_json(json.dumps({**state, "running": running}))
        return
    age_s = time.time() - state.get("updated_at_unix", time.time())
    phase = state.get("phase", "?") if running else "not running"
    console.print(
        f"Fleet [bold]{phase}[/] (pid {state.get('pid')}), router {state.get('router_url')}, "
        f"state updated {age_s:.0f} s ago", highlight=False,
    )
    console.print(f"Node: {state.get('node', '?')}", highlight=False)
    deps = Table(title="Deployments", title_justify="left")
    for col in ("deployment", "model", "ready/desired", "policy", "autoscaling", "last decision", "source"):
        deps.add_column(col)
    replicas = state.get("replicas", [])
    for name, d in state.get("deployments", {}).items():
        ready = sum(1 for r in replicas if r["deployment"] == name and r["status"] == "READY")
        deps.add_row(name, d["model"], f"{ready}/{d['desired']}", d["policy"], *_scaling_columns(d), d["source"])
    console.print(deps)
    table = Table(title="Replicas", title_justify="left")
    for col in ("replica", "status", "endpoint", "devices", "pid", "age", "detail"):
        table.add_column(col)
    clock_now = state.get("clock_s", 0.0) + (age_s if running else 0.0)
    for r in replicas:
        st = r["status"]
        style = "green" if st == "READY" else "red" if st.startswith("FAILED") else "yellow" if st == "DRAINING" else ""
        detail = (r.get("failure") or {}).get("reason") or r.get("waiting_reason") or ""
        table.add_row(
            r["id"], f"[{style}]{st}[/]" if style else st, r.get("endpoint") or "-", r.get("assignment") or "-",
            str(r.get("pid") or "-"), f"{clock_now - r['created_at_s']:.0f} s", detail,
        )
    console.print(table)
    for r in replicas:
        failure = r.get("failure")
        if failure and failure.get("log_tail") and log_lines > 0:
            console.print(f"[red]{r['id']}[/] {failure['status']}: {failure['reason']}", highlight=False)
            console.print(f"  last engine log lines ({r.get('log_path')}):", style="dim", highlight=False)
            for line in failure["log_tail"][-log_lines:]:
                console.print(f"  | {line}", markup=False, highlight=False, style="dim")


def _scaling_columns(d: dict) -> tuple[str, str]:
    """(autoscaling, last decision) cells of one deployment in `fleet status`."""
    policy = d.get("autoscaling")
    if not policy:
        return "off", "-"
    bounds = f"{policy} ({d.get('min')}..{d.get('max')})"
    last = d.get("last_scaling")
    if not last:
        return bounds, "none yet"
    return bounds, f"{last['direction']} {last['previous']}->{last['desired']}: {last['reason']} ({last['detail']})"


@app.command()
def down(
    state_dir: StateDir = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds to wait for the drain to finish.")] = 300.0,
) -> None:
    """Stop the local fleet started by `fleet up`: drain every replica, stop the engines and the
    router, and wait until they are gone (same as Ctrl-C on `fleet up`)."""
    store = StateStore(state_dir or default_state_dir())
    state = store.read() or {}
    pid = state.get("pid")
    if not _pid_alive(pid) or state.get("phase") == "stopped":
        console.print(f"No running fleet in {store.root}.")
        return
    os.kill(pid, signal.SIGTERM)
    console.print(f"Sent SIGTERM to fleet up (pid {pid}); draining...")
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if _pid_alive(pid):
        err_console.print(f"[red]fleet up (pid {pid}) still running after {timeout_s:g} s[/]")
        raise typer.Exit(1)
    console.print("Fleet stopped.")


@app.command()
def router(
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8080,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
) -> None:
    """Run the router alone (the controller publishes pools to it through the admin API).

    The admin token is read from $FLEET_ROUTER_ADMIN_TOKEN.
    """
    from router.server import serve

    token = os.environ.get("FLEET_ROUTER_ADMIN_TOKEN")
    if not token:
        err_console.print("FLEET_ROUTER_ADMIN_TOKEN is not set: the admin API needs a token.")
        raise typer.Exit(2)
    serve(host, port, token)


@app.command("make-tiny-model")
def make_tiny_model_cmd(
    out_dir: Annotated[Path, typer.Argument(help="Directory to write the model into.")],
    seed: Annotated[int, typer.Option(help="Seed of the random weights.")] = 0,
) -> None:
    """Generate a tiny Llama model (random weights, ~7 MB) that real vLLM serves without a GPU
    or a model hub. Its output is noise; every request still runs through vLLM for real."""
    from fleet.tinymodel import make_tiny_model

    with console.status(f"Generating tiny model in {out_dir}..."):
        path = make_tiny_model(out_dir, seed=seed)
    console.print(f"Tiny model ready: {path}")


if __name__ == "__main__":
    app()
