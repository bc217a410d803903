"""The README's "Headline figures" table states the figures of the docs page each row links to.

Each row of README.md's headline table links to a section of a docs page (usually
docs/benchmarks.md); every number in the row's figure cell (the second column) must appear, as the
same number string, in that section: the heading the link's anchor names, down to the next heading
of the same or a higher level. A README figure edited without the docs (or a docs figure moved by a
rerun without the README) fails here, naming the row, the README's number and the section's
numbers of the same form nearest to it (the docs' figure among them when a figure was edited).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

NUMBER = re.compile(r"(?<![\w.])\d[\d,]*(?:\.\d+)?(?:-\d[\d,]*(?:\.\d+)?)?(?![\w])")
"""A figure as written: `29.6`, `7,374`, `85.2` (of `85.2%`), `1.24` (of `1.24x`), or a range
`4.5-5.8`. Digits inside a word (`p99`, `H100`, `x15.2`) are not figures."""


@dataclass(frozen=True)
class Row:
    what: str
    figure: str
    target: str   # the link in the first cell, relative to the repository root


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens
    (the rule tests/unit/test_docs.py checks every link against)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def headline_rows(text: str) -> list[Row]:
    """The rows of the table under `## Headline figures`, header and separator left out.

    Raises AssertionError when the README has no such table."""
    lines = text.splitlines()
    start = lines.index("## Headline figures")
    rows, in_table = [], False
    for line in lines[start + 1:]:
        if line.startswith("#"):
            break
        if not line.startswith("|"):
            if in_table:
                break
            continue
        in_table = True
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or set(cells[0]) <= set("-: ") or cells[0] == "what":
            continue
        link = re.search(r"\]\(([^)\s]+)\)", cells[0])
        rows.append(Row(what=cells[0], figure=cells[1], target=link.group(1) if link else ""))
    assert rows, "README.md has no rows under '## Headline figures'"
    return rows


def section(path: Path, anchor: str) -> str:
    """The text of the heading of `path` whose anchor is `anchor`, down to the next heading of the
    same or a higher level (code blocks are not scanned for headings).

    Raises LookupError when no heading has that anchor."""
    lines = path.read_text().splitlines()
    in_code, start, level = False, None, 0
    for number, line in enumerate(lines):
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = None if in_code else re.match(r"(#{1,6}) (.+)", line)
        if not m:
            continue
        if start is not None and len(m.group(1)) <= level:
            return "\n".join(lines[start:number])
        if start is None and _slug(m.group(2)) == anchor:
            start, level = number, len(m.group(1))
    if start is None:
        raise LookupError(f"no heading with anchor #{anchor} in {path.relative_to(REPO)}")
    return "\n".join(lines[start:])


def numbers(text: str) -> list[str]:
    return NUMBER.findall(text.replace("**", ""))


def _nearest(number: str, candidates: list[str], k: int = 3) -> list[str]:
    """The `k` distinct candidates of the same form (a range or not, as many decimals) closest in
    value to `number`, closest first."""
    def form(s: str) -> tuple[bool, int]:
        first = s.split("-")[0]
        return "-" in s, len(first.partition(".")[2])

    def value(s: str) -> float:
        return float(s.split("-")[0].replace(",", ""))

    same = {c for c in candidates if form(c) == form(number)}
    return sorted(same, key=lambda c: (abs(value(c) - value(number)), c))[:k]


def mismatches(row: Row) -> list[str]:
    """One message per number of the row's figure that its linked section does not state."""
    file_part, _, anchor = row.target.partition("#")
    if not file_part or not anchor:
        return [f"row {row.what!r} links to no docs section ({row.target or 'no link'})"]
    text = section(REPO / file_part, anchor)
    stated = numbers(text)
    out = []
    for number in numbers(row.figure):
        if number not in stated:
            near = _nearest(number, stated)
            docs_says = f"its nearest figures: {', '.join(near)}" if near else "it has no figure of that form"
            out.append(f"row {row.what!r}: README says {number}, {row.target} does not ({docs_says})")
    return out


ROWS = headline_rows(README.read_text())


@pytest.mark.parametrize("row", ROWS, ids=lambda r: re.sub(r"\]\(.*", "", r.what).strip("[`"))
def test_each_headline_figure_is_the_docs_figure(row: Row):
    assert mismatches(row) == []


def test_an_edited_figure_is_caught():
    """The check can fail: a README row whose figure differs from its section's is reported with
    both numbers."""
    row = next(r for r in ROWS if "2.39" in r.figure)
    edited = Row(what=row.what, figure=row.figure.replace("2.39", "2.40"), target=row.target)
    [message] = mismatches(edited)
    assert "README says 2.40" in message and "2.39" in message.partition("nearest figures:")[2]


def test_numbers_are_read_as_written():
    assert numbers("p99 TTFT **2.39 s**, 85.2% within 2 s; 7,374 req/s; 4.5-5.8 ms; x15.2; H100") == \
        ["2.39", "85.2", "2", "7,374", "4.5-5.8"]
