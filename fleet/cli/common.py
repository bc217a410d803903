"""What every `fleet` command shares: the consoles, common options, and error output.

Owns `console` / `err_console` (rich; 160 columns off a terminal), the `StateDir` and `Files`
option types, `fail_with` (print problems, exit 2) and `load_or_exit` (deployment files ->
`fleet.spec.LoadedDeployment` list, or exit 2 naming every problem), and `show_flags_as_flags`
(applied on import). Imported by every module of `fleet.cli`; imports only `fleet.spec`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from typer.core import TyperOption

from fleet.spec import LoadedDeployment, SpecError, load_deployments


def show_flags_as_flags() -> None:
    """Make rich help show a flag (``--once``, ``--help``, a count) without a value type.

    typer 0.29's rich help (`typer.rich_utils._print_options_panel`) prints
    `TyperOption.display_type_rich` for every option, and that returns the type label for flags
    too (``--once <bool>``), while its plain help (`TyperOption.get_help_record`) leaves the type
    out when ``is_flag or count``. This gives the rich help the plain help's rule. Idempotent."""
    shown = TyperOption.display_type_rich
    if getattr(shown, "fleet_flags_as_flags", False):
        return

    def display_type_rich(self: TyperOption, ctx) -> str | None:
        return None if self.is_flag or self.count else shown(self, ctx)

    display_type_rich.fleet_flags_as_flags = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


show_flags_as_flags()

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


def fail_with(title: str, problems: list[str]) -> typer.Exit:
    """Print ``title`` and one line per problem on stderr; return the exit (code 2) to raise."""
    err_console.print(f"[bold red]{title} ({len(problems)} problem(s)):[/]")
    for line in problems:
        err_console.print(f"  {line}", markup=False, highlight=False)
    return typer.Exit(2)


def load_or_exit(files: list[Path]) -> list[LoadedDeployment]:
    """The deployments of ``files``; on any invalid document, every problem printed and exit 2."""
    try:
        return load_deployments(files)
    except SpecError as err:
        raise fail_with("Invalid deployment spec", err.problems) from None


def read_json(path: Path) -> dict | None:
    """The JSON document in ``path``, or None when it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
