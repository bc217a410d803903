"""The integration tier: real processes on loopback. `fleet up`, the router and engines of the
engine SIMULATOR (`engine.kind: sim`: vLLM's API with modelled latencies, no model; seconds to
start), the API-server stand-in (fleet/testing/k8s), the hub stand-in, Prometheus and promtool,
helm. No real vLLM: that is tests/e2e."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fleet_up import FleetUp, fleet_up_factory


@pytest.fixture
def sim_fleet_up(tmp_path: Path) -> Iterator[Callable[[list[Path]], FleetUp]]:
    """Starts `fleet up` on deployment files of `engine.kind: sim` replicas (the engine
    SIMULATOR: no vLLM, no model; seconds to start)."""
    yield from fleet_up_factory(tmp_path)
