"""`fleet apply` and `fleet rollout status|pause|resume|promote|abort`, and the rollout lines of
`fleet status`.

Owns the commands' arguments, help and output; the request goes to the running `fleet up`
through its state directory (`fleet.control`), which hands it to the controller
(`fleet.controller_rollouts`). Registered by `fleet.cli`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from fleet.control import ControlError, apply_request, rollout_request, submit
from fleet.controller_rollouts import COMMANDS
from fleet.spec import SpecError, load_deployments
from fleet.state import StateStore, default_state_dir

rollout_app = typer.Typer(help="Canary rollouts of the running `fleet up`: status, pause, resume, promote, abort.",
                          no_args_is_help=True, add_completion=False)  # fmt: skip

StateDir = Annotated[Optional[Path], typer.Option("--state-dir", envvar="FLEET_STATE_DIR",
                                                  help="State directory of the running `fleet up`.")]  # fmt: skip


def _running(store: StateStore) -> bool:
    state = store.read() or {}
    pid = state.get("pid")
    if not pid or state.get("phase") == "stopped":
        return False
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def _send(request: dict, state_dir: Optional[Path], console: Console, err: Console) -> dict:
    store = StateStore(state_dir or default_state_dir())
    if not _running(store):
        err.print(f"[red]No `fleet up` runs with state in {store.root}[/]; start one with `fleet up FILES`.")
        raise typer.Exit(1)
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


def register(app: typer.Typer, console: Console, err_console: Console) -> None:
    """Add `apply` and `rollout` to the `fleet` command line."""

    @app.command("apply")
    def apply_cmd(files: Annotated[list[Path], typer.Argument(help="Deployment YAML files to apply.")],
                  state_dir: StateDir = None) -> None:  # fmt: skip
        """Hand changed deployments to the running `fleet up` (validated first: an invalid file
        changes nothing and says why).

        A change of `spec.model.source`, `spec.model.revision` or `spec.engine` (image, args,
        env) starts a new revision: a canary rollout with `spec.rollout.strategy: canary`,
        else a replacement (new replicas READY first, then the old ones drain). Other changes
        (replicas, autoscaling bounds, routing, rollout settings) apply in place."""
        try:
            loaded = load_deployments(files)
        except SpecError as e:
            err_console.print(f"[bold red]Invalid deployment spec ({len(e.problems)} problem(s)); nothing applied:[/]")
            for line in e.problems:
                err_console.print(f"  {line}", markup=False, highlight=False)
            raise typer.Exit(2) from None
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

    for command in COMMANDS:
        rollout_app.command(command)(_command(command))
    app.add_typer(rollout_app, name="rollout")


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
            console.print(f"  last analysis: {last['verdict']}", highlight=False)
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
