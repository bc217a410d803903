"""The fault table of docs/crash-safety.md: runs the control-plane fault suite
(tests/integration/test_control_faults.py) and prints one Markdown row per fault: requests
failed before their stream started out of all sent, streams cut, requests in flight on a killed
router, retries, tries whose connection was refused (rows recorded before that count: —), and the
time to recover, with what each recovery time is measured from.

```bash
flock /tmp/fleet-heavy.lock .venv/bin/python -m loadtests.fault_table            # run the suite, print the table
flock /tmp/fleet-heavy.lock .venv/bin/python -m loadtests.fault_table --save loadtests/results/control-faults.jsonl
.venv/bin/python -m loadtests.fault_table --rows loadtests/results/control-faults.jsonl   # print rows recorded earlier
```

Each test of the suite appends its row (one JSON object a line, to the file named by
``$FLEET_FAULT_ROWS``) once its load has run, before its assertions: a row that then fails is
in the table too (a test that failed before, e.g. on a recovery deadline, has none); pytest's
summary says which failed. Exit code: pytest's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "loadtests" / "results" / "control-faults.jsonl"
"""The rows docs/crash-safety.md shows (tests/unit/test_docs.py checks they match)."""
SUITE = "tests/integration/test_control_faults.py"
ROWS_ENV = "FLEET_FAULT_ROWS"   # read by tests/support/faults.py


def table(rows: list[dict]) -> str:
    """The Markdown table of ``rows`` (dicts as the suite records them)."""
    lines = ["| fault | failed before streaming / requests | streams cut | lost in flight on the killed router "
             "| retried (refused, 503) | tries refused | recovery | measured from |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        recovery = "—" if r.get("recovery_s") is None else f"{r['recovery_s']:.1f} s"
        lines.append(f"| {r['fault']} | {r['failed']} / {r['requests']} | {r['cut']} | {r.get('lost_in_flight', '—')} "
                     f"| {r['retried']} | {r.get('refused', '—')} | {recovery} | {r['recovery']} |")  # fmt: skip
    return "\n".join(lines)


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=Path, help="print the rows recorded in this file instead of running the suite")
    p.add_argument("--save", type=Path, help="also write the rows measured to this file (JSON lines)")
    p.add_argument("pytest_args", nargs="*", help="more pytest arguments (e.g. -k router)")
    args = p.parse_args(argv)
    if args.rows:
        print(table(read_rows(args.rows)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        rows_path = Path(tmp) / "rows.jsonl"
        rows_path.touch()
        code = subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", SUITE,
                                *args.pytest_args], cwd=REPO, env={**os.environ, ROWS_ENV: str(rows_path)})  # fmt: skip
        rows = read_rows(rows_path)
        if args.save:
            args.save.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print()
        print(table(rows))
    return code


if __name__ == "__main__":
    sys.exit(main())
