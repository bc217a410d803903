"""The autoscaler loop of the control plane: gather signals, ask each deployment's policy, set targets.

Owns `AutoscalerLoop`. Every tick it finds the deployments whose policy is due (each policy
has its own `interval_s`), reads the router's windowed statistics once (`RouterStatsSource`:
`GET /admin/v1/stats` through `fleet.controller.router_admin.RouterAdminClient`), scrapes `/metrics` of
those deployments' READY replicas (`warmup.client.EngineAPI.metrics`), records the start-up
time of replicas that became READY, builds a `autoscaler.policy.ScalingContext` and calls the
policy. A new target goes to `fleet.controller.reconcile.Controller.set_desired` (persisted, then the
reconcile step adds replicas or drains the surplus: this loop never adds or removes one);
every decision is kept for `fleet status`, exported (`autoscaler.metrics`), logged, and handed
to ``on_decision`` (the progress line of `fleet up`). A policy's slow pure work (the `standby`
policy's forecast refit, 0.2-0.3 s) is deferred (``ScalingPolicy.defer_work``) and run in a
worker thread (`asyncio.to_thread`); the policy forecasts with its last fitted model meanwhile.

With a ``history`` store (`fleet.controller.arrival_history`) it primes each new policy with the
arrival rates saved before (a forecast keeps its seasons across restarts and re-applies) and saves
them every `HISTORY_SAVE_S` and when it stops.

Side effects go through the injected router, engine API, clocks and store, so tests drive the loop
on fake time with the fakes of tests/support/fakes.py. Each part of a step has its own error handling:
an unreachable router or engine leaves that signal unmeasured (None) for this decision.
Built by `fleet.control_plane.ControlPlane.autoscaler` for `fleet.local.up` (which runs it as a
task) and `fleet.k8s.operator` (which steps it in its tick).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from autoscaler.engine_metrics import EngineMetricsError, parse_engine_metrics
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import Direction, ReplicaBounds, ScalingContext, ScalingDecision, ScalingPolicy, make_policy
from autoscaler.signals import DeploymentSignals
from autoscaler.startup import StartupTracker
from fleet.controller.arrival_history import HISTORY_SAVE_S, ArrivalHistoryStore, History
from fleet.controller.reconcile import Controller
from fleet.controller.lifecycle import Replica, ReplicaStatus
from warmup.client import EngineAPI, EngineRequestError

log = logging.getLogger("fleet.autoscaling")

DEFAULT_WAKE_S = 3.0
"""Seconds a STANDBY replica takes from wake-up to serving before one has been observed here:
llm-d's fast-model-actuation figure (~3 s to wake 64 GiB of weights; the engine simulator's
`fleet.enginesim` wake time and the trace simulator's default cite the same source)."""


def wake_estimate_s(replicas: list[Replica]) -> float:
    """The latest observed wake-to-READY of ``replicas`` (`Replica.wake_to_ready_s`), else
    `DEFAULT_WAKE_S`: the lead time a policy is told while a replica sleeps."""
    observed = [(r.woke_at_s, t) for r in replicas if (t := r.wake_to_ready_s()) is not None]
    return max(observed)[1] if observed else DEFAULT_WAKE_S


COLD_START_THRESHOLD_S = 1.0
"""A replica whose image or weights took longer than this to be present after placement
started cold (the node had to pull or copy them); otherwise warm."""


class RouterStatsSource(Protocol):
    async def stats(self, window_s: float) -> dict[str, dict]:
        """Model name -> `router.stats.windows.ModelStats.snapshot` over the last ``window_s``."""
        ...


@dataclass
class _Scaled:
    """One autoscaled deployment: its policy, signal history and start-up observations."""

    name: str
    model: str
    policy: ScalingPolicy
    signals: DeploymentSignals
    startup: StartupTracker
    next_due_s: float = 0.0
    background: asyncio.Task[None] | None = None   # the policy's deferred work (a forecast refit) in a thread
    primed: bool = False   # given the saved arrival history (or there was none to give)


def startup_of(r: Replica) -> tuple[bool, float] | None:
    """(warm, seconds from placement to READY) of a replica that became READY, else None; None
    too for a replica woken from STANDBY (its READY counts from the wake, `wake_estimate_s`)."""
    if r.warmup_passed_at_s is None or r.placed_at_s is None or r.woke_at_s is not None:
        return None
    present_s = max(r.image_ready_at_s or r.placed_at_s, r.weights_ready_at_s or r.placed_at_s)
    warm = present_s - r.placed_at_s <= COLD_START_THRESHOLD_S
    return warm, r.warmup_passed_at_s - r.placed_at_s


class AutoscalerLoop:
    """Decides the target replica count of every deployment that has `spec.autoscaling`.

    ``router``: source of windowed router statistics; ``engine_api``: scrapes engine
    `/metrics`; ``clock``: the controller's clock (seconds); ``metrics``: where decisions are
    exported (optional); ``on_decision(deployment, decision)``: called for every decision;
    ``scrape_timeout_s``: per-replica `/metrics` timeout; ``history``: where the policies'
    arrival history is kept (None: memory only); ``wall_clock``: Unix seconds (the saved times).
    """

    def __init__(
        self,
        controller: Controller,
        *,
        router: RouterStatsSource,
        engine_api: EngineAPI,
        clock: Callable[[], float],
        metrics: AutoscalerMetrics | None = None,
        on_decision: Callable[[str, ScalingDecision], None] | None = None,
        scrape_timeout_s: float = 2.0,
        history: ArrivalHistoryStore | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.controller = controller
        self.history = history
        self.wall_clock = wall_clock
        self._next_save_s: float | None = None
        self.router = router
        self.engine_api = engine_api
        self.clock = clock
        self.metrics = metrics
        self.on_decision = on_decision or (lambda name, d: None)
        self.scrape_timeout_s = scrape_timeout_s
        self.scaled: dict[str, _Scaled] = {}
        for name, ds in controller.deployments.items():
            spec = ds.loaded.deployment.spec
            if spec.autoscaling is None:
                continue
            bounds = ReplicaBounds(spec.replicas.min, spec.replicas.max, spec.replicas.desired_at_start)
            a = spec.autoscaling
            policy = make_policy(a, bounds)
            policy.defer_work = True   # a forecast refit (0.2-0.3 s) runs in a worker thread, not on this loop
            self.scaled[name] = _Scaled(
                name, spec.model.name, policy, DeploymentSignals(a.window_seconds),
                StartupTracker(a.warm_startup_seconds, a.cold_startup_seconds),
            )  # fmt: skip

    def carry_over(self, old: AutoscalerLoop, changed: set[str]) -> None:
        """Keep what ``old`` (the loop this one replaces, over the same controller) learnt: the
        whole state (signal windows, start-up estimates, next due time) of each deployment both
        scale and ``changed`` does not name; for a changed one, its policy's arrival history alone
        (a new policy keeps the forecast's seasons)."""
        for name, kept in old.scaled.items():
            if name in self.scaled and name not in changed:
                self.scaled[name] = kept
            elif name in self.scaled and kept.primed:
                fresh = self.scaled[name]
                fresh.policy.prime(kept.policy.history())
                fresh.primed = True

    @property
    def slow_step_s(self) -> float:
        """A step slower than this (the shortest policy interval) delays decisions: warned."""
        return min([d.policy.interval_s for d in self.scaled.values()] or [5.0])

    @property
    def interval_s(self) -> float:
        """How often `run` should tick: the shortest policy interval (1 s at most)."""
        return min([1.0, *(d.policy.interval_s for d in self.scaled.values())])

    async def step(self) -> list[tuple[str, ScalingDecision]]:
        """Decide for every deployment whose policy is due; return the decisions made."""
        now_s = self.clock()
        if self.history is not None:
            await self._restore_history()
            if self._next_save_s is None:
                self._next_save_s = now_s + HISTORY_SAVE_S
            elif now_s >= self._next_save_s:
                self._next_save_s = now_s + HISTORY_SAVE_S
                await self.save_history()
        due = [d for d in self.scaled.values() if now_s >= d.next_due_s]
        if not due:
            return []
        router_stats = await self._router_stats({d.signals.window_s for d in due})
        decisions = []
        for d in due:
            try:
                decision = await self._decide(d, router_stats.get(d.signals.window_s))
            except Exception:  # noqa: BLE001 - one deployment's failure never stops the others
                log.exception("autoscaling %s failed", d.name)
                continue
            decisions.append((d.name, decision))
        return decisions

    async def run(self, stop: asyncio.Event) -> None:
        """`step` every `interval_s` until ``stop`` is set."""
        while not stop.is_set():
            started_s = self.clock()
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the loop survives its parts
                log.exception("autoscaler step failed")
            took_s = self.clock() - started_s
            if took_s > self.slow_step_s:
                log.warning("autoscaler step took %.1f s (decisions are due every %.0f s)", took_s, self.slow_step_s)
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
        await self.save_history()

    async def _restore_history(self) -> None:
        """Prime every policy not primed yet with its deployment's saved rates (once each; a
        history that cannot be read is logged and the policies start without it)."""
        fresh = [d for d in self.scaled.values() if not d.primed]
        if not fresh or self.history is None:
            return
        try:
            saved = await self.history.load()
        except Exception as err:  # noqa: BLE001 - unreadable or unusable: start without it
            log.warning("arrival history not restored (the forecast starts from nothing): %s", err)
            saved = {}
        offset_s = self.clock() - self.wall_clock()
        for d in fresh:
            rows = saved.get(d.name, [])
            if rows:
                d.policy.prime([(t_s + offset_s, rate) for t_s, rate in rows])
                log.info("%s: arrival history restored (%d bins)", d.name, len(rows))
            d.primed = True

    async def save_history(self) -> None:
        """Save every policy's arrival history (`ScalingPolicy.history`) in wall-clock time;
        nothing when no policy keeps any. A failure is logged (tried again at the next save)."""
        if self.history is None:
            return
        offset_s = self.wall_clock() - self.clock()
        history: History = {d.name: [(t_s + offset_s, rate) for t_s, rate in rows]
                            for d in self.scaled.values() if d.primed and (rows := d.policy.history())}  # fmt: skip
        if not history:
            return
        try:
            await self.history.save(history)
        except Exception as err:  # noqa: BLE001 - kept in memory; the next save tries again
            log.warning("arrival history not saved: %s", err)

    async def _router_stats(self, windows: set[float]) -> dict[float, dict[str, dict] | None]:
        out: dict[float, dict[str, dict] | None] = {}
        for window_s in sorted(windows):
            try:
                out[window_s] = await self.router.stats(window_s)
            except Exception as err:  # noqa: BLE001 - router unreachable: router signals unmeasured
                log.warning("cannot read router stats: %s", err)
                out[window_s] = None
        return out

    async def _scrape(self, d: _Scaled, ready: list[Replica], now_s: float) -> None:
        async def one(r: Replica) -> None:
            assert r.endpoint is not None
            try:
                text = await self.engine_api.metrics(r.endpoint, self.scrape_timeout_s)
                d.signals.observe_engine(r.id, now_s, parse_engine_metrics(text, d.model))
            except (EngineRequestError, EngineMetricsError) as err:
                d.signals.scrape_failed(r.id)
                log.debug("scrape of %s failed: %s", r.id, err)

        await asyncio.gather(*(one(r) for r in ready))
        d.signals.forget_others({r.id for r in ready})

    def _start_background(self, d: _Scaled) -> None:
        """Run the policy's deferred work (`ScalingPolicy.take_background`: a forecast refit) in
        a worker thread and apply its result on this loop when done; one at a time per
        deployment (a job due meanwhile waits in the policy, a newer one replacing it)."""
        if d.background is not None and not d.background.done():
            return
        work = d.policy.take_background()
        if work is None:
            return

        async def run() -> None:
            try:
                apply = await asyncio.to_thread(work)
                apply()
            except Exception:  # noqa: BLE001 - the policy goes on with its last model
                log.exception("background work of %s's policy failed", d.name)

        d.background = asyncio.get_running_loop().create_task(run(), name=f"autoscaler-fit-{d.name}")

    async def _decide(self, d: _Scaled, router_stats: dict[str, dict] | None) -> ScalingDecision:
        controller = self.controller
        replicas = controller.records.of_deployment(d.name)
        ready = [r for r in replicas if r.status is ReplicaStatus.READY and r.endpoint]
        starting = [r for r in replicas if r.status.counts_toward_desired() and r.status is not ReplicaStatus.READY
                    and not r.standby_refill]   # a refill is not in the target: it sleeps once warm
        for r in ready:
            observed = startup_of(r)
            if observed is not None:
                d.startup.observe(r.id, *observed)
        now_s = self.clock()
        await self._scrape(d, ready, now_s)
        signals = d.signals.signals(now_s, (router_stats or {}).get(d.model))
        # Warm or cold: where placement would put one more replica now, and what that node holds.
        asleep = [r for r in replicas if r.status is ReplicaStatus.STANDBY]
        startup = d.startup.estimate(next_warm=controller.next_replica_warm(d.name))
        if asleep:   # the next replica asked for wakes: its lead time is the wake-up, not a start
            startup = dataclasses.replace(startup, wake_s=wake_estimate_s(replicas))
        ctx = ScalingContext(now_s, controller.deployments[d.name].desired, len(ready), len(starting), signals,
                             startup, standby=len(asleep))  # fmt: skip
        decision = d.policy.decide(ctx)
        d.next_due_s = now_s + d.policy.interval_s
        self._start_background(d)
        if decision.standby != controller.deployments[d.name].standby_wanted:
            controller.deployments[d.name].standby_wanted = decision.standby
            controller.wake()
        if decision.desired != ctx.desired:
            controller.set_desired(d.name, decision.desired, reason=f"autoscaler: {decision.reason}")
            controller.wake()
        controller.note_scaling_decision(d.name, {**decision.to_dict(), "policy": d.policy.name,
                                                  "signals": signals.to_dict()})  # fmt: skip
        if self.metrics is not None:
            self.metrics.record(d.name, ctx, decision)
        level = logging.DEBUG if decision.direction is Direction.HOLD else logging.INFO
        log.log(level, "%s: %s %d -> %d (%s): %s", d.name, decision.direction.value, decision.previous,
                decision.desired, decision.reason, decision.detail)  # fmt: skip
        self.on_decision(d.name, decision)
        return decision
