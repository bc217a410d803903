"""The unit tier: no process, no socket but to the test's own in-process loopback fixtures, no
real Kubernetes client. Enforced around every test of this directory by the guards of
`tests/support/guards.py` (see there for exactly what is refused and how a fixture's loopback
port is registered); `tests/unit/test_tier_guards.py` proves each guard fires.

The guards are switched on by the hooks below rather than by a function-scoped fixture alone, so
that they also cover the module- and session-scoped fixtures a unit test sets up and tears down.
``tier_guards`` (autouse) hands the active guards to a test: ``tier_guards.allow_port(port)``,
``tier_guards.consume_trips()``.

A guard trip fails the test with a message naming the tier it belongs in: tests/integration for
real processes, sockets to them, Prometheus, helm and the API-server stand-in; tests/e2e for
real vLLM."""

from __future__ import annotations

import pytest

from tests.support.guards import TierGuardError, UnitTierGuards

_GUARDS = pytest.StashKey[UnitTierGuards]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item):
    guards = UnitTierGuards(item.nodeid)
    item.stash[_GUARDS] = guards
    try:
        guards.activate()
    except BaseException:
        guards.deactivate()
        raise
    return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    guards = item.stash.get(_GUARDS, None)
    try:
        result = yield
    finally:
        if guards is not None:
            guards.deactivate()
    if guards is not None and guards.trips:
        # Raised even where the code under test swallowed the error at the call.
        raise TierGuardError("\n".join(dict.fromkeys(guards.trips)))
    return result


@pytest.fixture(autouse=True)
def tier_guards(request: pytest.FixtureRequest) -> UnitTierGuards:
    """The unit tier's guards, active for this test (see tests/support/guards.py)."""
    return request.node.stash[_GUARDS]


@pytest.fixture(autouse=True)
def no_vllm_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    """`fleet validate` asks the installed vLLM's parser (`fleet.engines.vllm_args`); importing
    vLLM starts processes, so in this tier vLLM counts as not installed (its parser is checked in
    tests/integration/test_vllm_engine_args.py)."""
    monkeypatch.setattr("fleet.engines.vllm_args.vllm_installed", lambda: False)
