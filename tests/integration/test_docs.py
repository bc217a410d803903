"""`.ci/run` finds the test command in README.md, by running the awk program it runs (a process:
the rest of the README and docs checks are in tests/unit/test_docs.py)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from tests.unit.test_docs import README, REPO  # the subject's helpers live in its unit file


"""Docs the README links to that another branch writes; a link to one is accepted while the file is
absent here (once it exists, its anchors are checked like any other)."""


def test_ci_finds_the_test_command_in_the_readme():
    """`.ci/run` runs the line after `<!-- test-command -->` (skipping the fence): the same awk program here."""
    if shutil.which("awk") is None:
        pytest.skip("no awk")
    program = re.search(r"awk '([^']+)' README\.md", (REPO / ".ci" / "run").read_text())
    assert program, ".ci/run no longer reads README.md with awk: update this test with it"
    found = subprocess.run(["awk", program.group(1), str(README)], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "./tests/run.sh"
