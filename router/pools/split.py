"""The per-request split of a pool's traffic between revisions (stable and canary), before the
routing policy picks an endpoint inside the chosen revision.

Owns `RevisionSplit` (the revisions of one pool and their weights, and the choice of one per
request), `SplitState` (the smooth weighted round-robin counters a model's successive pools
share) and `sticky_key` (the request key that keeps one user on one revision). Called by
`router.pools.pool.Pool.pick` on every pick, for every routing policy alike: the split lives here and
nowhere else. Pure: no I/O, no clock.

Weights: a revision's weight is the sum of the `weight`s of its ready (non-draining) endpoints
in the pool document (`router.pools.spec.EndpointSpec.weight`); the controller gives each endpoint of
a revision ``revision weight / its endpoints``. A pool whose ready endpoints all serve one
version is not split (every pool without a rollout: weights are then ignored).
A revision of weight 0 gets no new requests, not even when the others are full or tried (a
rolled-back canary: in-flight ones finish).

Choice:

- Without a sticky key: smooth weighted round robin (nginx's `ngx_http_upstream_get_peer`):
  every pick adds each revision's weight to its counter, takes the revision with the largest
  counter and subtracts the total from it. Exact, not sampled: after n picks each revision has
  had within one pick of n x weight / total (a random draw at 5 % over 10,000 requests strays by
  0.2 percentage points on average and a 50/50 one by 0.4), and the canary's picks are spread
  evenly over time, not bunched.
- With a sticky key: weighted rendezvous hashing (Schindelhauer and Schomaker, "Weighted
  distributed hash tables", SPAA 2005): each revision scores ``-weight / ln(u)`` with ``u`` a
  uniform hash of (key, version) in (0, 1); the highest score wins. A key lands on a revision
  with probability weight / total, always the same revision while the weights hold, and when a
  weight changes only keys that must move do (to or from the revision whose weight changed).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

from router.pools.endpoint import EndpointState

_HASH_SCALE = float(2**64)


class SplitState:
    """Smooth weighted round-robin counters by version, kept across a model's pool replacements
    (so a republished pool does not restart the sequence)."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: dict[str, float] = {}


class RevisionSplit:
    """The revisions of one pool and their weights (versions sorted); see the module docstring."""

    __slots__ = ("versions", "weights", "total", "state")

    def __init__(self, weights: dict[str, float], state: SplitState | None = None) -> None:
        self.versions = tuple(sorted(weights))
        self.weights = tuple(max(0.0, weights[v]) for v in self.versions)
        self.total = math.fsum(self.weights)
        self.state = state if state is not None else SplitState()
        current = self.state.current
        for gone in [v for v in current if v not in weights]:
            del current[gone]

    @classmethod
    def of(cls, ready: Iterable[EndpointState], state: SplitState | None = None) -> RevisionSplit | None:
        """The split of a pool's ready endpoints, or None when there is nothing to split: one
        version only, or every weight 0."""
        weights: dict[str, float] = {}
        for e in ready:
            weights[e.version] = weights.get(e.version, 0.0) + e.weight
        if len(weights) < 2 or not any(w > 0 for w in weights.values()):
            return None
        return cls(weights, state)

    def choose(self, key: str | None = None) -> str:
        """The version the next request goes to; ``key``: its sticky key (None: not sticky)."""
        if key is not None:
            return self._rendezvous(key)
        current = self.state.current
        best_v, best_c = "", -math.inf
        for v, w in zip(self.versions, self.weights):
            c = current.get(v, 0.0) + w
            current[v] = c
            if c > best_c and w > 0:
                best_v, best_c = v, c
        current[best_v] -= self.total
        return best_v

    def _rendezvous(self, key: str) -> str:
        best_v, best_score = "", -math.inf
        for v, w in zip(self.versions, self.weights):
            if w <= 0:
                continue
            digest = hashlib.blake2b(f"{v}\0{key}".encode(), digest_size=8).digest()
            u = (int.from_bytes(digest, "big") + 0.5) / _HASH_SCALE      # uniform in (0, 1)
            score = -w / math.log(u)
            if score > best_score:
                best_v, best_score = v, score
        return best_v

    def narrow(self, candidates: Sequence[EndpointState], key: str | None = None) -> Sequence[EndpointState]:
        """The candidates of the chosen revision; when none of them serves it (its endpoints are
        full, cooling down or already tried: serving beats the split), the candidates of every
        revision of weight above 0. Never one of weight 0 (a rolled-back canary, a revision being
        replaced): with nothing else left the result is empty, and the request waits or fails."""
        version = self.choose(key)
        chosen = [e for e in candidates if e.version == version]
        if chosen:
            return chosen
        weighted = {v for v, w in zip(self.versions, self.weights) if w > 0}
        return [e for e in candidates if e.version in weighted]

    def shares(self) -> dict[str, float]:
        """Version -> its share of requests (0..1), for the admin API."""
        return {v: (w / self.total if self.total else 0.0) for v, w in zip(self.versions, self.weights)}


STICKY_KEY_PATTERN = r"^(header:[A-Za-z0-9-]{1,128}|body:user)$"
"""How a pool document names its sticky key (`router.pools.spec.PoolSpec.sticky_key`): ``header:NAME``
(the value of that request header) or ``body:user`` (the OpenAI request's ``user`` field)."""


def sticky_key(source: str | None, headers: Iterable[tuple[bytes, bytes]], doc: object) -> str | None:
    """The request's sticky key per ``source`` (`STICKY_KEY_PATTERN`; None: no stickiness), or
    None when the request carries none. ``headers``: ASGI (lower-case name, value) byte pairs;
    ``doc``: the request body as `router.request.parse` parsed it (its ``user`` field for
    ``body:user``)."""
    if source is None:
        return None
    if source.startswith("header:"):
        name = source[len("header:"):].lower().encode("latin-1")
        for k, v in headers:
            if k == name:
                return v.decode("latin-1") or None
        return None
    user = doc.get("user") if isinstance(doc, dict) else None
    return user if isinstance(user, str) and user else None
