"""The endpoint picker's state: per pool, the routing policy, the endpoints' load over every router,
and the exact view of the engines' KV caches; picks made one at a time.

Owns `PickerState` and `PickerPool`. `router.picker.service` hands it every frame its routers
send (`pool`, `pick`, `progress`, `drop_connection`), on one asyncio loop, so the picks of N routers
are serialized in one place and decided as one router would decide them. The trace simulator
(`fleet.tracesim.router_views`) calls the same methods in virtual time. The policy is the same
object a router runs (`router.pools.policies.make_policy`); the load is `EndpointState`'s own
accounting (`start`, `first_byte`, `finish`), fed by the routers' reports; the exact view is the
`router.kv.exact_index.ExactIndex` the caller keeps fed (`router.signals.kv_streams.KvEventStreams`
live). Pure: no I/O; times are passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from router.kv.exact_index import Claim, ExactIndex
from router.kv.prompt_blocks import RouteRequest
from router.kv.prompt_keys import PromptKeys
from router.pools.endpoint import EndpointState
from router.pools.policies import RoutingPolicy, make_policy
from router.picker.wire import PickFrame


@dataclass(slots=True)
class PickerPool:
    """One model's pool at the picker: its `policy`, its endpoints' load (`endpoints`, by id, over
    every router's picks), the ids whose engines publish KV events (`publishing`) and the model's
    exact index (`view`, None while no endpoint publishes)."""

    policy: RoutingPolicy
    endpoints: dict[str, EndpointState] = field(default_factory=dict)
    publishing: frozenset[str] = frozenset()
    view: ExactIndex | None = None

    def endpoint(self, endpoint_id: str) -> EndpointState:
        """The endpoint's state (made at its first pick: routers name candidates the pool lists)."""
        state = self.endpoints.get(endpoint_id)
        if state is None:
            state = self.endpoints[endpoint_id] = EndpointState(endpoint_id, "")
        return state

    def block_tokens(self) -> int:
        """The block size the exact view keys by (the first publishing endpoint's that is known); 0: none."""
        view = self.view
        if view is not None:
            for endpoint_id in self.publishing:
                size = view.block_tokens(endpoint_id)
                if size:
                    return size
        return 0


@dataclass(slots=True)
class _Ticket:
    """A pick that holds load at its endpoint until the router reports it finished, and the blocks
    its policy claimed there (`router.kv.exact_index.Claim`; None: none)."""

    pool: PickerPool
    endpoint: EndpointState
    prefill_tokens: int
    claim: Claim | None
    first_byte: bool = False


class PickerState:
    """The pools the routers serve through the picker, and the picks they hold.

    `index_for(model)` returns the model's exact index (the caller feeds it: live,
    `router.signals.kv_streams.KvEventStreams.index`); `on_sources(model, sources)` is told which
    endpoints publish where (endpoint id -> `KvEventsSource` document; live, the streams' `put`).
    Connections are any hashable the caller names them by; a ticket is unique per connection.
    """

    def __init__(self, index_for: Callable[[str], ExactIndex],
                 on_sources: Callable[[str, Mapping[str, dict]], None] = lambda model, sources: None,
                 ) -> None:  # fmt: skip
        self._index_for = index_for
        self._on_sources = on_sources
        self.pools: dict[str, PickerPool] = {}
        self._tickets: dict[Hashable, dict[int, _Ticket]] = {}
        self._pool_docs: dict[str, tuple[str, dict]] = {}

    def pool(self, model: str, policy: str, sources: Mapping[str, dict | None]) -> None:
        """A router serves `model` with `policy` over the endpoints `sources` names (id -> its
        `KvEventsSource` document, None: it publishes none). N routers send the same pool: a pool
        unchanged is a no-op; a new policy name gets a fresh policy instance, a changed endpoint
        list drops the departed ones' state. Raises `KeyError` for an unknown policy name."""
        doc = (policy, dict(sources))
        if self._pool_docs.get(model) == doc:
            return
        self._pool_docs[model] = doc
        pool = self.pools.get(model)
        if pool is None or pool.policy.name != policy:
            pool = PickerPool(make_policy(policy), dict(pool.endpoints) if pool is not None else {})
            self.pools[model] = pool
        ids = set(sources)
        for gone in [e for e in pool.endpoints if e not in ids]:
            del pool.endpoints[gone]
        pool.policy.on_endpoints(ids)
        publishing = {e: s for e, s in sources.items() if s is not None}
        pool.publishing = frozenset(publishing)
        pool.view = self._index_for(model) if publishing else None
        self._on_sources(model, publishing)

    def pick(self, connection: Hashable, frame: PickFrame, now_s: float) -> tuple[int, int, int]:
        """Decide one pick: (chosen candidate's index, -1 for none; cached tokens expected there; the
        block size the exact view keys by). The chosen endpoint's load grows by the request
        (`EndpointState.start`) until the connection reports it finished (`progress`) or closes."""
        pool = self.pools.get(frame.model)
        if pool is None or not frame.candidates:
            return -1, 0, 0
        candidates = [pool.endpoint(c) for c in frame.candidates]
        keys = PromptKeys(frame.keys, frame.key_block_tokens) if frame.keys else None
        request = RouteRequest(block_hashes=frame.block_hashes, prompt_tokens=frame.prompt_tokens,
                               session_key=frame.session_key, token_ids=keys)  # fmt: skip
        chosen = pool.policy.choose(candidates, request, now_s, pool.view)
        prefill = request.prefill_tokens
        chosen.start(prefill)
        self._tickets.setdefault(connection, {})[frame.ticket] = _Ticket(pool, chosen, prefill, request.claim)
        return candidates.index(chosen), request.cached_tokens, pool.block_tokens()

    def placed(self, connection: Hashable, ticket: int, endpoint_id: str, now_s: float) -> None:
        """The router sent the pick's request to `endpoint_id` itself (the answer was late): its load
        and its claim move there. Unknown tickets are ignored."""
        tickets = self._tickets.get(connection)
        held = tickets.get(ticket) if tickets is not None else None
        if held is None or held.endpoint.id == endpoint_id:
            return
        held.endpoint.finish(held.prefill_tokens, False)
        held.endpoint = held.pool.endpoint(endpoint_id)
        held.endpoint.start(held.prefill_tokens)
        claim, view = held.claim, held.pool.view
        if claim is not None and view is not None:
            view.withdraw(claim.endpoint_id, claim.keys)
            keys = view.expect_keys(endpoint_id, claim.keys, claim.until_s, now_s)
            held.claim = Claim(endpoint_id, keys, claim.until_s) if keys else None

    def progress(self, connection: Hashable, ticket: int, *, finished: bool) -> None:
        """The router reports a pick's first byte (`finished` False) or its end; unknown tickets
        are ignored (a report that crossed a reconnect)."""
        tickets = self._tickets.get(connection)
        held = tickets.get(ticket) if tickets is not None else None
        if held is None:
            return
        if not finished:
            if not held.first_byte:
                held.first_byte = True
                held.endpoint.first_byte(held.prefill_tokens)
            return
        del tickets[ticket]  # type: ignore[union-attr]
        held.endpoint.finish(held.prefill_tokens, held.first_byte)

    def drop_connection(self, connection: Hashable) -> int:
        """The connection closed: every pick it still held finishes. Returns how many."""
        tickets = self._tickets.pop(connection, {})
        for held in tickets.values():
            held.endpoint.finish(held.prefill_tokens, held.first_byte)
        return len(tickets)

    def in_flight(self) -> int:
        """Picks held over every connection."""
        return sum(len(t) for t in self._tickets.values())
