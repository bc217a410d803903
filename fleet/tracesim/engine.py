"""The trace simulator's autoscaling simulation: a trace through the real router policy and the
real autoscaler policy, over simulated engines, in virtual time.

Owns `Simulation` (its handlers on the shared event loop, `fleet.tracesim.events`: arrivals,
admission, engine steps, start-up, drain, standby, autoscaler ticks) for a
`fleet.tracesim.config.SimConfig` (what is simulated: profile, autoscaling spec and bounds,
routing, start-up model, SLO; re-exported here with its defaults). What routers know of each
other and of the engines is `fleet.tracesim.router_views`'. Called by `fleet.tracesim.compare`
and `fleet simulate`; reads `fleet.tracesim.workload` for the requests and fills
`fleet.tracesim.results`. No I/O, no clock, no sleeping: every time is a virtual second, and the
same config and workload give the same result. This is a SIMULATOR: the engines are
`fleet.enginesim` latency models, not vLLM.

What runs for real (the live objects, fed in virtual time):

- routing: `router.pools.pool.Pool.pick` with the policy object of `router.pools.policies.make_policy`,
  for a `router.kv.prompt_blocks.RouteRequest` built by `route_request` from the very token-id
  prompt the engine model gets (as `router.request.prepare` builds it from the body), over
  `router.pools.endpoint.EndpointState`s whose load (`start`, `first_byte` at the first token,
  `finish`) and first-byte EWMA (`EndpointState.record_first_byte`) are updated where `router.request.attempt`
  updates them; draining endpoints stay in the pool marked draining, as the controller
  publishes them. With ``routers`` > 1, that many independent routers (each its own policy
  object and its own endpoint states, seeing only its own requests) take the requests in
  turn, as routers behind a load balancer do. ``shared_view`` also tells every router of every
  placement (`RoutingPolicy.learn`), which is what each would learn from the engines' KV cache
  events: the upper bound of what an exact, shared view gives. ``load_signal`` says what each
  router knows of the load the others sent (docs/routing.md, "Two routers or more"): nothing
  (``own``: only its own requests); the engines' load sampled every ``load_interval_s`` by each router
  (``engine``: `vllm:num_requests_waiting` / `running`, through the router's own
  `router.signals.engine_load.EngineLoadView`, the others' requests taken to look like the router's own;
  ``engine-waiting``: split into prefilling and decoding by the engine's waiting share;
  ``engine-prefill``: plus the engine's queued prefill
  tokens, which vLLM does not export); with ``picker`` the picker holds every router's load. With
  ``kv_events`` every simulated engine makes vLLM's KV cache events (`EngineModel(kv_events=True)`:
  one `router.kv.events.EventBatch` per step) and every router's `kv-aware` consumes the same
  stream through its own `router.kv.exact_index.ExactIndex` (its pool's `Pool.kv_view`), each
  batch applied ``kv_events_delay_s`` after the step that made it: the objects the live router's
  subscribers feed (`fleet.tracesim.router_views`). With ``picker`` every router asks one endpoint
  picker (`fleet.tracesim.picker`: the live picker's `router.picker.state.PickerState`, its
  policy object, every router's load and the one exact index the events feed);
- router statistics: one `router.stats.windows.ModelStats` recorded by the request path's own recording code
  (`router.pools.pool.PoolShared`: `arrived`, `dispatched`, `gave_up`, `rejected`, `completed`) at
  the request path's points (arrival; queue time at dispatch or at a queue timeout; client-side TTFT
  and end-to-end latency stamped at completion; rejections);
- autoscaling: the deployment's `autoscaler.policy` object, asked every ``policy.interval_s``
  with `autoscaler.signals.DeploymentSignals` over simulated scrapes of every READY replica
  (`VirtualReplica.sample`: gauges and the cumulative `vllm:request_queue_time_seconds`
  histogram) and the router snapshot, and an `autoscaler.startup.StartupTracker` fed with the
  start-ups it observed (never told the modelled times);
- engines: one `fleet.enginesim.model.EngineModel` per replica, stepped as `run_virtual` steps it.

What is modelled (docs/autoscaling.md, "Running a policy in virtual time (the trace simulator)"):

- Start-up: a replica asked for at t becomes READY at t + the warm or the cold start-up time
  (`fleet.tracesim.replica.NodePool`). The initial replicas are READY at 0 s.
- Scale-down, as `fleet.controller.reconcile` does it (the same `fleet.controller.scale.scale_step`):
  the least advanced replicas go first (STARTING before READY), newest first; a STARTING one stops at once, a READY one drains (no new
  requests, its in-flight requests finish, then it stops; after ``drain_timeout_s`` the rest
  are aborted and count as failed).
- Admission, as `router.request.proxy` does it: without ``max_concurrency_per_endpoint`` a request
  goes to the endpoint the policy picks, or gets a 503 when no replica is READY. With it,
  first come first served: a request waits in the router while every READY replica is full (a
  freed slot or a joining replica takes the head of the queue), at most ``max_queue_length``
  waiting (more get a 503 at once), for at most ``queue_timeout_s`` (then a 503); with no
  READY replica at all, a 503. Clients do not retry: a 503 is a failed request.
- Standby (``standby_max`` > 0; docs/autoscaling.md, "Standby replicas"): the controller's
  standby lifecycle, the same functions (`fleet.controller.standby`: `standby_target`,
  `shape_step`, `trim_and_refill`) run at every policy tick as the controller runs them every
  tick. The policy's `ScalingDecision.standby` (None: ``standby_max``), clamped to ``[0,
  standby_max]``, replicas are kept asleep (STANDBY: placed, loaded, holding their node slot,
  counted in replica-hours, not in the pool nor the target). A scale-up wakes the oldest
  STANDBY replicas (READY ``wake_s`` later, the `autoscaler.startup.StartupEstimate.wake_s` the
  policy is told while one is asleep), then starts new ones (warm or cold); a replica starting
  to refill the pool stays a refill (it sleeps once READY, never serving first). A scale-down
  puts READY victims to sleep while the pool is short (out of the pool at once, listed draining
  while their requests finish, as the controller publishes them); a victim still starting, a
  woken one included, stops. A pool short of its target gets new replicas that sleep once
  READY; a pool too large stops its newest sleepers, then its newest refills.
- Not modelled: engine crashes, connection failures and the router's retries, the network,
  the router's own CPU time.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import replace

from autoscaler.policy import ScalingContext, ScalingPolicy, make_policy
from autoscaler.signals import DeploymentSignals
from autoscaler.startup import StartupTracker
from fleet.enginesim.model import EngineModel, FinishedRequest, StepResult
from fleet.controller.lifecycle import ReplicaStatus
from fleet.controller.scale import scale_step
from fleet.controller.standby import shape_step, standby_target, trim_and_refill
from fleet.tracesim.config import (
    DEFAULT_COLD_STARTUP_S,
    DEFAULT_TTFT_SLO_S,
    DEFAULT_WAKE_S,
    DEFAULT_WARM_STARTUP_S,
    DRAIN_TIMEOUT_S,
    LOAD_SIGNALS,
    SimConfig,
)
from fleet.tracesim.events import FIRST_OWN_KIND, READY, EngineStepper, EventLoop
from fleet.tracesim.replica import NodePool, VirtualReplica
from fleet.tracesim.results import RequestLog, SimResult, TickRecord
from fleet.tracesim.picker import SimPicker
from fleet.tracesim.router_views import RouterViews
from fleet.tracesim.workload import Workload, prompt_ids
from router.pools.policies import make_policy as make_routing_policy
from router.pools.pool import Pool, PoolShared
from router.kv.prompt_blocks import RouteRequest, route_request
from router.stats.windows import ModelStats

_DRAIN_TIMEOUT, _QUEUE_TIMEOUT, _TICK = range(FIRST_OWN_KIND, FIRST_OWN_KIND + 3)
"""This simulator's event kinds (after `fleet.tracesim.events`' shared ones and before
`fleet.tracesim.router_views`' four), in the order they run at one virtual instant."""

__all__ = ["DEFAULT_COLD_STARTUP_S", "DEFAULT_TTFT_SLO_S", "DEFAULT_WAKE_S", "DEFAULT_WARM_STARTUP_S",
           "DRAIN_TIMEOUT_S", "LOAD_SIGNALS", "SimConfig", "Simulation"]  # fmt: skip


class Simulation:
    """Replays ``workload`` through one deployment described by ``config``; `run()` once.

    ``progress(now_s, done, total)`` is called about every ``progress_every_s`` virtual
    seconds (virtual seconds now, requests finished, requests in all), for progress bars.
    """

    def __init__(self, config: SimConfig, workload: Workload, *,
                 progress: Callable[[float, int, int], None] | None = None,
                 progress_every_s: float = 60.0) -> None:  # fmt: skip
        self.config = config
        self.workload = workload
        self.progress = progress
        self.progress_every_s = progress_every_s
        spec = config.autoscaling
        self.policy: ScalingPolicy = make_policy(spec, config.bounds)
        self.policy.prime(config.history)
        self.signals = DeploymentSignals(spec.window_seconds)
        self.startup = StartupTracker(spec.warm_startup_seconds, spec.cold_startup_seconds)
        self.stats = ModelStats(0.0)
        self.shared = PoolShared(self.stats)
        self.routings = [make_routing_policy(config.routing_policy) for _ in range(config.routers)]
        self.routing = self.routings[0]
        self._routes: dict[int, RouteRequest] = {}      # request -> what its router saw (until it ends)
        self._prompts: dict[int, list[int]] = {}        # request -> token ids, until dispatched
        self._router_of = bytearray(len(workload.requests))
        self._prefilling = bytearray(len(workload.requests))   # 1 until the first token
        self.nodes = NodePool(config.node_slots_warm)
        self.replicas: list[VirtualReplica] = []
        self.desired = config.bounds.initial
        self.log = RequestLog([r.arrival_s for r in workload.requests])
        self.ticks: list[TickRecord] = []
        self.loop = EventLoop()
        self.engines = EngineStepper(self.loop, self._on_step)
        self.views = RouterViews(config, self.loop, self.replicas, lambda: self._done < len(self.log))
        self.load_views, self.exact_indexes = self.views.load_views, self.views.exact_indexes
        self.picker = (SimPicker(config.model, config.routing_policy, self.views.picker_view()) if config.picker
                       else None)  # fmt: skip
        self._queue: deque[int] = deque()   # request indexes waiting in the router (lazy deletion)
        self._queued = 0
        self._waiting = bytearray(len(self.log))   # 1 while request i is in the router queue
        self._done = 0
        self._by_endpoint: dict[str, VirtualReplica] = {}
        self._startups: list[tuple[str, bool, float]] = []
        self._wakes: list[tuple[str, float]] = []
        self.standby_target = 0
        self._ran = False
        self.pools = self._make_pools()
        self.pool = self.pools[0]

    # ----- events -----------------------------------------------------------------------

    def _register_handlers(self) -> None:
        """Register this simulation's handlers on its event loop (the engines' own are the
        `EngineStepper`'s)."""
        on = self.loop.on
        on(READY, self._on_ready)
        on(_DRAIN_TIMEOUT, self._on_drain_timeout)
        on(_QUEUE_TIMEOUT, self._on_queue_timeout)
        on(_TICK, self._on_tick)

    def run(self) -> SimResult:
        """Replay the whole workload; return the result.

        Raises RuntimeError on a second call, or if an engine model stops making progress."""
        if self._ran:
            raise RuntimeError("a Simulation runs once")
        self._ran = True
        self._register_handlers()
        for _ in range(self.config.bounds.initial):
            self._add_replica(0.0, ready_now=True)
        self._rebuild_pool()
        self.loop.push(0.0, _TICK)
        self.views.start()
        n = len(self.workload.requests)
        after_each = None
        if self.progress is not None:
            progress, next_progress_s = self.progress, self.progress_every_s

            def after_each(now_s: float) -> None:
                nonlocal next_progress_s
                if now_s >= next_progress_s:
                    progress(now_s, self._done, n)
                    next_progress_s = now_s + self.progress_every_s

        now_s = self.loop.run(lambda: self._done >= n, arrivals=self.log.arrival_s, on_arrival=self._on_arrival,
                              after_each=after_each)  # fmt: skip
        if self._done < n:
            raise RuntimeError(f"the simulation stalled at {now_s} s with {n - self._done} of {n} requests open")
        if self.progress is not None:
            self.progress(now_s, self._done, n)
        horizon_s = self.workload.duration_s
        return SimResult(
            name=self.config.label, policy=self.config.autoscaling.policy, ttft_slo_s=self.config.ttft_slo_s,
            requests=self.log, ticks=self.ticks, horizon_s=horizon_s, end_s=now_s,
            replica_cost_s=sum(r.cost_s(horizon_s) for r in self.replicas), startups=self._startups,
            params=self.config.params(), steps=self.engines.steps,
            standby_cost_s=sum(r.standby_s(horizon_s) for r in self.replicas), wakes=self._wakes,
        )  # fmt: skip

    # ----- requests (router.request.proxy's admission) ------------------------------------------

    def _on_arrival(self, i: int, now_s: float) -> None:
        self.shared.arrived(now_s)
        k = i % len(self.pools)
        self._router_of[i] = k
        pool = self.pools[k]
        r = self.workload.requests[i]
        ids = prompt_ids(i, r, self.config.seed)
        self._prompts[i] = ids
        route = self._routes[i] = route_request({"prompt": ids, "max_tokens": r.output_tokens}, r.session_id)
        limited = pool.limit is not None
        if self.picker is not None:
            endpoint = self.picker.pick(k, i, pool, route, now_s)
        else:
            endpoint = None if limited and self._queued else pool.pick(route, now_s)   # FCFS: nobody overtakes a waiter
        if endpoint is not None:
            self.shared.dispatched(now_s, now_s)
            self._dispatch(i, self._by_endpoint[endpoint.id], now_s)
        elif not limited or not pool.ready or self._queued >= pool.max_queue_length:
            self._reject(i, now_s)   # no READY replica, or the admission queue is full: 503
        else:
            self._queue.append(i)
            self._waiting[i] = 1
            self._queued += 1
            self.loop.push(now_s + pool.queue_timeout_s, _QUEUE_TIMEOUT, i)

    def _admit_waiting(self, now_s: float) -> None:
        """Dispatch queued requests, oldest first, while an endpoint has a free slot."""
        queue, pool = self._queue, self.pool
        while self._queued:
            while not self._waiting[queue[0]]:
                queue.popleft()  # timed out already
            endpoint = pool.pick(self._routes[queue[0]], now_s)
            if endpoint is None:
                return
            i = queue.popleft()
            self._waiting[i] = 0
            self._queued -= 1
            self.shared.dispatched(self.log.arrival_s[i], now_s)
            self._dispatch(i, self._by_endpoint[endpoint.id], now_s)

    def _on_queue_timeout(self, i: int, now_s: float) -> None:
        if not self._waiting[i]:
            return
        self._waiting[i] = 0
        self._queued -= 1
        self.shared.gave_up(self.log.arrival_s[i], now_s)   # as the proxy: the wait counts
        self._reject(i, now_s)

    def _reject(self, i: int, now_s: float) -> None:
        """The router answers 503 (counted in `ModelStats.rejected`); the request failed."""
        self.shared.rejected(now_s)
        self._fail(i, now_s)

    def _fail(self, i: int, now_s: float) -> None:
        self._routes.pop(i, None)
        self._prompts.pop(i, None)
        self.log.failed[i] = True
        self.log.end_s[i] = now_s
        self._done += 1

    def _dispatch(self, i: int, replica: VirtualReplica, now_s: float) -> None:
        route = self._routes[i]
        k = self._router_of[i]
        replica.endpoints[k].start(route.prefill_tokens)
        self.views.dispatched(replica, k, route, self.routings, now_s)
        self._prefilling[i] = 1
        log = self.log
        log.dispatch_s[i] = now_s
        log.replica[i] = replica.index
        log.prompt_tokens[i] = route.prompt_tokens
        log.predicted_cached_tokens[i] = route.cached_tokens
        r = self.workload.requests[i]
        rid = str(i)
        replica.in_flight_ids.add(rid)
        replica.engine.add_request(rid, self._prompts.pop(i), r.output_tokens, now_s)
        self.engines.poke(replica, now_s)

    def _first_token(self, replica: VirtualReplica, i: int, now_s: float) -> None:
        """Request ``i`` emitted its first token: its prefill charge leaves the endpoint's load
        (where the proxy calls `EndpointState.first_byte`)."""
        if self._prefilling[i]:
            self._prefilling[i] = 0
            k = self._router_of[i]
            tokens = self._routes[i].prefill_tokens
            replica.endpoints[k].first_byte(tokens)
            if self.picker is not None:
                self.picker.first_token(k, i)

    def _release(self, replica: VirtualReplica, i: int, now_s: float) -> None:
        """Request ``i`` left ``replica``: its router's endpoint state forgets it."""
        route = self._routes.pop(i)
        k = self._router_of[i]
        replica.endpoints[k].finish(route.prefill_tokens, not self._prefilling[i])
        if self.picker is not None:
            self.picker.finished(k, i)
        self._prefilling[i] = 0

    def _finish(self, replica: VirtualReplica, fr: FinishedRequest, now_s: float) -> None:
        i = int(fr.request_id)
        log = self.log
        endpoint = replica.endpoints[self._router_of[i]]
        self._release(replica, i, now_s)
        log.cached_tokens[i] = fr.num_cached_prompt_tokens
        replica.in_flight_ids.discard(fr.request_id)
        replica.observe_finished(fr)
        if fr.finish_reason == "abort" or fr.first_token_s is None:
            self._fail(i, now_s)  # cut off at the drain timeout: the proxy records no latency sample
            return
        log.end_s[i] = now_s
        log.first_token_s[i] = fr.first_token_s
        self._done += 1
        self.shared.completed(endpoint, arrival_s=log.arrival_s[i], dispatch_s=log.dispatch_s[i],
                              first_byte_s=fr.first_token_s, end_s=now_s, succeeded=True)  # fmt: skip

    # ----- engines ----------------------------------------------------------------------

    def _on_step(self, replica: VirtualReplica, result: StepResult, now_s: float) -> bool:
        """A step of ``replica``'s engine ended (`fleet.tracesim.events.EngineStepper`): its KV
        cache events go out, first tokens and finished requests are recorded, a drained replica
        stops, waiting requests take freed slots. Returns whether the engine steps on."""
        self.views.stepped(replica, result, now_s)
        for rid, token in result.emitted.items():
            if token == 0:
                self._first_token(replica, int(rid), now_s)
        if result.finished:
            for fr in result.finished:
                self._finish(replica, fr, now_s)
            if replica.status is ReplicaStatus.DRAINING and not replica.in_flight_ids:
                self._stop(replica, now_s)
                return False
            if replica.status is ReplicaStatus.STANDBY and not replica.in_flight_ids:
                self._rebuild_pool()   # asleep with nothing left in flight: no longer listed draining
            if self._queued:
                self._admit_waiting(now_s)
        return True

    # ----- replicas (fleet.controller.reconcile's lifecycle) ---------------------------------------

    def _add_replica(self, now_s: float, ready_now: bool = False) -> VirtualReplica:
        cfg = self.config
        slot, warm = self.nodes.take()
        index = len(self.replicas)
        startup_s = 0.0 if ready_now else (cfg.warm_startup_s if warm else cfg.cold_startup_s)
        engine = EngineModel(cfg.profile.config, cfg.profile.cost, slowdown=cfg.slowdown, kv_events=cfg.kv_events)
        replica = VirtualReplica(f"{cfg.model}-{index}", index, engine, now_s, now_s + startup_s, warm, slot,
                                 cfg.routers)  # fmt: skip
        self.replicas.append(replica)
        self._by_endpoint[replica.id] = replica
        self.views.opened(replica.id)
        if ready_now:
            replica.record_ready(now_s)
            self.nodes.became_ready(slot)
        else:
            self.loop.push(replica.ready_at_s, READY, replica)
        return replica

    def _on_ready(self, replica: VirtualReplica, now_s: float) -> None:
        if replica.status is not ReplicaStatus.STARTING or replica.ready_at_s != now_s:
            return  # stopped (or put back to sleep) while starting
        if replica.woken:
            self._wakes.append((replica.id, now_s - replica.woke_s))  # type: ignore[operator]
        else:
            self.nodes.became_ready(replica.node)
            self.startup.observe(replica.id, replica.warm, now_s - replica.created_s)
            self._startups.append((replica.id, replica.warm, now_s - replica.created_s))
        if replica.for_standby:
            self._sleep(replica, now_s)
            return
        replica.record_ready(now_s)
        self._rebuild_pool()
        if self._queued:
            self._admit_waiting(now_s)

    def _sleep(self, replica: VirtualReplica, now_s: float) -> None:
        """Put ``replica`` (loaded) to sleep: STANDBY at once, keeping its node slot; requests in
        flight on it finish (the controller sleeps the engine once they have)."""
        replica.record_sleep(now_s)

    def _wake(self, replica: VirtualReplica, now_s: float) -> None:
        """Wake a STANDBY replica: STARTING, READY ``wake_s`` later."""
        replica.record_wake(now_s)
        replica.ready_at_s = now_s + self.config.wake_s
        self.loop.push(replica.ready_at_s, READY, replica)

    def _drain(self, replica: VirtualReplica, now_s: float) -> None:
        """Drain ``replica``: one still starting (a woken one included, as the controller drains a
        WARMING replica) or asleep stops at once; a READY one leaves the pool and stops once its
        requests finished (or at the drain timeout)."""
        if replica.status in (ReplicaStatus.STARTING, ReplicaStatus.STANDBY):
            self._stop(replica, now_s)
            return
        replica.record_drain(now_s)
        if not replica.in_flight_ids:
            self._stop(replica, now_s)
            return
        self.loop.push(now_s + self.config.drain_timeout_s, _DRAIN_TIMEOUT, replica)

    def _on_drain_timeout(self, replica: VirtualReplica, now_s: float) -> None:
        if replica.status is not ReplicaStatus.DRAINING:
            return
        for rid in sorted(replica.in_flight_ids, key=int):
            fr = replica.engine.abort(rid, now_s)
            if fr is not None:
                self._finish(replica, fr, now_s)
        # Requests whose last step is still running left the engine already: they are cut off too.
        for rid in sorted(replica.in_flight_ids, key=int):
            self._release(replica, int(rid), now_s)
            self._fail(int(rid), now_s)
        replica.in_flight_ids.clear()
        self._stop(replica, now_s)

    def _stop(self, replica: VirtualReplica, now_s: float) -> None:
        """``replica`` stops: TERMINATED, its node slot freed."""
        replica.record_stop(now_s)
        self.views.stopped(replica.id)
        self.nodes.release(replica.node)
        self._rebuild_pool()

    def _make_pools(self) -> list[Pool]:
        """One pool per router, over that router's endpoint states of the READY and DRAINING
        replicas and the STANDBY ones with requests still in flight (listed draining, as the
        controller publishes them), in creation order (as the controller lists them, by id)."""
        cfg = self.config
        pools = []
        for k, routing in enumerate(self.routings):
            endpoints = []
            for r in self.replicas:
                status = r.status
                if status in (ReplicaStatus.READY, ReplicaStatus.DRAINING) or (
                        status is ReplicaStatus.STANDBY and r.in_flight_ids):  # fmt: skip
                    r.endpoints[k].draining = status is not ReplicaStatus.READY
                    endpoints.append(r.endpoints[k])
            pools.append(Pool(cfg.model, routing, endpoints, 0.0, self.shared, limit=cfg.max_concurrency_per_endpoint,
                              max_queue_length=cfg.max_queue_length, queue_timeout_s=cfg.queue_timeout_s,
                              kv_view=self.views.kv_view(k)))  # fmt: skip
        return pools

    def _rebuild_pool(self) -> None:
        """Replace the pools (as the controller's PUT does) from the READY and DRAINING replicas."""
        self.pools = self._make_pools()
        if self.picker is not None:   # every router's PUT reaches the picker (router.pools.pool.PoolTable.put)
            self.picker.pool(e.id for e in self.pools[0].endpoints)
        self.pool = self.pools[0]

    # ----- the autoscaler (fleet.controller.autoscaling's step) -------------------------------------

    def _on_tick(self, _: object, now_s: float) -> None:
        ready = [r for r in self.replicas if r.status is ReplicaStatus.READY]
        # Counted in the target: a replica starting only to refill the standby pool is not.
        starting = sum(1 for r in self.replicas if r.status is ReplicaStatus.STARTING and not r.for_standby)
        for r in ready:
            self.signals.observe_engine(r.id, now_s, r.sample())
        self.signals.forget_others({r.id for r in ready})
        snapshot = self.stats.snapshot(now_s, self.signals.window_s, in_flight=sum(p.in_flight() for p in self.pools),
                                       queued=self._queued)  # fmt: skip
        asleep = sum(1 for r in self.replicas if r.status is ReplicaStatus.STANDBY)
        estimate = self.startup.estimate(next_warm=self.nodes.next_is_warm())
        if asleep:
            estimate = replace(estimate, wake_s=self.config.wake_s)
        ctx = ScalingContext(now_s, self.desired, len(ready), starting, self.signals.signals(now_s, snapshot),
                             estimate, asleep)  # fmt: skip
        decision = self.policy.decide(ctx)
        self.desired = decision.desired
        self.standby_target = standby_target(self.config.standby_max, decision.standby)
        self._reconcile(now_s)
        counts = {status: 0 for status in ReplicaStatus}
        for r in self.replicas:
            counts[r.status] += 1
        self.ticks.append(TickRecord(now_s, self.desired, counts[ReplicaStatus.READY], counts[ReplicaStatus.STARTING],
                                     counts[ReplicaStatus.DRAINING], decision,
                                     counts[ReplicaStatus.STANDBY]))  # fmt: skip
        if self._done < len(self.log):
            self.loop.push(now_s + self.policy.interval_s, _TICK)

    def _reconcile(self, now_s: float) -> None:
        """The controller's scale step (`fleet.controller.scale.scale_step`) shaped by its standby
        pool (`fleet.controller.standby.shape_step`, then `trim_and_refill`), the same functions
        (module docstring, "Standby"): wake the oldest sleepers before starting new replicas;
        put READY victims to sleep while the pool is short, drain the rest (the least advanced
        first, the newest first among equals); then size the pool."""
        active = [r for r in self.replicas if r.status.counts_toward_desired() and not r.for_standby]
        step = scale_step(active, self.desired, lambda r: r.index)
        asleep = [r for r in self.replicas if r.status is ReplicaStatus.STANDBY]
        step, wake, sleep = shape_step(step, asleep, self.standby_target)
        for r in wake:
            self._wake(r, now_s)
        for r in sleep:
            self._sleep(r, now_s)
        for _ in range(step.create):
            self._add_replica(now_s)
        for r in step.drain:
            self._drain(r, now_s)
        asleep = [r for r in self.replicas if r.status is ReplicaStatus.STANDBY]
        refills = [r for r in self.replicas if r.for_standby and r.status is ReplicaStatus.STARTING]
        drain, create = trim_and_refill(asleep, refills, self.standby_target)
        for r in drain:
            self._drain(r, now_s)
        for _ in range(create):
            self._add_replica(now_s).for_standby = True
        if step.drain or sleep or drain:
            self._rebuild_pool()
