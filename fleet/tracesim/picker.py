"""The endpoint picker in virtual time: N simulated routers ask one `router.picker.state.PickerState`.

Owns `SimPicker`. `fleet.tracesim.engine.Simulation` makes one when `SimConfig.picker` is set: it
tells it the pool at every rebuild (`pool`), asks it for every arrival's pick (`pick`, with the
router's candidates, as `router.request.proxy` asks the live picker), and reports the first
token and the end of each picked request (`first_token`, `finished`), as the live router's
`router.picker.client.PickerTicket` does. The picker's exact index is fed by
`fleet.tracesim.router_views.RouterViews` (the one index it keeps with a picker). The policy is
the same object the live picker runs; the round trip is not modelled (virtual time stands still
while it decides, as a 0.1-0.3 ms loopback hop nearly does). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.kv.exact_index import ExactIndex
from router.kv.prompt_blocks import RouteRequest
from router.kv.prompt_keys import prompt_keys
from router.picker.client import DEFAULT_BLOCK_TOKENS
from router.picker.state import PickerState
from router.picker.wire import PickFrame
from router.pools.endpoint import EndpointState
from router.pools.pool import Pool


class SimPicker:
    """One picker for the simulation's routers over `model`'s pool, running `policy` on `index`
    (None: no KV events, the policy's approximate view alone)."""

    def __init__(self, model: str, policy: str, index: ExactIndex | None) -> None:
        self.model = model
        self.policy = policy
        self.index = index
        self.state = PickerState(lambda _: index if index is not None else ExactIndex())

    def pool(self, replica_ids: Iterable[str]) -> None:
        """The pool's endpoints are now `replica_ids` (each publishing KV events with an index)."""
        source = {} if self.index is not None else None
        self.state.pool(self.model, self.policy, {r: source for r in replica_ids})

    def pick(self, router: int, request_id: int, pool: Pool, route: RouteRequest, now_s: float) -> EndpointState | None:
        """Router `router`'s pick of request `request_id` among its pool's candidates (None: none);
        `route.cached_tokens` is set from the picker's answer."""
        candidates = pool.candidates(now_s)
        if candidates is None:
            return None
        size = self.state.pools[self.model].block_tokens() or DEFAULT_BLOCK_TOKENS
        keys = prompt_keys(route.token_ids, size).keys if route.token_ids else ()
        frame = PickFrame(request_id, self.model, route.prompt_tokens, route.session_key, [e.id for e in candidates],
                          route.block_hashes, tuple(keys), size)  # fmt: skip
        chosen, cached, _ = self.state.pick(router, frame, now_s)
        route.cached_tokens = cached
        return candidates[chosen]

    def first_token(self, router: int, request_id: int) -> None:
        self.state.progress(router, request_id, finished=False)

    def finished(self, router: int, request_id: int) -> None:
        self.state.progress(router, request_id, finished=True)
