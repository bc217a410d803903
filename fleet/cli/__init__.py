"""The `fleet` command line (typer + rich): one app, every command registered here, one way.

Each module of this package owns a group of commands (their arguments, help texts and output)
and exposes them on its own ``app = typer.Typer()``; this module merges them into the `fleet`
app in the order `fleet --help` lists them. The work is done elsewhere: the commands call
`fleet.local` (`fleet up` and friends), `fleet.placement`, `fleet.agent`, `fleet.tracesim`,
`fleet.k8s` and `fleet.observability`; `fleet explain` walks the spec models themselves.

| module | commands |
|---|---|
| `fleet.cli.local` | validate, up, status, down, logs, router |
| `fleet.cli.rollout` | apply, rollout status/pause/resume/promote/abort, simulate-rollout |
| `fleet.cli.placement` | plan, inventory |
| `fleet.cli.engines` | sim-engine, make-tiny-model |
| `fleet.cli.agent` | cache ls/pull/rm/verify/manifest, node-agent |
| `fleet.cli.simulate` | simulate |
| `fleet.cli.observability` | prometheus-config, dashboard, rules, top |
| `fleet.cli.k8s` | crd, operator, router-pod, endpoint-picker |
| `fleet.cli.explain` | explain |

`fleet --help` lists the commands in the panels of `PANELS` (typer's ``rich_help_panel``), in
that order, through `PanelledGroup`. Shared options, consoles and error output:
`fleet.cli.common`.
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from fleet.cli import agent, engines, explain, k8s, local, observability, placement, rollout, simulate

PANELS: dict[str, tuple[str, ...]] = {
    "Run on this machine": ("up", "status", "top", "logs", "down"),
    "Deployments": ("validate", "plan", "apply", "rollout", "explain"),
    "Kubernetes and nodes": ("operator", "crd", "router-pod", "router", "endpoint-picker", "node-agent",
                             "pod-devices", "cache", "inventory"),
    "Observability": ("prometheus-config", "dashboard", "rules"),
    "Simulate and develop": ("simulate", "simulate-rollout", "sim-engine", "make-tiny-model"),
}
"""`fleet --help`'s panels, each with its commands in the order listed; every command is in one
(tests/unit/test_fleet_cli.py)."""


class PanelledGroup(TyperGroup):
    """The `fleet` group: its commands ordered as `PANELS` lists them, each in its panel (a
    command no panel names comes last, in typer's default "Commands" panel)."""

    def __init__(self, *, commands: dict | None = None, **kwargs) -> None:
        order = {name: i for i, name in enumerate(n for names in PANELS.values() for n in names)}
        commands = dict(sorted((commands or {}).items(), key=lambda kv: order.get(kv[0], len(order))))
        for panel, names in PANELS.items():
            for name in names:
                if name in commands:
                    commands[name].rich_help_panel = panel
        super().__init__(commands=commands, **kwargs)


app = typer.Typer(
    name="fleet",
    cls=PanelledGroup,
    help="Fleet: place, warm, route and scale LLM inference replicas (vLLM) from a deployment YAML.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",   # help paragraphs reflow to the terminal's width
)
for _group in (local, engines, placement, agent, simulate, rollout, observability, k8s, explain):
    app.add_typer(_group.app)
