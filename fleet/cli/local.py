"""`fleet validate`, `up`, `status`, `down`, `logs` and `router`: the local fleet's commands.

Owns their arguments, help texts and the rendering of results; the work is done by `fleet.spec`,
`fleet.local.up` (run and stop the fleet), `fleet.local.state` (what `fleet up` recorded) and
`router.http.server`. Registered on the `fleet` app by `fleet.cli`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from fleet.cli.common import Files, StateDir, console, err_console, fail_with, load_or_exit, read_json
from fleet.cli.rollout import print_status_revisions
from fleet.local.state import AlreadyRunning, StateStore, StateUnreadable, default_state_dir

app = typer.Typer()


@app.command()
def validate(
    files: Files,
    paths_on_nodes: Annotated[bool, typer.Option(
        "--paths-on-nodes", help="Model paths name directories on the GPU nodes (Kubernetes hostPath), not on this "
        "machine: a path missing here is noted, not failed.")] = False,
    vllm_check: Annotated[bool, typer.Option(
        "--vllm-check/--no-vllm-check", help="Check engine args with the installed vLLM's own parser (its import "
        "takes seconds the first time; the answer is kept in ~/.cache/fleet/vllm-args; --no-vllm-check notes "
        "them as not checked).")] = True,
) -> None:
    """Check deployment files without starting anything.

    Every problem is reported with its file, document index, field path and reason, e.g.
    `quickstart.yaml[0] spec.replicas.min: must be <= spec.replicas.max (3 > 2)`.

    The model is read too (config.json and the safetensors index of a local, cached or hf://
    source; no weights are downloaded): a tensorParallelSize vLLM refuses for it (one that does
    not divide the attention heads), and a gpuProduct or migProfile whose memory cannot hold
    the weights plus one max-model-len sequence per GPU, fail with the numbers (needed vs
    available per GPU). Weights count at the dtype vLLM loads them (a quantized checkpoint's
    own, --quantization's online format), the KV cache at --kv-cache-dtype. A --max-model-len
    above the model's maximum fails as vLLM refuses it. A local model path that does not exist
    fails (noted instead with --paths-on-nodes). A model that cannot be read otherwise is noted,
    not failed.

    The engine args of a vllm deployment go through the installed vLLM's own parser and the
    range checks of its config classes (an unknown flag, a bad type or choice,
    --gpu-memory-utilization 1.5 fail, naming the flag); without vLLM installed here they are
    noted as not checked. Importing vLLM takes seconds (10-40 s on a busy 2-core machine), and only
    happens when there are args whose answer is not kept yet: vLLM's answer is kept in
    ~/.cache/fleet/vllm-args ($XDG_CACHE_HOME/fleet/vllm-args) per installed vLLM and args, so
    checking the same args again takes no import; --no-vllm-check skips the check.
    `fleet apply` runs these same checks before it hands a file to the running `fleet up`.
    Exit code 0 when all documents are valid, 2 otherwise.
    """
    from fleet.cli.models import model_problems

    loaded = load_or_exit(files)
    checks, problems = model_problems(loaded, paths_on_nodes, vllm_check)
    if problems:
        raise fail_with("Deployment checks failed", problems)
    for ld, check in zip(loaded, checks):
        d = ld.deployment
        r = d.spec.resources
        shape = (
            f"{r.cpu_cores} CPU core(s)" if r.accelerator == "cpu"
            else f"MIG {r.mig_profile}" if r.mig_profile
            else f"TP={r.tensor_parallel_size} x {' or '.join(r.gpu_products) or 'any GPU'}"
        )
        a = d.spec.autoscaling
        scaling = (
            f", autoscaling {a.policy} (queue time {a.queue_time_target_seconds:g} s, "
            f"p99 TTFT {a.ttft_p99_target_seconds:g} s)" if a else ""
        )
        if d.spec.standby is not None and d.spec.standby.max_replicas > 0:
            why = d.spec.standby_unsupported()
            check.notes.append(f"spec.standby: {why}" if why else
                               f"spec.standby: up to {d.spec.standby.max_replicas} replica(s) kept asleep "
                               "(vLLM sleep mode level 1), woken on a scale-up")
        console.print(
            f"[green]ok[/] {ld.path}[{ld.index}] {d.name}: model {d.spec.model.name!r} "
            f"({d.spec.engine.kind}), replicas {d.spec.replicas.min}..{d.spec.replicas.max}, {shape}, "
            f"routing {d.spec.routing.policy}{scaling}",
            highlight=False,
        )
        for note in check.notes:
            console.print(f"   {note}", highlight=False, markup=False, soft_wrap=True)


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
    prices: Annotated[Optional[Path], typer.Option(
        "--prices", help="GPU prices (YAML: source, gpuHourUsd: {product: USD per GPU-hour}; fleet/pricing.py), "
        "exported as fleet_gpu_price_usd_per_hour{product} for the dashboard's cost row.")] = None,
    picker_port: Annotated[int, typer.Option(
        help="Run the endpoint picker on this port (python -m router.picker; docs/routing.md \"Endpoint picker\") "
        "and have the router ask it for every pick (0: off, the router picks alone).")] = 0,
    picker_metrics_port: Annotated[Optional[int], typer.Option(
        help="Port of the endpoint picker's /metrics (fleet_picker_*), /ready and /healthz, a fleet-picker target "
        "of Prometheus (default: --picker-port + 1; 0: off).")] = None,
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
    from fleet.pricing import PricesError, load_prices

    loaded = load_or_exit(files)
    try:
        gpu_prices = load_prices(prices) if prices is not None else None
    except PricesError as err:
        err_console.print(f"[red]--prices: {err}[/]", highlight=False)
        raise typer.Exit(2) from None
    store = StateStore(state_dir or default_state_dir())
    if detach:
        raise typer.Exit(_detach(files, store, port=port, host=host, metrics_port=metrics_port, prices=prices,
                                 picker_port=picker_port, picker_metrics_port=picker_metrics_port))
    from fleet.local.preflight import PreflightError
    from fleet.local.up import run_up

    if metrics_port is None:
        metrics_port = port + 1
    if picker_metrics_port is None:
        picker_metrics_port = picker_port + 1 if picker_port else 0
    try:
        code = asyncio.run(run_up(loaded, store=store, console=console, host=host, port=port,
                                  metrics_port=metrics_port or None,
                                  prices=gpu_prices.gpu_hour_usd if gpu_prices else None,
                                  picker_port=picker_port or None,
                                  picker_metrics_port=picker_metrics_port or None))  # fmt: skip
    except PreflightError as err:
        err_console.print("[bold red]Cannot start; nothing was started:[/]")
        for line in err.problems:
            err_console.print(f"  {line}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    except AlreadyRunning as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    raise typer.Exit(code)


def _detach(files: list[Path], store: StateStore, *, port: int, host: str, metrics_port: int | None,
            prices: Path | None = None, picker_port: int = 0, picker_metrics_port: int | None = None) -> int:
    """Start `fleet up` in a new session with its output in ``logs/fleet-up.log``; relay that log
    until every replica is READY, a replica fails, or the background process exits."""
    log_path = store.log_dir / "fleet-up.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "fleet.cli", "up", *map(str, files), "--port", str(port), "--host", host,
            "--state-dir", str(store.root)]  # fmt: skip
    if metrics_port is not None:
        argv += ["--metrics-port", str(metrics_port)]
    if prices is not None:
        argv += ["--prices", str(prices.resolve())]
    if picker_port:
        argv += ["--picker-port", str(picker_port)]
    if picker_metrics_port is not None:
        argv += ["--picker-metrics-port", str(picker_metrics_port)]
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
    by process identity: what a controller that died left serving. Writes nothing (a full disk
    must not fail `fleet status`)."""
    from fleet.local.backend import LocalBackend
    from fleet.inventory import NodeInventory
    from fleet.local.routerproc import router_record_alive

    if not (store.root / "fleet-id").exists():
        return [], None
    backend = LocalBackend(store.root, store.fleet_id(), NodeInventory(name="local"), read_only=True)
    facts = asyncio.run(backend.observe())
    return sorted(rid for rid, f in facts.items() if f.running), router_record_alive(store.root)


TERMINAL_SHOWN_S = 600.0
"""How long a replica that ended (TERMINATED, FAILED_*) stays in `fleet status` after it ended;
older ones are in ``events.jsonl`` of the state directory (`fleet status --all` shows them)."""


def _up_pid(store: StateStore, state: dict) -> int | None:
    """The pid of the `fleet up` that runs on ``store`` now, or None: the holder of its lock
    (works when state.json does not), else the pid state.json names if it still runs."""
    holder = store.holder_pid()
    if holder is not None and _pid_alive(holder):
        return holder
    pid = state.get("pid")
    return pid if _pid_alive(pid) and state.get("phase") not in ("stopped", "exited") else None


def _cpu_sharing(replicas: list[dict]) -> list[str]:
    """`fleet.placement.cpu.cpu_sharing_notes` over the state file's live replicas."""
    from fleet.placement.cpu import cpu_sharing_notes
    from fleet.placement.shapes import ReplicaPlacement

    return cpu_sharing_notes(ReplicaPlacement.from_dict(r["placement"]) for r in replicas if r.get("placement")
                             and r["status"] != "TERMINATED" and not r["status"].startswith("FAILED"))  # fmt: skip


@app.command()
def status(
    state_dir: StateDir = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the raw state as JSON.")] = False,
    log_lines: Annotated[int, typer.Option(help="Engine log lines shown for a failed replica.")] = 8,
    show_all: Annotated[bool, typer.Option("--all", help="Also replicas that ended more than "
                                           f"{TERMINAL_SHOWN_S / 60:.0f} min ago.")] = False,
) -> None:
    """Show the deployments and replicas of the local fleet.

    For each replica: state, endpoint, devices, and for a failed one the reason and the engine's
    last log lines; a replica the router has ejected (it stalled or failed in a row) or that is
    stalling says so (asked of the router live: `fleet.observability.outliers`). When the controller is gone but engines or the router still run, says so
    (`fleet up` adopts them, `fleet down` stops them). Writes that `fleet up` could not make
    (full disk, closed output) are listed. When state.json cannot be read, says why and shows
    what still runs (exit code 1)."""
    store = StateStore(state_dir or default_state_dir())
    try:
        state = store.read()
    except StateUnreadable as err:
        err_console.print(f"[bold red]{err}[/]", highlight=False)
        _print_survivors(store, _up_pid(store, {}))
        raise typer.Exit(1) from None
    if state is None:
        err_console.print(f"No fleet state in {store.root}: `fleet up` has not run there.")
        _print_survivors(store, _up_pid(store, {}))
        raise typer.Exit(1)
    pid = _up_pid(store, state)
    running = pid is not None
    orphans, router_left = ([], None) if running else _orphans(store)
    from fleet.observability.outliers import read_outlier_notes

    # What the router's outlier detection says of each endpoint (ejected, stalling): asked live.
    router_notes = read_outlier_notes(state.get("router_url", ""), store.admin_token()) if running else {}
    if as_json:
        console.print_json(json.dumps({**state, "running": running, "orphaned_replicas": orphans,
                                       "orphaned_router": router_left, "router_outliers": router_notes}))  # fmt: skip
        return
    age_s = time.time() - state.get("updated_at_unix", time.time())
    phase = state.get("phase", "?") if running else "not running"
    console.print(
        f"Fleet [bold]{phase}[/] (pid {pid or state.get('pid')}), router {state.get('router_url')}, "
        f"state updated {age_s:.0f} s ago", highlight=False,
    )
    if running and age_s > STALE_STATE_S:
        console.print(f"[bold yellow]state.json has not been written for {age_s:.0f} s[/] (it is written every "
                      "second): `fleet up` cannot write its state directory; the fleet keeps serving",
                      highlight=False)  # fmt: skip
    _print_write_errors(state.get("control_write_errors") or {})
    if orphans or router_left:
        what = ([f"{len(orphans)} engine(s) ({', '.join(orphans)})"] if orphans else []) + (
            [f"the router (pid {router_left[1]}, {router_left[0]})"] if router_left else [])
        console.print(f"[bold yellow]The controller is not running, but {' and '.join(what)} still run.[/] "
                      "`fleet up FILES` adopts them; `fleet down` stops them.", highlight=False)  # fmt: skip
    console.print(f"Nodes: {'; '.join(state.get('inventory', [])) or '?'}", highlight=False)
    agent_status = read_json(store.root / "node-agent.json")
    if agent_status:
        from fleet.agent.runner import status_lines

        for line in status_lines(agent_status):
            console.print(f"[yellow]{line}[/]", highlight=False)
    deps = Table(title="Deployments", title_justify="left")
    for col in ("deployment", "model", "ready/desired", "standby", "policy", "autoscaling", "last decision", "source"):
        deps.add_column(col)
    replicas = state.get("replicas", [])
    standby = state.get("standby") or {}
    for name, d in state.get("deployments", {}).items():
        ready = sum(1 for r in replicas if r["deployment"] == name and r["status"] == "READY")
        deps.add_row(name, d["model"], f"{ready}/{d['desired']}", _standby_column(standby.get(name)), d["policy"],
                     *_scaling_columns(d), d["source"])  # fmt: skip
    console.print(deps)
    for name, s in sorted(standby.items()):
        if s.get("unsupported"):
            console.print(f"[yellow]{name}: spec.standby is off:[/] {s['unsupported']}", highlight=False)
    print_status_revisions(console, state)
    table = Table(title="Replicas", title_justify="left")
    for col in ("replica", "status", "endpoint", "devices", "pid", "age", "detail"):
        table.add_column(col)
    clock_now = state.get("clock_s", 0.0) + (age_s if running else 0.0)
    shown = replicas if show_all else [r for r in replicas if not _ended_long_ago(r, clock_now)]
    for r in shown:
        st = r["status"]
        style = ("green" if st == "READY" else "red" if st.startswith("FAILED") else "yellow" if st == "DRAINING"
                 else "cyan" if st == "STANDBY" else "")
        detail = (r.get("failure") or {}).get("reason") or r.get("waiting_reason") or ""
        if st == "DRAINING" and r.get("drain_reason"):
            detail = r["drain_reason"]
        elif st == "CACHING":
            detail = (r.get("detail") or {}).get("cache", "")
        elif st == "STANDBY":
            detail = "asleep (sleep mode level 1)" if r.get("sleep_sent_at_s") is not None else "leaving the pool to sleep"
        elif st == "READY" and r.get("woke_at_s") is not None and r.get("warmup_passed_at_s") is not None:
            detail = f"woken: {r['warmup_passed_at_s'] - r['woke_at_s']:.1f} s from wake to ready"
        if r.get("adopted_at_s") is not None and not st.startswith("FAILED"):
            detail = detail or "adopted"
        if r["id"] in router_notes:
            detail = f"[bold yellow]{router_notes[r['id']]}[/]" + (f"; {detail}" if detail else "")
        table.add_row(
            r["id"], f"[{style}]{st}[/]" if style else st, r.get("endpoint") or "-", r.get("assignment") or "-",
            (r.get("detail") or {}).get("pid", "-"), f"{clock_now - r['created_at_s']:.0f} s", detail,
        )
    console.print(table)
    for note in _cpu_sharing(replicas):
        console.print(note, style="yellow", highlight=False)
    if len(shown) < len(replicas):
        console.print(f"{len(replicas) - len(shown)} replica(s) that ended over {TERMINAL_SHOWN_S / 60:.0f} min ago "
                      f"not shown (`--all`; every transition: {store.events_path})", style="dim",
                      highlight=False)  # fmt: skip
    _print_preemptions(state, clock_now)
    for r in shown:
        failure = r.get("failure")
        if failure and failure.get("log_tail") and log_lines > 0:
            console.print(f"[red]{r['id']}[/] {failure['status']}: {failure['reason']}", highlight=False)
            console.print(f"  last engine log lines ({(r.get('detail') or {}).get('log')}):", style="dim",
                          highlight=False)  # fmt: skip
            for line in failure["log_tail"][-log_lines:]:
                console.print(f"  | {line}", markup=False, highlight=False, style="dim")


def _standby_column(s: dict | None) -> str:
    """``asleep/target`` standby replicas of a deployment (state.json's ``standby``), or ``-`` when off."""
    if not s or not s.get("target"):
        return "-"
    return f"{s.get('asleep', 0)}/{s['target']}"


STALE_STATE_S = 10.0
"""A running `fleet up` writes state.json every second; older than this, `fleet status` warns."""


def _ended_long_ago(r: dict, clock_now: float) -> bool:
    """Whether replica record ``r`` (state.json) ended more than `TERMINAL_SHOWN_S` ago."""
    if r.get("status") not in ("TERMINATED",) and not str(r.get("status", "")).startswith("FAILED"):
        return False
    ended = r.get("exited_at_s") or (r.get("failure") or {}).get("at_s")
    return ended is not None and clock_now - ended > TERMINAL_SHOWN_S


def _print_write_errors(errors: dict) -> None:
    """One line per write target of `fleet up` that failed (`fleet.local.failsoft.WriteErrors.snapshot`)."""
    for target, e in sorted(errors.items()):
        now = "[bold red]failing now[/]" if e.get("failing") else "recovered"
        console.print(f"[yellow]Writes of {target} failed {e.get('errors')} time(s)[/] ({now}; last: "
                      f"{e.get('last_error')}); the fleet kept serving", highlight=False)  # fmt: skip


def _print_survivors(store: StateStore, pid: int | None) -> None:
    """What runs of the fleet in ``store`` when its state cannot be shown: `fleet up`, engines, router."""
    orphans, router_left = _orphans(store)
    if pid is None and not orphans and router_left is None:
        return
    if pid is not None:
        console.print(f"`fleet up` runs (pid {pid}); it writes state.json again within a second.", highlight=False)
    if orphans:
        console.print(f"Engines running: {', '.join(orphans)}", highlight=False)
    if router_left:
        console.print(f"Router running: pid {router_left[1]} on {router_left[0]}", highlight=False)
    if pid is None:
        console.print("`fleet up FILES` adopts them; `fleet down` stops them.", highlight=False)


def _print_preemptions(state: dict, clock_now: float) -> None:
    """The latest preemptions (`fleet.controller.preemption.Preemptor.recent`), when there were any."""
    recent = ((state.get("preemption") or {}).get("recent")) or []
    if not recent:
        return
    table = Table(title="Preemptions (latest)", title_justify="left")
    for col in ("replica", "deployment", "for", "ago", "devices", "reason"):
        table.add_column(col)
    for e in recent[-10:]:
        table.add_row(e.get("replica", "?"), e.get("deployment", "?"), e.get("for", "?"),
                      f"{clock_now - e.get('at_s', clock_now):.0f} s", ",".join(e.get("devices") or []),
                      e.get("reason", ""))  # fmt: skip
    console.print(table)


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
    from fleet.local.up import run_down

    store = StateStore(state_dir or default_state_dir())
    try:
        state = store.read() or {}
    except StateUnreadable:
        state = {}   # `fleet up` is found by its lock; `run_down` says why and works from the other records
    pid = _up_pid(store, state)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        console.print(f"Sent SIGTERM to fleet up (pid {pid}); draining...")
        deadline = time.monotonic() + timeout_s
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _pid_alive(pid):
            err_console.print(f"[red]fleet up (pid {pid}) still running after {timeout_s:g} s[/]")
            raise typer.Exit(1)
        orphans, router_left = _orphans(store)
        if not orphans and router_left is None:
            console.print("Fleet stopped.")
            return
        console.print("fleet up ended, leaving processes behind: stopping them...")
    try:
        code = asyncio.run(run_down(store, console))
    except AlreadyRunning as err:
        err_console.print(f"[red]{err}[/]", highlight=False)
        raise typer.Exit(2) from None
    if code == 3:
        raise typer.Exit(1)
    console.print("Fleet stopped." if code == 0 else f"No running fleet in {store.root}.")


@app.command()
def logs(
    name: Annotated[str, typer.Argument(help="`controller` (the output of `fleet up`), `router`, or a replica id.")]
    = "controller",
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines until Ctrl-C.")] = False,
    lines: Annotated[int, typer.Option("--lines", "-n", help="Lines of the end of the log to print first.")] = 50,
    state_dir: StateDir = None,
) -> None:
    """Print the log of the controller, the router or one replica's engine.

    The controller's log is the output of `fleet up` (in the background with --detach, or in the
    foreground: a copy of what it prints); `fleet status` lists replica ids."""
    from fleet.local.procs import read_log_tail

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
    from router.http.server import serve

    token = os.environ.get("FLEET_ROUTER_ADMIN_TOKEN")
    if not token:
        err_console.print("FLEET_ROUTER_ADMIN_TOKEN is not set: the admin API needs a token.")
        raise typer.Exit(2)
    serve(host, port, token)
