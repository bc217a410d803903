"""Canary rollouts in the trace simulator: a trace through the real router split and policy, with
a canary revision whose simulated engine is identical, slower or failing, judged by Fleet's
analysis or a baseline, driven by the real rollout state machine, in virtual time.

Owns `CanaryVariant` (how the canary's engine differs: prefill or decode steps slower, a share of
requests answered with errors, or no traffic reaching it), `VARIANTS`, `RolloutSimConfig`,
`RolloutOutcome` and `RolloutSimulation` (its handlers on the shared event loop,
`fleet.tracesim.events`), and `run_experiment` (every judge against every variant on one
workload). Called by `fleet simulate-rollout` (fleet.cli.rollout).
No I/O, no clock: the same config and workload give the same outcome. This is a SIMULATOR: the
engines are `fleet.enginesim` latency models, not vLLM.

What runs for real: `router.pools.pool.Pool.pick` with its revision split (`router.pools.split`) and the
routing policy; per-request records in `router.stats.request_log.RequestLog`, turned into each
revision's samples by `fleet.rollout.revisions.side_samples` (the controller's code path, replicas' first
seconds after READY left out); `rollout.machine.CanaryMachine` (steps, weights, failure limit,
promote or roll back) and `rollout.machine.replica_targets` (replicas per revision); the judges
of `rollout.judges` (Fleet's `rollout.analysis.analyse` and the baselines).

What is modelled: a fixed deployment size (``replicas``; the autoscaler is not the subject);
stable replicas are READY at 0 s; the rollout starts at ``rollout_start_s`` and canary replicas
become READY ``canary_startup_s`` after they are asked for; a stable replica asked to go drains
(no new requests; in-flight ones finish). Every reply is streamed (TTFT and TPOT are measured
for every successful request, as chat clients stream). A canary with ``error_share`` answers
that share of its requests with an error at once (chosen by a hash of the request index).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from fleet.rollout.revisions import RequestSample, Revisions, endpoint_weights, side_samples
from fleet.enginesim.cost import StepCost, StepFeatures
from fleet.enginesim.model import EngineModel, FinishedRequest, StepResult
from fleet.enginesim.profiles import Profile
from fleet.controller.lifecycle import ReplicaStatus
from fleet.controller.scale import scale_step
from fleet.tracesim.events import FIRST_OWN_KIND, READY, EngineStepper, EventLoop
from fleet.tracesim.replica import VirtualReplica
from fleet.tracesim.workload import Workload, prompt_ids
from router.kv.prompt_blocks import route_request
from fleet.rollout.analysis import SideSamples
from fleet.rollout.judges import make_judge
from fleet.rollout.machine import CanaryMachine, RolloutPhase, replica_targets
from fleet.rollout.spec import RolloutSpec
from router.pools.policies import make_policy
from router.pools.pool import Pool, PoolShared
from router.stats.windows import ModelStats, nearest_rank

_CONTROL = FIRST_OWN_KIND
CONTROL_INTERVAL_S = 1.0
"""Virtual seconds between two controller ticks (`fleet up` reconciles every second)."""


@dataclass(frozen=True)
class CanaryVariant:
    """How the canary's engine differs from stable's. ``prefill_factor``: steps that compute a
    prompt (chunk) take this much longer (TTFT); ``decode_factor``: decode-only steps take this
    much longer (TPOT); ``error_share``: share of its requests answered with an error at once;
    ``no_traffic``: its endpoints never reach the router's pool (a broken route)."""

    name: str
    prefill_factor: float = 1.0
    decode_factor: float = 1.0
    error_share: float = 0.0
    no_traffic: bool = False
    bad: bool = False   # a rollout should not promote it


VARIANTS = (
    CanaryVariant("identical"),
    CanaryVariant("ttft+30%", prefill_factor=1.3, bad=True),
    CanaryVariant("tpot+30%", decode_factor=1.3, bad=True),
    CanaryVariant("errors-2%", error_share=0.02, bad=True),
    CanaryVariant("no-traffic", no_traffic=True, bad=True),
)


class _ScaledCost:
    """A `fleet.enginesim.cost.StepCost` whose prompt (prefill) work and decode work are scaled apart.

    A step's prefill part is its causal-attention term plus the linear-layer time of its prompt
    tokens (tokens beyond one per sequence); the rest is decode work. Scaling the prefill part
    slows time to first token (and, a little, the decodes batched with it); scaling the decode
    part slows every decode, in mixed steps too (with chunked prefill most busy steps are mixed)."""

    def __init__(self, base: StepCost, prefill_factor: float, decode_factor: float) -> None:
        self.base, self.prefill_factor, self.decode_factor = base, prefill_factor, decode_factor
        self.admission_s = base.admission_s

    def duration_s(self, f: StepFeatures) -> float:
        base_s = self.base.duration_s(f)
        c = self.base
        prefill_s = c.per_prefill_pair_s * f.prefill_attention_pairs + c.per_token_s * max(0, f.num_tokens - f.num_seqs)
        prefill_s = min(prefill_s, base_s)
        return prefill_s * self.prefill_factor + (base_s - prefill_s) * self.decode_factor


@dataclass(frozen=True)
class RolloutSimConfig:
    """One simulated rollout: ``profile`` of stable's engine, ``replicas`` (deployment size),
    ``rollout`` (`spec.rollout`), ``judge`` (`rollout.judges` name; ``threshold_s`` for
    ``abs-p99``), ``variant``; seconds: ``rollout_start_s``, ``canary_startup_s``,
    ``max_rollout_s`` (undecided after that)."""

    profile: Profile
    replicas: int
    rollout: RolloutSpec
    judge: str
    variant: CanaryVariant
    threshold_s: float | None = None
    rollout_start_s: float = 600.0
    canary_startup_s: float = 60.0
    max_rollout_s: float = 1800.0
    routing_policy: str = "latency-aware"
    seed: int = 0


@dataclass
class RolloutOutcome:
    """What happened: ``decision`` (promoted, rolled back, undecided), ``decided_after_s``
    (from the rollout's start), requests the canary served (and of those failed) before the
    decision, the analysis verdicts in order, and the reason."""

    judge: str
    variant: str
    decision: str
    decided_after_s: float | None
    canary_requests: int
    canary_failed: int
    requests: int
    failed: int
    verdicts: list[str] = field(default_factory=list)
    reason: str = ""
    bad: bool = False

    @property
    def correct(self) -> bool:
        return self.decision != "promoted" if self.bad else self.decision == "promoted"

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "correct": self.correct}


class RolloutSimulation:
    """One rollout over ``workload`` (see the module docstring); `run()` once."""

    def __init__(self, config: RolloutSimConfig, workload: Workload) -> None:
        self.cfg = config
        self.workload = workload
        self.machine = CanaryMachine(config.rollout)
        self.judge = make_judge(config.judge, config.rollout.analysis, config.threshold_s)
        self.shared = PoolShared(ModelStats(0.0))
        self.routing = make_policy(config.routing_policy)
        self.replicas: list[VirtualReplica] = []
        self.version: dict[str, str] = {}
        self.state = None
        self.revs = Revisions({}, "stable")
        self.loop = EventLoop()
        self.engines = EngineStepper(self.loop, self._on_step)
        self.loop.on(READY, self._on_ready)
        self.loop.on(_CONTROL, lambda _, now_s: self._control(now_s))
        self.canary_requests = self.canary_failed = self.requests = self.failed = 0
        self._prefill: dict[str, int] = {}   # request id -> prefill tokens charged to its endpoint
        self.pool = self._make_pool()

    def run(self, until_s: float | None = None) -> RolloutOutcome:
        """Replay until the rollout is decided, ``max_rollout_s`` after it started, the trace
        ends, or ``until_s`` (virtual seconds)."""
        cfg = self.cfg
        for _ in range(cfg.replicas):
            self._add("stable", 0.0, ready_now=True)
        self._make_pool()
        self.loop.push(cfg.rollout_start_s, _CONTROL)
        horizon_s = cfg.rollout_start_s + cfg.max_rollout_s if until_s is None else until_s
        self.loop.run(lambda: self.state is not None and self.state.phase.terminal(),
                      arrivals=[r.arrival_s for r in self.workload.requests], on_arrival=self._arrive,
                      horizon_s=horizon_s)  # fmt: skip
        st = self.state
        decided = st is not None and st.phase.terminal()
        decision = ("promoted" if st.phase is RolloutPhase.PROMOTED else "rolled back") if decided else "undecided"  # type: ignore[union-attr]
        return RolloutOutcome(
            cfg.judge, cfg.variant.name, decision,
            (st.decided_at_s - cfg.rollout_start_s) if decided else None,  # type: ignore[union-attr,operator]
            self.canary_requests, self.canary_failed, self.requests, self.failed,
            [r["verdict"] for r in (st.runs if st else [])], st.reason if st else "", cfg.variant.bad,
        )  # fmt: skip

    # ----- replicas and the pool -------------------------------------------------------------

    def _add(self, version: str, now_s: float, ready_now: bool = False) -> VirtualReplica:
        cfg, v = self.cfg, self.cfg.variant
        cost = cfg.profile.cost
        if version == "canary" and (v.prefill_factor != 1.0 or v.decode_factor != 1.0):
            cost = _ScaledCost(cost, v.prefill_factor, v.decode_factor)  # type: ignore[assignment]
        index = len(self.replicas)
        engine = EngineModel(cfg.profile.config, cost)  # type: ignore[arg-type]
        ready_at_s = now_s if ready_now else now_s + cfg.canary_startup_s
        r = VirtualReplica(f"{version}-{index}", index, engine, now_s, ready_at_s, True, index)
        r.endpoint.version = version
        self.replicas.append(r)
        self.version[r.id] = version
        if ready_now:
            r.record_ready(now_s)
        else:
            self.loop.push(ready_at_s, READY, r)
        return r

    def _on_ready(self, r: VirtualReplica, now_s: float) -> None:
        r.record_ready(now_s)
        self._make_pool()

    def _make_pool(self) -> Pool:
        members = [r for r in self.replicas if r.status in (ReplicaStatus.READY, ReplicaStatus.DRAINING)
                   and not (self.cfg.variant.no_traffic and self.version[r.id] == "canary")]  # fmt: skip
        ready: dict[str, int] = {}
        for r in members:
            r.endpoint.draining = r.status is ReplicaStatus.DRAINING
            if not r.endpoint.draining:
                ready[self.version[r.id]] = ready.get(self.version[r.id], 0) + 1
        weights = endpoint_weights(self.revs, ready)
        for r in members:
            r.endpoint.weight = weights.get(self.version[r.id], 0.0)
        self.pool = Pool("m", self.routing, [r.endpoint for r in members], 0.0, self.shared)
        return self.pool

    # ----- requests --------------------------------------------------------------------------

    def _arrive(self, i: int, now_s: float) -> None:
        self.requests += 1
        req = self.workload.requests[i]
        ids = prompt_ids(i, req, self.cfg.seed)
        route = route_request({"prompt": ids, "max_tokens": req.output_tokens}, req.session_id)
        endpoint = self.pool.pick(route, now_s)
        if endpoint is None:
            self.failed += 1
            return
        r = next(x for x in self.replicas if x.id == endpoint.id)
        canary = self.version[r.id] == "canary"
        self.canary_requests += canary
        share = self.cfg.variant.error_share
        if canary and share > 0 and random.Random(f"{self.cfg.seed}:{i}").random() < share:
            self.failed += 1
            self.canary_failed += 1
            self.shared.finished(r.endpoint, arrival_s=now_s, dispatch_s=now_s, end_s=now_s, first_token_s=None,
                                 tpot_s=None, e2e_s=None, failed=True)  # fmt: skip
            return
        endpoint.start(route.prefill_tokens)   # the load the routing policies read, as the proxy keeps it
        self._prefill[str(i)] = route.prefill_tokens
        r.in_flight_ids.add(str(i))
        r.engine.add_request(str(i), ids, req.output_tokens, now_s)
        self.engines.poke(r, now_s)

    def _finish(self, r: VirtualReplica, fr: FinishedRequest, now_s: float) -> None:
        r.endpoint.finish(self._prefill.pop(fr.request_id, 0), False)
        r.in_flight_ids.discard(fr.request_id)
        ok = fr.finish_reason != "abort" and fr.first_token_s is not None
        if not ok:
            self.failed += 1
            self.canary_failed += self.version[r.id] == "canary"
        tpot = fr.tpot_s if ok and fr.num_output_tokens > 1 else None
        # Dispatched as it arrived (no admission queue here): the router's queue time is 0, as the
        # proxy would record it; the engine's own queue shows in TTFT.
        self.shared.finished(r.endpoint, arrival_s=fr.arrival_s, dispatch_s=fr.arrival_s, end_s=now_s,
                             first_token_s=fr.first_token_s if ok else None, tpot_s=tpot,
                             e2e_s=fr.e2e_s if ok else None, failed=not ok)  # fmt: skip
        if r.status is ReplicaStatus.DRAINING and r.endpoint.in_flight == 0:
            r.record_stop(now_s)
            self._make_pool()

    def _on_step(self, r: VirtualReplica, result: StepResult, now_s: float) -> bool:
        """A step of ``r``'s engine ended (`fleet.tracesim.events.EngineStepper`): its finished
        requests leave; the engine steps on."""
        for fr in result.finished:
            self._finish(r, fr, now_s)
        return True

    # ----- the controller's rollout step -------------------------------------------------------

    def _control(self, now_s: float) -> None:
        cfg = self.cfg
        if self.state is None:
            self.state = self.machine.start("canary", "stable", now_s)
            self.revs.canary, self.revs.rollout = "canary", self.state
        st = self.state
        canary_ready = sum(1 for r in self.replicas if self.version[r.id] == "canary" and r.status is ReplicaStatus.READY)
        self.machine.advance(st, now_s, canary_ready=canary_ready, total=cfg.replicas)
        if self.machine.analysis_due(st, now_s):
            run = self._analyse(now_s)
            self.machine.record(st, run, now_s)
            self.machine.advance(st, now_s, canary_ready=canary_ready, total=cfg.replicas)
        if st.phase.terminal():
            return
        stable_n, canary_n = replica_targets(cfg.replicas, st.weight, self.machine.sizing_weight(st),
                                             cfg.rollout.surge)  # fmt: skip
        for version, want in (("stable", stable_n), ("canary", canary_n)):
            active = [r for r in self.replicas if self.version[r.id] == version and r.status.counts_toward_desired()]
            step = scale_step(active, want, lambda r: r.index)   # the controller's scale step
            for _ in range(step.create):
                self._add(version, now_s)
            for r in step.drain:
                r.record_drain(now_s)
                if not r.endpoint.in_flight:
                    r.record_stop(now_s)   # nothing in flight: stops at once
        self._make_pool()
        self.loop.push(now_s + CONTROL_INTERVAL_S, _CONTROL)

    def _analyse(self, now_s: float):
        st = self.state
        spec = self.cfg.rollout.analysis
        window_s = now_s - st.window_from_s  # type: ignore[union-attr]
        samples = [RequestSample.from_row(row) for row in self.shared.requests.rows(now_s, window_s)]
        eligible = {r.id: now_s - (r.ready_at_s + spec.exclude_after_ready_seconds) for r in self.replicas}
        for r in self.replicas:
            if r.ready_at_s == 0.0:
                eligible[r.id] = math.inf   # READY before the trace began
        canary: SideSamples = side_samples(samples, "canary", window_s, eligible)
        stable = side_samples(samples, "stable", window_s, eligible)
        return self.judge.judge(canary, stable, st.window_from_s, now_s)  # type: ignore[union-attr]


def abs_p99_threshold(workload: Workload, config: RolloutSimConfig, margin: float = 1.2) -> float:
    """The static threshold an SRE would set for ``abs-p99``: ``margin`` x the stable revision's
    whole-request p99 before the rollout (from a run of the same workload that never rolls out)."""
    probe = RolloutSimulation(RolloutSimConfig(**{**config.__dict__, "rollout_start_s": math.inf}), workload)
    probe.run(until_s=config.rollout_start_s)
    e2e = [row[5] for row in probe.shared.requests.rows(config.rollout_start_s, config.rollout_start_s)
           if row[5] is not None]
    return margin * nearest_rank(sorted(e2e), 0.99)


def run_experiment(base: RolloutSimConfig, workload: Workload, judges: list[str],
                   variants: tuple[CanaryVariant, ...] = VARIANTS) -> list[RolloutOutcome]:  # fmt: skip
    """Every judge against every variant; ``abs-p99`` gets `abs_p99_threshold`."""
    threshold_s = abs_p99_threshold(workload, base) if "abs-p99" in judges else None
    out = []
    for variant in variants:
        for judge in judges:
            cfg = RolloutSimConfig(**{**base.__dict__, "judge": judge, "variant": variant,
                                      "threshold_s": threshold_s if judge == "abs-p99" else None})  # fmt: skip
            out.append(RolloutSimulation(cfg, workload).run())
    return out
