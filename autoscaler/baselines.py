"""The ways users scale LLM deployments today, as policies with Fleet's policy signature, so the
trace simulator runs them beside `fleet` on the same trace (and `fleet up` can run them too).

Owns `FixedPolicy` (`fixed`), `KedaQueuePolicy` (`keda-queue`) and `KpaPolicy` (`kpa`).
Registered by importing `autoscaler.policy`; built with `autoscaler.policy.make_policy`.

- `fixed`: `spec.replicas.initial` replicas, always (size it for the peak or the mean).
- `keda-queue`: KEDA's Prometheus scaler on ``sum(vllm:num_requests_waiting)`` with an
  ``AverageValue`` target, the autoscaling vLLM's production-stack documents. KEDA hands the
  metric to a Kubernetes HPA, whose algorithm this is: desired = ceil(total waiting / target per
  replica) (``ceil(current x metric / target)`` with the per-replica average), unchanged while
  |total / (target x current) - 1| <= tolerance (0.1); HPA stabilisation and rate limits
  (`spec.autoscaling` windows and rates; HPA's defaults are a 300 s scale-down window and
  max(x2, +4) per 15 s); evaluated every 15 s (HPA's sync period).
- `kpa`: Knative's Pod Autoscaler on concurrency (requests in flight + queued at the router),
  after knative/serving pkg/autoscaler/scaling/autoscaler.go: stable-mode desired =
  ceil(average concurrency over the 60 s stable window / target), panic-mode desired the same
  over the 6 s panic window (10 % of stable); both bounded to [floor(ready / 2),
  ceil(ready x 1000)]; panic starts when panic desired / ready >= 2 (200 %), lasts until a
  whole stable window has passed without that, and never scales down while it lasts; target =
  `targetConcurrencyPerReplica` x 70 % utilization; evaluated every 2 s (Knative's tick).
"""

from __future__ import annotations

import math
from collections import deque

from autoscaler.policy import (
    ReplicaBounds,
    ScalingContext,
    ScalingDecision,
    ScalingPolicy,
    Stabilizer,
    limit_rate,
)
from autoscaler.spec import AutoscalingSpec


class FixedPolicy(ScalingPolicy, name="fixed"):
    """A constant replica count: ``bounds.initial``. Reason: ``fixed``."""

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        return self._decision(ctx, self.bounds.initial, "fixed", f"fixed at {self.bounds.initial} replica(s)")


class KedaQueuePolicy(ScalingPolicy, name="keda-queue"):
    """KEDA + HPA on the engines' waiting requests (module docstring).

    Reasons: ``queue_above_target`` (up), ``queue_below_target`` (down), ``within_tolerance``,
    ``stabilizing``, ``no_signal`` (no engine reported `vllm:num_requests_waiting`), bounds.
    """

    default_interval_s = 15.0

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        super().__init__(spec, bounds)
        self.params = spec.keda_params
        self._stabilizer = Stabilizer(spec.scale_up_stabilization_seconds, spec.scale_down_stabilization_seconds)
        self._seeded = False

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        if not self._seeded:
            self._stabilizer.seed(ctx.now_s, ctx.desired)
            self._seeded = True
        waiting = ctx.signals.engine_waiting
        current = ctx.desired
        if waiting is None:
            return self._decision(ctx, current, "no_signal", "no engine reported vllm:num_requests_waiting")
        target = self.params.target_waiting_per_replica
        raw = math.ceil(waiting / target - 1e-9)
        reason = "queue_above_target" if raw > current else "queue_below_target"
        if current > 0 and abs(waiting / (target * current) - 1.0) <= self.params.tolerance:
            raw, reason = current, "within_tolerance"
        stabilized = self._stabilizer.apply(ctx.now_s, current, raw)
        if stabilized == current and raw != current:
            reason = "stabilizing"
        desired = limit_rate(current, stabilized, up_rate=self.spec.max_scale_up_rate,
                             up_step=self.spec.max_scale_up_step, down_rate=self.spec.max_scale_down_rate)  # fmt: skip
        detail = f"{waiting:g} waiting / {target:g} per replica -> {raw}"
        return self._decision(ctx, desired, reason, detail, engine_waiting=waiting, recommended=raw)


class KpaPolicy(ScalingPolicy, name="kpa"):
    """Knative's KPA on concurrency (module docstring).

    Reasons: ``kpa_stable`` (stable mode), ``kpa_panic`` (panic mode, scaling up or holding its
    peak), bounds. `panicking` tells whether panic mode is on.
    """

    default_interval_s = 2.0

    def __init__(self, spec: AutoscalingSpec, bounds: ReplicaBounds) -> None:
        super().__init__(spec, bounds)
        self.params = spec.kpa_params
        self._samples: deque[tuple[float, int]] = deque()
        self._panic_since_s: float | None = None  # Knative's panicTime: the last time over the threshold
        self._max_panic_pods = 0

    @property
    def panicking(self) -> bool:
        return self._panic_since_s is not None

    def _average(self, now_s: float, window_s: float) -> float:
        values = [c for t, c in self._samples if t > now_s - window_s]
        return sum(values) / len(values) if values else 0.0

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        p, now_s = self.params, ctx.now_s
        self._samples.append((now_s, ctx.signals.concurrency))
        while self._samples and self._samples[0][0] <= now_s - p.stable_window_seconds:
            self._samples.popleft()
        stable = self._average(now_s, p.stable_window_seconds)
        panic = self._average(now_s, p.panic_window_seconds)
        ready = max(1, ctx.ready)  # Knative: readyPodsCount is at least 1
        max_up = math.ceil(p.max_scale_up_rate * ready)
        max_down = math.floor(ready / p.max_scale_down_rate)
        dspc = math.ceil(stable / p.target - 1e-9)
        dppc = math.ceil(panic / p.target - 1e-9)
        desired_stable = min(max(dspc, max_down), max_up)
        desired_panic = min(max(dppc, max_down), max_up)
        over_threshold = dppc / ready >= p.panic_threshold_percentage / 100.0
        if over_threshold:
            self._panic_since_s = now_s  # enter panic, or extend it
        elif self._panic_since_s is not None and now_s > self._panic_since_s + p.stable_window_seconds:
            self._panic_since_s = None  # a whole stable window without a reason to panic
            self._max_panic_pods = 0
        desired, reason = desired_stable, "kpa_stable"
        if self._panic_since_s is not None:
            reason = "kpa_panic"
            desired = max(desired, desired_panic)
            self._max_panic_pods = max(self._max_panic_pods, desired)
            desired = self._max_panic_pods  # no scale-down while panicking
        detail = (f"concurrency {stable:.1f} (stable {p.stable_window_seconds:g} s), {panic:.1f} "
                  f"(panic {p.panic_window_seconds:g} s), target {p.target:g}/replica")  # fmt: skip
        return self._decision(ctx, desired, reason, detail, stable_concurrency=stable, panic_concurrency=panic,
                              desired_stable=desired_stable, desired_panic=desired_panic)  # fmt: skip
