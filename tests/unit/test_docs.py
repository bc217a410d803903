"""The README and docs/ hold together: `.ci/run` finds the test command in README.md, the README
stays a short front page, every relative link and anchor in README.md and docs/ resolves, and the
autoscaling tables and the control-plane fault table in docs/ are the recorded runs
(loadtests/results/autoscaling-*.json, control-faults.jsonl)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = sorted([README, *(REPO / "docs").rglob("*.md")])

WRITTEN_ELSEWHERE = {REPO / "docs" / "architecture.md"}
"""Docs the README links to that another branch writes; a link to one is accepted while the file is
absent here (once it exists, its anchors are checked like any other)."""


def test_the_readme_is_a_short_front_page_with_contents():
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines: move detail into docs/ (at most 350)"
    assert "## Contents" in lines
    assert "./examples/quickstart.sh" in lines


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.+)", line)):
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[tuple[int, str]]:
    out, in_code = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
            continue
        if not in_code:
            line = re.sub(r"`[^`]*`", "", line)   # code spans are not links
            out += [(number, target) for target in re.findall(r"\]\(([^)\s]+)\)", line)]
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(doc: Path):
    problems = []
    for number, target in _links(doc):
        if re.match(r"[a-z]+:", target):
            continue   # http(s), mailto
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(REPO)}:{number}: ({target})"
        if not dest.exists():
            if dest not in WRITTEN_ELSEWHERE:
                problems.append(f"{where} no such file")
            continue
        if anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{where} no heading with anchor #{anchor} in {dest.relative_to(REPO)}")
    assert problems == [], "\n".join(problems)


def _row(name: str, s: dict) -> str:
    return (f"| {name} | {s['within_slo'] * 100:.1f}% | {s['ttft_p99_s']:.2f} s | {s['replica_hours']:.2f} | "
            f"{s['max_replicas']} | {s['scaling_actions']} | {s['failed']} |")


@pytest.mark.parametrize("run, docs", [
    ("autoscaling-code", ["autoscaling.md", "benchmarks.md"]),
    ("autoscaling-code-x2", ["autoscaling.md"]),
    ("autoscaling-conv", ["autoscaling.md"]),
    ("autoscaling-conv-x4", ["autoscaling.md", "benchmarks.md"]),
    ("autoscaling-standby-code", ["autoscaling.md", "benchmarks.md"]),
    ("autoscaling-standby4-code", ["autoscaling.md", "benchmarks.md"]),
    ("autoscaling-standby-conv-x4", ["autoscaling.md", "benchmarks.md"]),
    ("autoscaling-standby-conv", ["autoscaling.md"]),
])  # fmt: skip
def test_the_autoscaling_tables_are_the_recorded_runs(run: str, docs: list[str]):
    """Every policy's row of a `fleet simulate --compare` table in docs/ is its summary in the JSON
    the run wrote (a rerun that moves a figure must rewrite both)."""
    recorded = json.loads((REPO / "loadtests" / "results" / f"{run}.json").read_text())
    for doc in docs:
        text = (REPO / "docs" / doc).read_text()
        missing = [_row(r["name"], r["summary"]) for r in recorded["results"]
                   if _row(r["name"], r["summary"]) not in text]  # fmt: skip
        assert missing == [], f"docs/{doc} lacks these rows of loadtests/results/{run}.json: {missing}"


def test_the_control_fault_table_is_the_recorded_run():
    """docs/crash-safety.md shows the rows `python -m loadtests.fault_table --save` recorded
    (loadtests/results/control-faults.jsonl): a rerun that moves a figure rewrites both."""
    from loadtests.fault_table import RECORDED, read_rows, table

    text = (REPO / "docs" / "crash-safety.md").read_text()
    assert table(read_rows(RECORDED)) in text, f"docs/crash-safety.md lacks the table of {RECORDED.relative_to(REPO)}"
