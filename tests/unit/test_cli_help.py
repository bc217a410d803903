"""`fleet --help` and every command's help: flags shown as flags (no value type beside `--once`),
other options with their type, and the commands in the panels of `fleet.cli.PANELS` (fleet/cli/)."""

from __future__ import annotations

import re

import click
import pytest
import typer
from typer.testing import CliRunner

from fleet.cli import PANELS, app

runner = CliRunner()


def commands(group: click.Group, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], click.Command]]:
    """Every command under ``group`` with its path of names, groups included."""
    out = []
    with click.Context(group) as ctx:
        for name in group.list_commands(ctx):
            command = group.get_command(ctx, name)
            out.append(((*path, name), command))
            if isinstance(command, click.Group):
                out += commands(command, (*path, name))
    return out


ROOT = typer.main.get_command(app)
ALL = commands(ROOT)
FLAGGED = [(path, cmd) for path, cmd in ALL if any(getattr(p, "is_flag", False) for p in cmd.params)]


def help_of(path: tuple[str, ...], columns: int = 120) -> str:
    result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)}, terminal_width=columns)
    assert result.exit_code == 0, (path, result.output)
    return result.output


def option_row(text: str, option: str) -> str:
    """The help row that starts with ``option`` (between the panel's borders)."""
    starts = re.compile(r"│[ *]{1,6}" + re.escape(option) + "[ ,]")   # an option's own row, not its name in a help text
    rows = [line.strip("│ *") for line in text.splitlines() if starts.match(line)]
    assert rows, (option, text)
    return rows[0]


def test_there_are_flags_to_check():
    assert len(FLAGGED) >= 5 and ("top",) in [p for p, _ in FLAGGED]


@pytest.mark.parametrize("path", [p for p, _ in FLAGGED] + [()], ids=lambda p: " ".join(p) or "fleet")
def test_every_flag_shows_no_value_type_and_other_options_keep_theirs(path):
    text = help_of(path)
    command = dict(ALL).get(path, ROOT)
    assert "<bool>" not in text, text
    for param in command.params:
        if param.param_type_name != "option" or not param.opts[0].startswith("--"):
            continue
        if param.hidden:
            continue
        row = option_row(text, param.opts[0])
        typed = any(re.match(r"<[^>]+>", column) for column in re.split(r"\s{2,}", row))   # a column `<float>`
        assert typed is not param.is_flag, row     # `--once   Print one frame...`; `--interval-s   <float range>`
    assert option_row(text, "--help").split()[1] == "Show", text


def test_a_flag_takes_no_value():
    result = runner.invoke(app, ["top", "--once", "true", "--state-dir", "/nonexistent"])
    assert result.exit_code == 2 and "unexpected extra argument" in result.output.lower(), result.output


def test_every_command_sits_in_one_panel_and_help_lists_the_panels_in_order():
    top_level = [p[0] for p, _ in ALL if len(p) == 1]
    listed = [name for names in PANELS.values() for name in names]
    assert sorted(listed) == sorted(top_level), "a command in no panel, or in two"
    assert len(top_level) >= 20
    for columns in (80, 120):
        text = help_of((), columns)
        titles = [line.split("─ ")[1].split(" ─")[0] for line in text.splitlines() if line.startswith("╭─ ")]
        assert titles == ["Options", *PANELS], text
        assert top_level[0] == "up" and text.index(" up ") < text.index(" validate ")
