"""``python -m fleet``: the `fleet` command line (`fleet.cli`)."""

from fleet.cli import app

app()
