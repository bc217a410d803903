"""``python -m fleet.cli``: the `fleet` command (what `fleet/__main__.py` runs too)."""

from fleet.cli import app

app()
