"""What each simulated router knows beyond its own requests: the engines' load samples and KV
cache events, and (as an upper bound) every router's placements.

Owns `RouterViews` (per router: its `router.signals.engine_load.EngineLoadView` and, with
``kv_events``, its `router.kv.exact_index.ExactIndex`, or the endpoint picker's one index; the
handlers of the events that carry those signals). Used by `fleet.tracesim.engine.Simulation`, which
tells it of every dispatch, load change and engine step; `SimConfig.load_signal`,
``load_interval_s``, ``kv_events``, ``kv_events_delay_s``, ``shared_view`` and ``picker`` say what
reaches whom and how late (`fleet.tracesim.engine`'s docstring). No I/O: every time is a virtual second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fleet.controller.lifecycle import ReplicaStatus
from fleet.enginesim.model import StepResult
from fleet.tracesim.config import SimConfig
from fleet.tracesim.events import FIRST_OWN_KIND, EventLoop
from fleet.tracesim.replica import VirtualReplica
from router.kv.events import EventBatch
from router.kv.exact_index import ExactIndex
from router.kv.prompt_blocks import RouteRequest
from router.pools.policies import RoutingPolicy
from router.signals.engine_load import DEFAULT_MAX_AGE_S, EngineLoadView

SAMPLE, KV_BATCH = range(FIRST_OWN_KIND + 3, FIRST_OWN_KIND + 5)
"""Event kinds: a router's engine load poll, an engine step's KV events. They follow the
simulation's own three (drain timeout, queue timeout, autoscaler tick: `fleet.tracesim.engine`),
so at one virtual instant those run first."""


class RouterViews:
    """The signals between ``config.routers`` routers and the engines, on ``loop``.

    ``replicas``: the simulation's replicas (the list it appends to); ``running()``: whether
    requests are still open (engine load polls stop after the last). ``load_views[k]`` and
    ``exact_indexes[k]`` (empty without ``kv_events``) are router ``k``'s."""

    def __init__(self, config: SimConfig, loop: EventLoop, replicas: Sequence[VirtualReplica],
                 running: Callable[[], bool]) -> None:  # fmt: skip
        self.config = config
        self.loop = loop
        self.replicas = replicas
        self.running = running
        estimate = "waiting" if config.load_signal == "engine-waiting" else "mix"
        self.load_views = [EngineLoadView(max(DEFAULT_MAX_AGE_S, 10 * config.load_interval_s), estimate)
                           for _ in range(config.routers)]  # fmt: skip
        # With the endpoint picker one index, the picker's, takes the events (`fleet.tracesim.picker`).
        indexes = 1 if config.picker else config.routers
        self.exact_indexes = [ExactIndex() for _ in range(indexes)] if config.kv_events else []
        self._kv_seq: dict[str, int] = {}   # replica -> sequence number of its last batch
        loop.on(SAMPLE, self._on_sample)
        loop.on(KV_BATCH, self._on_kv_batch)

    def start(self) -> None:
        """Schedule the routers' first engine load polls (engine signals only), out of phase,
        as independent processes poll."""
        cfg = self.config
        if cfg.load_signal.startswith("engine"):
            for k in range(cfg.routers):
                self.loop.push(cfg.load_interval_s * (k + 1) / cfg.routers, SAMPLE, k)

    def kv_view(self, k: int) -> ExactIndex | None:
        """Router ``k``'s exact view of the engines' KV caches (None without ``kv_events``, or with
        the endpoint picker: then the picker's is `picker_view`)."""
        return self.exact_indexes[k] if self.exact_indexes and not self.config.picker else None

    def picker_view(self) -> ExactIndex | None:
        """The endpoint picker's exact view (None without ``kv_events`` or without a picker)."""
        return self.exact_indexes[0] if self.exact_indexes and self.config.picker else None

    def opened(self, replica_id: str) -> None:
        """A replica's engine started: its event stream starts empty and complete."""
        for index in self.exact_indexes:
            index.open(replica_id)

    def stopped(self, replica_id: str) -> None:
        """A replica stopped: every router forgets its cache."""
        for index in self.exact_indexes:
            index.forget(replica_id)

    def dispatched(self, replica: VirtualReplica, k: int, route: RouteRequest, routings: Sequence[RoutingPolicy],
                   now_s: float) -> None:  # fmt: skip
        """Router ``k`` sent ``route`` to ``replica``: with ``shared_view`` every other router's
        policy learns the placement."""
        if self.config.shared_view:
            for other, routing in enumerate(routings):
                if other != k:
                    routing.learn(replica.id, route.block_hashes)

    def stepped(self, replica: VirtualReplica, result: StepResult, now_s: float) -> None:
        """An engine step of ``replica`` ended: its KV cache events reach every router
        ``kv_events_delay_s`` later."""
        if not (self.exact_indexes and result.kv_events):
            return
        self._kv_seq[replica.id] = seq = self._kv_seq.get(replica.id, -1) + 1
        payload = (replica.id, result.kv_event_batch(), seq)
        if self.config.kv_events_delay_s > 0:
            self.loop.push(now_s + self.config.kv_events_delay_s, KV_BATCH, payload)
        else:
            self._on_kv_batch(payload, now_s)

    def _on_kv_batch(self, payload: tuple[str, EventBatch, int], now_s: float) -> None:
        """One engine step's KV cache events reach every router (its subscriber's `apply`)."""
        replica_id, batch, seq = payload
        for index in self.exact_indexes:
            index.apply(replica_id, batch, seq)

    def _on_sample(self, k: int, now_s: float) -> None:
        """Router ``k`` reads every READY or DRAINING replica's load (its `/metrics` poll)."""
        view = self.load_views[k]
        with_prefill = self.config.load_signal == "engine-prefill"
        for r in self.replicas:
            if r.status in (ReplicaStatus.READY, ReplicaStatus.DRAINING):
                view.observe(r.endpoints[k], r.load_sample(with_prefill), now_s)
        if self.running():
            self.loop.push(now_s + self.config.load_interval_s, SAMPLE, k)
