"""`fleet apply` and `fleet rollout status|pause|resume|promote|abort`, and the rollout lines of
`fleet status`.

Owns the commands' arguments, help and output; the request goes to the running `fleet up`
through its state directory (`fleet.local.control`), which hands it to the controller
(`fleet.controller.rollouts`). `fleet apply` first runs the checks of `fleet validate` on each
file (`fleet.cli.models.model_problems`: the model, its fit, ``--max-model-len``, the engine args
through the installed vLLM's parser), so a spec vLLM would refuse is never handed over.
Registered on the `fleet` app by `fleet.cli`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fleet.cli.common import console, err_console, fail_with
from fleet.local.control import ControlError, apply_request, rollout_request, submit
from fleet.controller.rollouts import COMMANDS
from fleet.spec import SpecError, load_deployments
from fleet.local.state import StateStore, default_state_dir

app = typer.Typer()
rollout_app = typer.Typer(help="Canary rollouts of the running `fleet up`: status, pause, resume, promote, abort.",
                          no_args_is_help=True, add_completion=False)  # fmt: skip

StateDir = Annotated[Optional[Path], typer.Option("--state-dir", envvar="FLEET_STATE_DIR",
                                                  help="State directory of the running `fleet up`.")]  # fmt: skip


def _running(store: StateStore) -> bool:
    state = store.read_or_none() or {}
    pid = state.get("pid") or store.holder_pid()
    if not pid or state.get("phase") == "stopped":
        return False
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def _running_store(state_dir: Optional[Path], err: Console) -> StateStore:
    """The state store of the running `fleet up`; none running: says so and exits 1."""
    store = StateStore(state_dir or default_state_dir())
    if not _running(store):
        err.print(f"[red]No `fleet up` runs with state in {store.root}[/]; start one with `fleet up FILES`.")
        raise typer.Exit(1)
    return store


def _send(request: dict, state_dir: Optional[Path], console: Console, err: Console) -> dict:
    store = _running_store(state_dir, err)
    try:
        reply = submit(store.root, request, alive=lambda: _running(store))
    except ControlError as e:
        err.print(f"[red]{e}[/]", highlight=False)
        raise typer.Exit(1) from None
    out = console if reply.get("ok") else err
    for line in reply.get("lines") or []:
        if line:
            out.print(line, highlight=False, markup=False)
    if not reply.get("ok"):
        raise typer.Exit(1)
    return reply


@app.command("apply", short_help="Hand changed deployments to the running fleet up (validated first).")
def apply_cmd(files: Annotated[list[Path], typer.Argument(help="Deployment YAML files to apply.")],
              state_dir: StateDir = None,
              vllm_check: Annotated[bool, typer.Option(
                  "--vllm-check/--no-vllm-check", help="Check engine args with the installed vLLM's own parser, as "
                  "fleet validate does (--no-vllm-check skips it).")] = True) -> None:  # fmt: skip
    """Hand changed deployments to the running `fleet up` (validated first: an invalid file
    changes nothing and says why).

    The checks are `fleet validate`'s: the spec, then the model (a missing path, a
    tensorParallelSize or --max-model-len vLLM refuses for it, a GPU that cannot hold it) and
    the engine args through the installed vLLM's own parser (--no-vllm-check skips that one).
    Any problem: exit 2, nothing applied.

    A change of `spec.model.source`, `spec.model.revision` or `spec.engine` (image, args,
    env) starts a new revision: a canary rollout with `spec.rollout.strategy: canary`,
    else a replacement (new replicas READY first, then the old ones drain). Other changes
    (replicas, autoscaling bounds, routing, rollout settings) apply in place."""
    from fleet.cli.models import model_problems   # the model readers: loaded for apply alone

    try:
        loaded = load_deployments(files)
    except SpecError as e:
        err_console.print(f"[bold red]Invalid deployment spec ({len(e.problems)} problem(s)); nothing applied:[/]")
        for line in e.problems:
            err_console.print(f"  {line}", markup=False, highlight=False)
        raise typer.Exit(2) from None
    _running_store(state_dir, err_console)   # before the checks: they may import vLLM
    _, problems = model_problems(loaded, vllm_check=vllm_check)
    if problems:
        raise fail_with("Deployment checks failed; nothing applied", problems)
    _send(apply_request(loaded), state_dir, console, err_console)


def _command(command: str):
    def run(deployment: Annotated[str, typer.Argument(help="Deployment name (metadata.name).")],
            state_dir: StateDir = None) -> None:  # fmt: skip
        reply = _send(rollout_request(deployment, command), state_dir, console, err_console)
        print_rollout(console, reply.get("status") or {})
    run.__doc__ = {
        "status": "Show the revisions, their weights and replicas, the rollout's step and last analysis.",
        "pause": "Hold the rollout at its current weight (analysis goes on and may still roll back).",
        "resume": "Continue a paused rollout.",
        "promote": "Make the canary the stable revision now, skipping the remaining steps.",
        "abort": "Roll the canary back: weight 0, its requests finish, its replicas stop.",
    }[command]
    return run


for _name in COMMANDS:
    rollout_app.command(_name)(_command(_name))
app.add_typer(rollout_app, name="rollout")


@app.command("simulate-rollout",
             short_help="Canary rollouts in the trace SIMULATOR: Fleet's analysis against two baselines.")
def simulate_rollout(
    trace: Annotated[Path, typer.Argument(help="Request trace (Azure LLM CSV or Fleet JSONL), e.g. "
                                               "loadtests/traces/azure-llm-2023/conv.csv.")],
    deployment: Annotated[Path, typer.Option("--deployment", "-d", help="Deployment YAML with spec.rollout "
                                             "(strategy canary); spec.model.source sim://<profile>.")],
    rate_scale: Annotated[int, typer.Option("--rate-scale", min=1, help="K times the trace's rate.")] = 1,
    judges: Annotated[str, typer.Option(help="Comma-separated judges: fleet, abs-p99, success-rate.")] = (
        "fleet,abs-p99,success-rate"),
    variants: Annotated[str, typer.Option(help="Comma-separated canaries: identical, ttft+30%, tpot+30%, "
                                          "errors-2%, no-traffic.")] = "identical,ttft+30%,tpot+30%,errors-2%,no-traffic",
    rollout_start_s: Annotated[float, typer.Option("--rollout-start-s", min=0.0,
                                                   help="Virtual second the rollout starts.")] = 600.0,
    max_rollout_s: Annotated[float, typer.Option("--max-rollout-s", min=1.0,
                                                 help="Undecided after this many seconds.")] = 1200.0,
    canary_startup_s: Annotated[float, typer.Option("--canary-startup-s", min=0.0,
                                                    help="Seconds until a canary replica is READY.")] = 60.0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the outcomes as JSON here.")] = None,
) -> None:
    """Canary rollouts in the trace SIMULATOR: each judge (Fleet's analysis and two baselines)
    against canaries that are identical, +30 % TTFT, +30 % TPOT, 2 % errors, or get no traffic;
    whether each is promoted or rolled back, how fast, and how many requests the canary served."""
    from rich.table import Table

    from fleet.tracesim.compare import profile_of
    from fleet.tracesim.rollout import VARIANTS, RolloutSimConfig, run_experiment
    from fleet.tracesim.workload import Workload
    from fleet.tracesim.traces import TraceError, load_trace
    from fleet.rollout.judges import judge_names

    try:
        loaded = load_deployments([deployment])
    except SpecError as e:
        for line in e.problems:
            err_console.print(line, markup=False, highlight=False)
        raise typer.Exit(2) from None
    dep = loaded[0].deployment
    by_name = {v.name: v for v in VARIANTS}
    chosen = [n.strip() for n in variants.split(",") if n.strip()]
    names = [n.strip() for n in judges.split(",") if n.strip()]
    problems = [f"--variants: unknown {n!r}; known: {', '.join(by_name)}" for n in chosen if n not in by_name]
    problems += [f"--judges: unknown {n!r}; known: {', '.join(judge_names())}" for n in names
                 if n not in judge_names()]  # fmt: skip
    if dep.spec.rollout.strategy != "canary":
        problems.append(f"{deployment}: spec.rollout.strategy must be canary")
    try:
        profile = profile_of(dep)
        workload = Workload.from_trace(load_trace(trace), profile, rate_scale=rate_scale)
    except (TraceError, ValueError, KeyError) as err:
        problems.append(str(err.args[0] if isinstance(err, KeyError) else err))
    if problems:
        for line in problems:
            err_console.print(f"[red]{line}[/]", highlight=False)
        raise typer.Exit(2)
    base = RolloutSimConfig(profile, dep.spec.replicas.desired_at_start, dep.spec.rollout, names[0],
                            by_name[chosen[0]], rollout_start_s=rollout_start_s, max_rollout_s=max_rollout_s,
                            canary_startup_s=canary_startup_s, routing_policy=dep.spec.routing.policy)  # fmt: skip
    console.print(f"{workload.source} x{rate_scale}: {len(workload.requests)} requests; "
                  f"{base.replicas} replicas of {profile.name}; rollout at {rollout_start_s:g} s "
                  "(simulated engines: fleet.enginesim)", highlight=False)  # fmt: skip
    with err_console.status("Simulating rollouts..."):
        outcomes = run_experiment(base, workload, names, tuple(by_name[n] for n in chosen))
    table = Table(title="Canary rollouts (trace SIMULATOR)", title_justify="left")
    for col in ("canary", "judge", "decision", "decided after", "canary requests", "canary failed", "right?"):
        table.add_column(col)
    for o in outcomes:
        after = f"{o.decided_after_s:.0f} s" if o.decided_after_s is not None else f"> {max_rollout_s:g} s"
        table.add_row(o.variant, o.judge, o.decision, after, str(o.canary_requests), str(o.canary_failed),
                      "yes" if o.correct else "[red]no[/]")  # fmt: skip
    console.print(table)
    if json_out is not None:
        json_out.write_text(json.dumps([o.to_dict() for o in outcomes], indent=1) + "\n")
        console.print(f"Wrote {json_out}", highlight=False)


def print_rollout(console: Console, status: dict) -> None:
    """The revisions and rollout of one deployment (`Controller.rollout_status`)."""
    for r in status.get("revisions") or []:
        console.print(f"  {r['role']:<7} {r['label']:<24} weight {r['weight']:5.1f} %  "
                      f"replicas {r['ready']}/{r['replicas']} READY", highlight=False)  # fmt: skip
    ro = status.get("rollout")
    if ro:
        console.print(f"  rollout {ro['phase']}: step {ro['step_index']}, canary weight {ro['weight']:g} %, "
                      f"{ro['passes']} pass(es), {ro['failures']} failure(s), {ro['inconclusive_in_row']} "
                      f"inconclusive in a row{', ' + ro['reason'] if ro.get('reason') else ''}", highlight=False)  # fmt: skip
        if ro.get("runs"):
            last = ro["runs"][-1]
            said = last.get("summary") if last["verdict"] == "inconclusive" else None   # what it waits for
            console.print(f"  last analysis: {said or last['verdict']}", highlight=False, markup=False)
            for c in last["checks"]:
                console.print(f"    {c['verdict']:<12} {c['reason']}", highlight=False, markup=False)
    for line in (status.get("events") or [])[-5:]:
        console.print(f"  event: {line}", highlight=False, markup=False)


def print_status_revisions(console: Console, state: dict) -> None:
    """`fleet status`: per deployment with more than one revision or a rollout, its revisions."""
    for name, d in (state.get("deployments") or {}).items():
        revs = d.get("revisions") or {}
        rollout = revs.get("rollout")
        if not rollout and len(revs.get("specs") or {}) < 2:
            continue
        specs = revs.get("specs") or {}
        label = {h: s.get("label", h[:8]) for h, s in specs.items()}
        console.print(f"Rollout of {name}: stable {label.get(revs.get('stable'), '?')}"
                      + (f", canary {label.get(revs.get('canary'), '?')}" if revs.get("canary") else ""),
                      highlight=False)  # fmt: skip
        if rollout:
            print_rollout(console, {"rollout": rollout, "events": revs.get("events")})
