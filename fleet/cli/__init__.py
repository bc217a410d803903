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

Shared options, consoles and error output: `fleet.cli.common`.
"""

from __future__ import annotations

import typer

from fleet.cli import agent, engines, explain, k8s, local, observability, placement, rollout, simulate

app = typer.Typer(
    name="fleet",
    help="Fleet: place, warm, route and scale LLM inference replicas (vLLM) from a deployment YAML.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",   # help paragraphs reflow to the terminal's width
)
for _group in (local, engines, placement, agent, simulate, rollout, observability, k8s, explain):
    app.add_typer(_group.app)
