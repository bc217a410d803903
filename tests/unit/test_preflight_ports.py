"""`fleet up`'s preflight (fleet/local/preflight.py) refuses two of its own servers on one port
(e.g. `--picker-port 8079`, whose metrics default to 8080, beside the router on 8080): the second
would fail to bind after the first started."""

from __future__ import annotations

import pytest

from fleet.local.preflight import PreflightError, preflight
from tests.support.inventories import cluster, node


def test_two_of_fleet_ups_servers_on_one_port_are_refused_naming_both() -> None:
    ports = {"router": ("127.0.0.1", 1), "picker": ("127.0.0.1", 2), "picker metrics": ("127.0.0.1", 1)}
    with pytest.raises(PreflightError) as err:
        preflight([], cluster(node("box", n=0)), ports)
    assert "picker metrics port 1 is also the router port: give one of them another" in err.value.problems


def test_distinct_ports_raise_no_port_clash() -> None:
    ports = {"router": ("127.0.0.1", 1), "picker": ("127.0.0.1", 2)}
    try:
        preflight([], cluster(node("box", n=0)), ports)
    except PreflightError as err:   # a low port may be refused as in use or not bindable; never as a clash
        assert not [p for p in err.problems if "is also the" in p], err.problems
