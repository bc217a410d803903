"""Routing policies: pick one endpoint of a pool for one request.

Owns the `RoutingPolicy` base class, the registry of policies by name, and the built-in
policies. Called by `router.pool.Pool.pick` on the request path (once per attempt) and by
anything that wants to replay routing decisions in virtual time (the trace simulator).

Policies decide, the proxy acts: a policy reads the live stats of the candidate endpoints
(`in_flight`, `ewma_first_byte_s`, `last_sample_s`) and returns one of them. It does no I/O and
never reads a clock; the caller passes `now_s` (seconds on the router's injected clock).
The only state a policy keeps is a rotation counter for breaking ties.

Every policy has the same signature, `choose(candidates, now_s) -> EndpointState`, and
registers under a name with `class Foo(RoutingPolicy, name="foo")`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from router.pool import EndpointState

DEFAULT_POLICY = "latency-aware"
"""Name of the policy a pool gets when its spec names none."""

DEFAULT_STALE_AFTER_S = 10.0
"""How old (seconds) an endpoint's last TTFT sample may be before `latency-aware` treats
the endpoint as unmeasured and tries it first, so a recovered endpoint is re-measured."""

_REGISTRY: dict[str, type[RoutingPolicy]] = {}


class RoutingPolicy:
    """Base class of routing policies; subclasses register with `name=...`.

    Subclasses implement `choose`. Instances hold tie-break rotation state, so each pool
    owns its own instance (see `make_policy`).
    """

    name: ClassVar[str] = ""

    def __init_subclass__(cls, *, name: str | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if name is None:
            return  # an abstract intermediate class
        if name in _REGISTRY:
            raise ValueError(f"routing policy {name!r} is already registered by {_REGISTRY[name]!r}")
        cls.name = name
        _REGISTRY[name] = cls

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[EndpointState], now_s: float) -> EndpointState:
        """Return the endpoint that should serve the next request.

        `candidates` is non-empty and holds only ready (non-draining, not yet tried)
        endpoints; `now_s` is the router clock in seconds. Must not do I/O.
        """
        raise NotImplementedError

    def _rotate(self, ties: Sequence[EndpointState]) -> EndpointState:
        """Pick among equally good endpoints in turn, so ties spread load evenly. A single
        candidate does not advance the turn (a retry with one endpoint left keeps the
        rotation of the first choices even)."""
        if len(ties) == 1:
            return ties[0]
        self._turn += 1
        return ties[self._turn % len(ties)]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def policy_names() -> list[str]:
    """Names of all registered routing policies, sorted."""
    return sorted(_REGISTRY)


def make_policy(name: str) -> RoutingPolicy:
    """Return a fresh instance of the policy registered as `name`.

    Raises `KeyError` (whose message lists the known names) for an unknown name.
    """
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown routing policy {name!r}; known policies: {', '.join(policy_names())}") from None
    return cls()


def _fewest_in_flight(candidates: Sequence[EndpointState]) -> list[EndpointState]:
    """The candidates that have the fewest requests in flight (one pass, no sort)."""
    best = candidates[0].in_flight
    ties: list[EndpointState] = []
    for endpoint in candidates:
        n = endpoint.in_flight
        if n < best:
            best = n
            ties = [endpoint]
        elif n == best:
            ties.append(endpoint)
    return ties


class RoundRobin(RoutingPolicy, name="round-robin"):
    """Each candidate in turn, ignoring load and latency."""

    def choose(self, candidates: Sequence[EndpointState], now_s: float) -> EndpointState:
        return self._rotate(candidates)


class LeastOutstanding(RoutingPolicy, name="least-outstanding"):
    """The candidate with the fewest requests in flight through this router; ties rotate."""

    def choose(self, candidates: Sequence[EndpointState], now_s: float) -> EndpointState:
        return self._rotate(_fewest_in_flight(candidates))


class LatencyAware(RoutingPolicy, name="latency-aware"):
    """Fewest in flight first; among those, the lowest EWMA time to first byte.

    Among the endpoints with the fewest requests in flight, an endpoint that is unmeasured
    (no TTFT sample yet, or its last sample is more than `stale_after_s` old) is preferred,
    so that it gets measured; otherwise the endpoint with the lowest `ewma_first_byte_s` wins.
    Remaining ties rotate. Outstanding-requests-first keeps one fast endpoint from taking
    every request; the EWMA only orders equally loaded endpoints.
    """

    def __init__(self, stale_after_s: float = DEFAULT_STALE_AFTER_S) -> None:
        super().__init__()
        self.stale_after_s = stale_after_s

    def choose(self, candidates: Sequence[EndpointState], now_s: float) -> EndpointState:
        ties = _fewest_in_flight(candidates)
        if len(ties) == 1:
            return ties[0]
        oldest_fresh_s = now_s - self.stale_after_s
        unknown: list[EndpointState] = []
        fastest: list[EndpointState] = []
        best_s = float("inf")
        for endpoint in ties:
            ewma_s = endpoint.ewma_first_byte_s
            sampled_s = endpoint.last_sample_s
            if ewma_s is None or sampled_s is None or sampled_s < oldest_fresh_s:
                unknown.append(endpoint)
            elif ewma_s < best_s:
                best_s = ewma_s
                fastest = [endpoint]
            elif ewma_s == best_s:
                fastest.append(endpoint)
        return self._rotate(unknown or fastest)
