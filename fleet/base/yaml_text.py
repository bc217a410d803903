"""What a YAML syntax error says to a person: the file, the line and column, pyyaml's reason
and the line itself with a caret under the column.

Owns `yaml_problem`. Called wherever Fleet reads a YAML file a person wrote: deployment specs
(`fleet.spec.load_deployments`), inventories (`fleet.inventory.file`), prices (`fleet.pricing`).
"""

from __future__ import annotations

import yaml

INDENTATION_ERRORS = ("expected <block end>", "mapping values are not allowed here",
                      "could not find expected ':'", "did not find expected key")
"""pyyaml's reasons for what is, in a hand-written file, nearly always a misindented line."""


def yaml_problem(where: str, err: yaml.YAMLError) -> str:
    """``"<where>: invalid YAML at line L, column C: <reason>"`` followed by the offending line
    and a caret under column C (lines joined by "\\n", the quoted lines indented four spaces;
    none at the end of the file), with a hint where the reason is a misindented line
    (`INDENTATION_ERRORS`); without a position, pyyaml's own words."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    reason = getattr(err, "problem", None) or str(err)
    if mark is None:
        return f"{where}: invalid YAML: {reason}"
    context = getattr(err, "context", None)
    head = f"{where}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {reason}"
    if context:
        head += f" ({context})"
    if any(words in reason for words in INDENTATION_ERRORS):
        head += "; check this line's indentation against the lines above it"
    snippet = mark.get_snippet(indent=4, max_length=100) if mark.buffer is not None else None
    shown = snippet is not None and snippet.split("\n", 1)[0].strip()   # the end of the file: no line to show
    return f"{head}\n{snippet}" if shown else head
