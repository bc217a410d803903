"""The `fleet` command line (typer + rich).

Owns argument parsing, help texts and the rendering of results of the local fleet's commands
(validate, up, status, down, logs, router, sim-engine, plan, inventory, make-tiny-model); the work
is done by `fleet.spec`, `fleet.up`, `fleet.state`, `router.server` and `fleet.sim.runner`. The
other commands live beside it and are registered at the bottom: `fleet.cli_simulate` (simulate),
`fleet.cli_agent` (cache, node-agent), `fleet.cli_rollout` (apply, rollout),
`fleet.cli_observability` (prometheus-config, dashboard, rules, top), `fleet.cli_k8s` (crd,
operator, router-pod).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from fleet.cli_agent import cache_app, node_agent
from fleet import cli_rollout
from fleet.cli_simulate import simulate
from fleet.spec import SpecError, load_deployments
from fleet.state import AlreadyRunning, StateStore, default_state_dir

app = typer.Typer(
    name="fleet",
    help="Fleet: place, warm, route and scale LLM inference replicas (vLLM) from a deployment YAML.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",   # help paragraphs reflow to the terminal's width
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


def _fail_with(title: str, problems: list[str]) -> typer.Exit:
    err_console.print(f"[bold red]{title} ({len(problems)} problem(s)):[/]")
    for line in problems:
        err_console.print(f"  {line}", markup=False, highlight=False)
    return typer.Exit(2)


def _load(files: list[Path]):
    try:
        return load_deployments(files)
    except SpecError as err:
        raise _fail_with("Invalid deployment spec", err.problems) from None


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
        help="Port of fleet up's Prometheus metrics: replica states, autoscaler decisions "
        "(default: --port + 1; 0: off).")] = None,
    detach: Annotated[bool, typer.Option(
        "--detach", "-d", help="Run in the background: return once every replica is READY "
        "(or on the first failure); `fleet logs`, `fleet status` and `fleet down` reach it.")] = False,
    state_dir: StateDir = None,
) -> None:
    """Run the deployments on this machine until Ctrl-C or `fleet down`.

    Checks every deployment first (spec, engine installed, weights present, devices) and starts
    nothing if one fails. Then starts the router, and for each replica: places it on GPUs (or CPU
    cores), starts the engine, waits for /health, runs the warm-up requests, and only then adds it
    to the router's pool. Failed replicas are replaced with exponential backoff. Deployments with
    spec.autoscaling are scaled between spec.replicas.min and max; a scale-down drains a replica
    before it stops. Ctrl-C drains: replicas leave the pool, in-flight requests finish, engines
    stop.

    Engines and the router do not die with this command: if it is killed, they keep serving, and
    `fleet up` run again on the same state directory adopts them without restarting them.
    """
    loaded = _load(files)
    store = StateStore(state_dir or default_state_dir())
    if detach:
        raise typer.Exit(_detach(files, store, port=port, host=host, metrics_port=metrics_port))
    from fleet.up import PreflightError, run_up

    if metrics_port is None:
        metrics_port = port + 1
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


def _detach(files: list[Path], store: StateStore, *, port: int, host: str, metrics_port: int | None) -> int:
    """Start `fleet up` in a new session with its output in ``logs/fleet-up.log``; relay that log
    until every replica is READY, a replica fails, or the background process exits."""
    log_path = store.log_dir / "fleet-up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "fleet.cli", "up", *map(str, files), "--port", str(port), "--host", host,
            "--state-dir", str(store.root)]  # fmt: skip
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    offset = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "COLUMNS": "160"})  # fmt: skip
    try:
        return _relay_until_ready(log_path, offset, proc)
    except KeyboardInterrupt:
        console.print(f"\nStopped watching; the fleet keeps starting in the background (pid {proc.pid}): "
                      "`fleet status`, `fleet logs -f`, `fleet down`.", highlight=False)  # fmt: skip
        return 0


def _relay_until_ready(log_path: Path, offset: int, proc: subprocess.Popen) -> int:
    with open(log_path, "rb") as f:
        f.seek(offset)
        while True:
            for raw in f.readlines():
                line = raw.decode(errors="replace").rstrip("\n")
                console.print(line, markup=False, highlight=False)
                if "All " in line and "READY" in line:
                    console.print(f"Fleet runs in the background (pid {proc.pid}); `fleet logs -f`, "
                                  "`fleet status`, `fleet down`.", highlight=False)  # fmt: skip
                    return 0
                if "FAILED_" in line:
                    console.print(f"A replica failed; the fleet keeps running in the background (pid {proc.pid}) "
                                  "and replaces it: `fleet status`, `fleet logs -f`.", highlight=False)  # fmt: skip
                    return 1
            code = proc.poll()
            if code is not None:
                for raw in f.readlines():
                    console.print(raw.decode(errors="replace").rstrip("\n"), markup=False, highlight=False)
                return code or 1
            time.sleep(0.2)


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


def _orphans(store: StateStore) -> tuple[list[str], tuple[str, int] | None]:
    """(replica ids whose engines still run, (router url, pid) if the router still runs), checked
    by process identity: what a controller that died left serving."""
    from fleet.backends.local import LocalBackend
    from fleet.inventory import NodeInventory
    from fleet.routerproc import router_record_alive

    if not (store.root / "fleet-id").exists():
        return [], None
    backend = LocalBackend(store.root, store.fleet_id(), NodeInventory(name="local"))
    facts = asyncio.run(backend.observe())
    return sorted(rid for rid, f in facts.items() if f.running), router_record_alive(store.root)


@app.command()
def status(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw state as JSON.")] = False,
    log_lines: Annotated[int, typer.Option(help="Engine log lines shown for a failed replica.")] = 8,
) -> None:
    """Show the deployments and replicas of the local fleet.

    For each replica: state, endpoint, devices, and for a failed one the reason and the engine's
    last log lines. When the controller is gone but engines or the router still run, says so
    (`fleet up` adopts them, `fleet down` stops them)."""
    store = StateStore(state_dir or default_state_dir())
    state = store.read()
    if state is None:
        err_console.print(f"No fleet state in {store.root}: `fleet up` has not run there.")
        raise typer.Exit(1)
    running = _pid_alive(state.get("pid")) and state.get("phase") != "stopped"
    orphans, router_left = ([], None) if running else _orphans(store)
    if as_json:
        console.print_json(json.dumps({**state, "running": running, "orphaned_replicas": orphans,
                                       "orphaned_router": router_left}))  # fmt: skip
        return
    age_s = time.time() - state.get("updated_at_unix", time.time())
    phase = state.get("phase", "?") if running else "not running"
    console.print(
        f"Fleet [bold]{phase}[/] (pid {state.get('pid')}), router {state.get('router_url')}, "
        f"state updated {age_s:.0f} s ago", highlight=False,
    )
    if orphans or router_left:
        what = ([f"{len(orphans)} engine(s) ({', '.join(orphans)})"] if orphans else []) + (
            [f"the router (pid {router_left[1]}, {router_left[0]})"] if router_left else [])
        console.print(f"[bold yellow]The controller is not running, but {' and '.join(what)} still run.[/] "
                      "`fleet up FILES` adopts them; `fleet down` stops them.", highlight=False)  # fmt: skip
    console.print(f"Nodes: {'; '.join(state.get('inventory', [])) or '?'}", highlight=False)
    agent_status = _read_json(store.root / "node-agent.json")
    if agent_status:
        from fleet.agent.runner import status_lines

        for line in status_lines(agent_status):
            console.print(f"[yellow]{line}[/]", highlight=False)
    deps = Table(title="Deployments", title_justify="left")
    for col in ("deployment", "model", "ready/desired", "policy", "autoscaling", "last decision", "source"):
        deps.add_column(col)
    replicas = state.get("replicas", [])
    for name, d in state.get("deployments", {}).items():
        ready = sum(1 for r in replicas if r["deployment"] == name and r["status"] == "READY")
        deps.add_row(name, d["model"], f"{ready}/{d['desired']}", d["policy"], *_scaling_columns(d), d["source"])
    console.print(deps)
    cli_rollout.print_status_revisions(console, state)
    table = Table(title="Replicas", title_justify="left")
    for col in ("replica", "status", "endpoint", "devices", "pid", "age", "detail"):
        table.add_column(col)
    clock_now = state.get("clock_s", 0.0) + (age_s if running else 0.0)
    for r in replicas:
        st = r["status"]
        style = "green" if st == "READY" else "red" if st.startswith("FAILED") else "yellow" if st == "DRAINING" else ""
        detail = (r.get("failure") or {}).get("reason") or r.get("waiting_reason") or ""
        if st == "DRAINING" and r.get("drain_reason"):
            detail = r["drain_reason"]
        elif st == "CACHING":
            detail = (r.get("detail") or {}).get("cache", "")
        if r.get("adopted_at_s") is not None and not st.startswith("FAILED"):
            detail = detail or "adopted"
        table.add_row(
            r["id"], f"[{style}]{st}[/]" if style else st, r.get("endpoint") or "-", r.get("assignment") or "-",
            (r.get("detail") or {}).get("pid", "-"), f"{clock_now - r['created_at_s']:.0f} s", detail,
        )
    console.print(table)
    for r in replicas:
        failure = r.get("failure")
        if failure and failure.get("log_tail") and log_lines > 0:
            console.print(f"[red]{r['id']}[/] {failure['status']}: {failure['reason']}", highlight=False)
            console.print(f"  last engine log lines ({(r.get('detail') or {}).get('log')}):", style="dim",
                          highlight=False)  # fmt: skip
            for line in failure["log_tail"][-log_lines:]:
                console.print(f"  | {line}", markup=False, highlight=False, style="dim")


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


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
    """Stop the local fleet and wait until everything is gone.

    Drains every replica, stops the engines, then the router (same as Ctrl-C on `fleet up`). If
    the controller is gone (killed, crashed) but engines or the router still run, stops those in
    the same order."""
    from fleet.up import run_down

    store = StateStore(state_dir or default_state_dir())
    state = store.read() or {}
    pid = state.get("pid")
    if not _pid_alive(pid) or state.get("phase") == "stopped":
        try:
            code = asyncio.run(run_down(store, console))
        except AlreadyRunning as err:
            err_console.print(f"[red]{err}[/]", highlight=False)
            raise typer.Exit(2) from None
        console.print("Fleet stopped." if code == 0 else f"No running fleet in {store.root}.")
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
def logs(
    name: Annotated[str, typer.Argument(help="`controller` (the output of `fleet up`), `router`, or a replica id.")]
    = "controller",
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines of the end of the log to print first.")] = 50,
    state_dir: StateDir = None,
) -> None:
    """Print the log of the controller, the router or one replica's engine.

    The controller's log is the output of `fleet up --detach`; `fleet status` lists replica ids."""
    from fleet.backends.procs import read_log_tail

    store = StateStore(state_dir or default_state_dir())
    file = {"controller": "fleet-up.log", "router": "router.log"}.get(name, f"{name}.log")
    path = store.log_dir / file
    if not path.exists():
        known = sorted(p.stem for p in store.log_dir.glob("*.log")) if store.log_dir.exists() else []
        err_console.print(f"No log {path}. Logs in {store.log_dir}: {', '.join(known) or 'none'} "
                          "(`fleet-up` is `controller`).", highlight=False)  # fmt: skip
        raise typer.Exit(1)
    for line in read_log_tail(path, lines):
        console.print(line, markup=False, highlight=False)
    if not follow:
        return
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        try:
            while True:
                chunk = f.readline()
                if chunk:
                    console.print(chunk.decode(errors="replace").rstrip("\n"), markup=False, highlight=False)
                else:
                    time.sleep(0.25)
        except KeyboardInterrupt:
            return


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


@app.command("sim-engine")
def sim_engine(
    replicas: Annotated[int, typer.Option(help="Simulated replicas in this process, each on its own port.")] = 1,
    base_port: Annotated[int, typer.Option(help="Port of replica 0; replica i gets base+i. 0 = free ports, printed.")] = 0,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    profile: Annotated[Optional[str], typer.Option(help="Simulator profile (default cpu-tiny-llama).")] = None,
    model_name: Annotated[Optional[str], typer.Option(help="Served model name (default: the profile's model).")] = None,
    seed: Annotated[int, typer.Option(help="Output text and EOS positions depend only on seed and prompt.")] = 0,
    startup_delay_s: Annotated[float, typer.Option("--startup-delay-s", help="Seconds before listening (weight loading stand-in).")] = 0.0,
    fail_at_start: Annotated[bool, typer.Option("--fail-at-start", help="Fault: never listen; exit 1.")] = False,
    crash_after_requests: Annotated[Optional[int], typer.Option(help="Fault: a replica dies after answering N requests.")] = None,
    slowdown: Annotated[float, typer.Option(help="Fault: every engine step takes this factor longer.")] = 1.0,
    mean_output_tokens: Annotated[Optional[float], typer.Option(help="Requests without ignore_eos stop at an EOS with this mean length.")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(help="Override the profile's max_model_len.")] = None,
    num_gpu_blocks: Annotated[Optional[int], typer.Option(help="Override the profile's KV blocks.")] = None,
    ports_file: Annotated[Optional[Path], typer.Option(help="Write the bound ports and URLs as JSON here.")] = None,
    list_profiles: Annotated[bool, typer.Option("--list-profiles", help="List the profiles and exit.")] = False,
) -> None:
    """Run simulated vLLM replicas (the Fleet engine SIMULATOR; no model runs).

    Each replica serves vLLM's OpenAI API (/v1/completions, /v1/chat/completions with SSE
    streaming, /v1/models, /health) and /metrics with vLLM's metric names, with latencies from a
    model of vLLM's scheduler (continuous batching, chunked prefill, KV-cache capacity,
    preemption, prefix caching) under a profile fitted to real vLLM or published GPU figures.
    Prints one line per replica with its URL; Ctrl-C stops. Fault switches apply to every
    replica; POST /sim/faults changes one at run time.
    """
    from fleet.sim.faults import FaultPlan
    from fleet.sim.profiles import get_profile, profile_names
    from fleet.sim.runner import SimEngineOptions, run

    if list_profiles:
        for name in profile_names():
            p = get_profile(name)
            c = p.config
            console.print(
                f"[bold]{name}[/]: {p.model} on {p.hardware}; max_num_seqs {c.max_num_seqs}, "
                f"max_num_batched_tokens {c.max_num_batched_tokens}, KV {c.num_gpu_blocks} x {c.block_size} tokens, "
                f"max_model_len {c.max_model_len}", highlight=False,
            )
        return
    try:
        faults = FaultPlan(fail_at_start=fail_at_start, crash_after_requests=crash_after_requests, slowdown=slowdown)
    except ValueError as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    overrides = {"max_model_len": max_model_len, "num_gpu_blocks": num_gpu_blocks}
    options = SimEngineOptions(
        replicas=replicas, host=host, base_port=base_port, profile=profile, served_model_name=model_name,
        seed=seed, startup_delay_s=startup_delay_s, faults=faults, mean_output_tokens=mean_output_tokens,
        config_overrides={k: v for k, v in overrides.items() if v is not None},
        ports_file=str(ports_file) if ports_file else None,
    )
    raise typer.Exit(run(options, out=lambda line: print(line, flush=True)))


def _load_inventory(path: Path):
    from fleet.inventory.file import InventoryError, load_inventory

    try:
        return load_inventory(path)
    except InventoryError as err:
        raise _fail_with("Invalid inventory", err.problems) from None


@app.command()
def plan(
    files: Files,
    inventory: Annotated[Path, typer.Option(
        "--inventory", "-i", help="Inventory YAML (kind: Inventory): the nodes to place on. See examples/inventories/.")],
    replicas: Annotated[Optional[int], typer.Option(
        min=0, help="Replicas to place per deployment. Default: spec.replicas.initial (or min).")] = None,
    strategy: Annotated[str, typer.Option(help="Placement strategy: fleet (default) or first-fit.")] = "fleet",
    all_or_nothing: Annotated[bool, typer.Option(
        "--all-or-nothing", help="Place none of a deployment's replicas unless all fit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the plans as JSON.")] = False,
) -> None:
    """Show where each deployment's replicas would run on a declared cluster, and why not.

    Deployments are placed one after another on the same inventory: devices the inventory marks
    inUse, and those taken by earlier deployments, are not free. Each deployment's replicas are
    placed in one decision (one GPU product for all of them). For each replica: the node (several
    for a gang), the NVLink domain or MIG parent GPU, the devices as CUDA_VISIBLE_DEVICES gets
    them (GPU or MIG UUIDs), and whether the node is warm (engine image and weights in its
    cache list). When replicas do not fit: the reasons grouped by node class, and for MIG
    profiles, repartition advice with the nvidia-smi commands. Nothing is started.

    Exit code 0 when every replica fits, 1 when some do not, 2 on invalid input.
    """
    from fleet.placement import PlacementRequest, get_strategy

    loaded = _load(files)
    inv = _load_inventory(inventory)
    try:
        placer = get_strategy(strategy)
    except KeyError as err:
        err_console.print(str(err.args[0]))
        raise typer.Exit(2) from None
    held = Counter(inv.in_use)
    plans = []
    for ld in loaded:
        dep = ld.deployment
        count = dep.spec.replicas.desired_at_start if replicas is None else replicas
        request = PlacementRequest.for_deployment(dep, count, all_or_nothing=all_or_nothing)
        result = placer.place_replicas(request, inv.inventory, held)
        for p in result.placements:
            held.update(p.devices)
        plans.append((ld, result))
    if as_json:
        console.print_json(json.dumps([_plan_json(ld, p, inv.inventory) for ld, p in plans]))
    else:
        for ld, p in plans:
            _print_plan(ld, p, inv.inventory)
    raise typer.Exit(0 if all(p.complete for _, p in plans) else 1)


def _plan_json(ld, p, inv) -> dict:
    return {
        "deployment": ld.deployment.name,
        "requested": p.request.count,
        "placed": len(p.placements),
        "product": p.product,
        "gang": None if p.gang is None else {"nodes": p.gang.nodes, "gpusPerNode": p.gang.per_node},
        "replicas": [
            {"members": [{"node": m.node, "domain": m.domain, "devices": list(m.devices), "env": m.env,
                          "warm": p.request.is_warm(inv.node(m.node))} for m in r.members]}
            for r in p.placements
        ],
        "explanation": p.explain(),
        "reasons": [{"reason": c.reason, "nodes": list(c.nodes)} for c in p.reasons],
        "migAdvice": [{"node": a.node, "gpu": a.gpu_index, "plan": a.describe(), "commands": a.commands()}
                      for a in p.advice],
    }


def _print_plan(ld, p, inv) -> None:
    dep = ld.deployment
    shape = p.request.shape.describe(p.product, p.gang)
    status = "[green]all placed[/]" if p.complete else f"[red]{len(p.placements)} of {p.request.count} placed[/]"
    console.print(f"[bold]{dep.name}[/] ({ld.path}): {p.request.count} replica(s) of {shape}; "
                  f"strategy {p.strategy}: {status}", highlight=False, soft_wrap=True)
    for i, r in enumerate(p.placements):
        for j, m in enumerate(r.members):
            warm = "warm" if p.request.is_warm(inv.node(m.node)) else "cold"
            lead = f"  replica {i}:" if j == 0 else "   " + " " * len(f"replica {i}:")
            console.print(f"{lead} {m.node} {m.domain} {m.label} ({warm}) "
                          f"CUDA_VISIBLE_DEVICES={m.env.get('CUDA_VISIBLE_DEVICES', '')}",
                          highlight=False, markup=False, soft_wrap=True)
    if not p.complete:
        head = p.explain().split(": ", 1)[0]
        console.print(f"  [red]{head}[/]", highlight=False, soft_wrap=True)
        if p.note:
            console.print(f"    {p.note}", highlight=False, markup=False, soft_wrap=True)
        for c in p.reasons:
            console.print(f"    {c.describe(examples=5)}", highlight=False, markup=False, soft_wrap=True)
    for a in p.advice:
        console.print(f"  MIG repartition advice: {a.describe()}", highlight=False, markup=False, soft_wrap=True)
        for cmd in a.commands():
            console.print(f"    $ {cmd}", style="dim", highlight=False, markup=False, soft_wrap=True)
    console.print()


@app.command("inventory")
def inventory_cmd(
    file: Annotated[Optional[Path], typer.Argument(help="Inventory YAML to validate and summarize.")] = None,
    discover: Annotated[bool, typer.Option(
        "--discover", help="Read this machine's GPUs through NVML and print them as an inventory document.")] = False,
    raw: Annotated[bool, typer.Option(
        "--raw", help="With --discover: print NVML's readings as JSON instead (the format of tests/data/).")] = False,
    node_name: Annotated[Optional[str], typer.Option(
        "--node-name", help="Node name for --discover. Default: this host's name.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of YAML or a table.")] = False,
) -> None:
    """Validate and summarize an inventory file, or discover this machine's GPUs.

    `fleet inventory FILE` checks the file (errors name the node and field, e.g.
    `inventory.yaml nodes[3] (gpu-node-3).gpus[2].product: required ...`) and prints one row per
    node: failure domains, GPUs, NVLink domains, MIG instances, unhealthy GPUs.

    `fleet inventory --discover` reads NVML (nvidia-ml-py) here: GPUs, memory, UUIDs, MIG mode
    and instances, NVLink domains, PCIe link, health (uncorrected ECC, row remapping, clock event
    reasons, temperature); it prints an inventory document that `fleet plan --inventory` accepts.
    Without an NVIDIA driver it says so and lists no GPU. Exit code 2 on an invalid file.
    """
    import yaml

    from fleet.inventory.file import inventory_document

    if discover == (file is not None):
        err_console.print("Give either an inventory FILE or --discover.")
        raise typer.Exit(2)
    if discover:
        from fleet.inventory.model import Inventory
        from fleet.inventory.nvml import PynvmlReader, node_from_nvml

        try:
            snap = PynvmlReader().snapshot()
        except RuntimeError as err:
            err_console.print(f"{err}; no GPU listed.", highlight=False)
            snap = {"devices": []}
        if raw:
            console.print_json(json.dumps(snap))
            return
        name = node_name or _dns_name(socket.gethostname())
        node = node_from_nvml(snap, name, cpu_cores=tuple(sorted(os.sched_getaffinity(0))))
        doc = inventory_document(Inventory((node,)), name=name)
        if as_json:
            console.print_json(json.dumps(doc))
        else:
            print(yaml.safe_dump(doc, sort_keys=False), end="")
        return
    loaded = _load_inventory(file)
    if as_json:
        console.print_json(json.dumps(inventory_document(loaded.inventory, loaded.name, loaded.in_use)))
        return
    console.print(f"{file}: {len(loaded.inventory.nodes)} node(s), {loaded.inventory.gpu_count()} GPU(s): valid",
                  highlight=False, soft_wrap=True)
    for n in loaded.inventory.nodes:
        products = Counter(g.product for g in n.gpus)
        domains = [d for d in n.domains if len(d) > 1]
        migs = Counter(m.profile for g in n.gpus for m in g.mig_instances)
        sick = [f"GPU{g.index} ({', '.join(g.health.problems())})" for g in n.gpus if not g.health.healthy]
        taken = sum(1 for g in n.gpus for d in (g.uuid, *(m.uuid for m in g.mig_instances)) if loaded.in_use[d])
        where = "/".join(x for x in (n.zone, n.rack, n.network_block, n.nvlink_fabric) if x)
        parts = [
            f"  {n.name}" + (f" [{where}]" if where else "") + ":",
            ", ".join(f"{c}x {p}" for p, c in products.items()) or "no GPU",
            "NVLink " + (" ".join("{" + ",".join(str(g.index) for g in d) + "}" for d in domains) or "none")
            + ("" if n.topology_known else " (topology not reported)"),
        ]
        if migs:
            parts.append("MIG " + ", ".join(f"{c}x {p}" for p, c in sorted(migs.items())))
        if sick:
            parts.append("unhealthy: " + "; ".join(sick))
        if taken:
            parts.append(f"{taken} device(s) in use")
        console.print("; ".join([parts[0] + " " + parts[1], *parts[2:]]), highlight=False, markup=False, soft_wrap=True)


def _dns_name(host: str) -> str:
    """A host name as a DNS-1123 node name (lower case, other characters become '-')."""
    name = re.sub(r"[^a-z0-9.-]+", "-", host.lower()).strip("-.")
    return name or "local"


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


# The node agent's commands (fleet/cli_agent.py): `fleet cache ...`, `fleet node-agent`.
app.add_typer(cache_app)
app.command("node-agent")(node_agent)
app.command("simulate")(simulate)   # fleet/cli_simulate.py
cli_rollout.register(app, console, err_console)   # `fleet apply`, `fleet rollout ...` (fleet/cli_rollout.py)

# SRE commands (fleet/cli_observability.py): prometheus-config, dashboard, rules, top.
from fleet.cli_observability import register as _register_observability  # noqa: E402

_register_observability(app)

from fleet.cli_k8s import register as _register_k8s  # noqa: E402 - `fleet crd`, `fleet operator`

_register_k8s(app)


if __name__ == "__main__":
    app()
