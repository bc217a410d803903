"""Prometheus export of scaling decisions and the signals behind them, on a registry of its own.

Owns `AutoscalerMetrics`. `fleet.controller.autoscaling` records every decision into it; `fleet up`
serves its registry at `http://HOST:METRICS_PORT/metrics`. The trace simulator may record into
one as well (it never needs to serve it).

Series (label ``deployment``; seconds and requests/s as named):
`fleet_autoscaler_desired_replicas`, `fleet_autoscaler_ready_replicas`,
`fleet_autoscaler_decisions_total{direction,reason}` (one per decision, holds included),
`fleet_autoscaler_queue_time_seconds` (mean, router + engine), `fleet_autoscaler_ttft_p99_seconds`,
`fleet_autoscaler_e2e_p99_seconds`, `fleet_autoscaler_arrival_rate`,
`fleet_autoscaler_concurrency` (in flight + queued), `fleet_autoscaler_engine_waiting`,
`fleet_autoscaler_kv_cache_usage` (0..1), `fleet_autoscaler_startup_seconds{kind}` (the warm and
cold placement-to-READY estimates, and ``wake``: the wake-to-READY estimate of a STANDBY replica,
counted from its wake; NaN while none is asleep). A signal that was not measured is exported as NaN.
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge

from autoscaler.policy import ScalingContext, ScalingDecision


class AutoscalerMetrics:
    """The autoscaler's metric families on ``registry`` (default: a fresh one, never the global)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        d = ["deployment"]
        self.desired = Gauge("fleet_autoscaler_desired_replicas", "Replicas the autoscaler targets.", d, registry=r)
        self.ready = Gauge("fleet_autoscaler_ready_replicas", "READY replicas at the last decision.", d, registry=r)
        self.decisions = Counter(
            "fleet_autoscaler_decisions", "Scaling decisions, by direction (up, down, hold) and reason.",
            [*d, "direction", "reason"], registry=r,
        )  # fmt: skip
        self.signals = {
            "queue_time_s": Gauge("fleet_autoscaler_queue_time_seconds",
                                  "Mean queue time over the window: router admission queue + engine scheduler.",
                                  d, registry=r),
            "ttft_p99_s": Gauge("fleet_autoscaler_ttft_p99_seconds",
                                "p99 time to first token over the window, as clients see it.", d, registry=r),
            "e2e_p99_s": Gauge("fleet_autoscaler_e2e_p99_seconds",
                               "p99 end-to-end latency over the window.", d, registry=r),
            "arrival_rate_per_s": Gauge("fleet_autoscaler_arrival_rate",
                                        "Requests per second arriving at the router, over the window.", d, registry=r),
            "concurrency": Gauge("fleet_autoscaler_concurrency",
                                 "Requests in flight plus queued in the router.", d, registry=r),
            "engine_waiting": Gauge("fleet_autoscaler_engine_waiting",
                                    "Sum of vllm:num_requests_waiting over READY replicas.", d, registry=r),
            "kv_cache_usage": Gauge("fleet_autoscaler_kv_cache_usage",
                                    "Highest vllm:kv_cache_usage_perc of the READY replicas (0..1).", d, registry=r),
        }  # fmt: skip
        self.startup = Gauge(
            "fleet_autoscaler_startup_seconds", "Estimated time to READY, by kind: warm and cold from placement "
            "of a new replica, wake from the wake of a STANDBY one.",
            [*d, "kind"], registry=r,
        )  # fmt: skip

    def record(self, deployment: str, ctx: ScalingContext, decision: ScalingDecision) -> None:
        """Export one decision and the context it was made in."""
        self.desired.labels(deployment).set(decision.desired)
        self.ready.labels(deployment).set(ctx.ready)
        self.decisions.labels(deployment, decision.direction.value, decision.reason).inc()
        s = ctx.signals
        values = {
            "queue_time_s": s.queue_time_s, "ttft_p99_s": s.ttft_p99_s, "e2e_p99_s": s.e2e_p99_s,
            "arrival_rate_per_s": s.arrival_rate_per_s, "concurrency": s.concurrency,
            "engine_waiting": s.engine_waiting, "kv_cache_usage": s.kv_cache_usage,
        }  # fmt: skip
        for key, gauge in self.signals.items():
            value = values[key]
            gauge.labels(deployment).set(math.nan if value is None else float(value))
        self.startup.labels(deployment, "warm").set(ctx.startup.warm_s)
        self.startup.labels(deployment, "cold").set(ctx.startup.cold_s)
        wake_s = ctx.startup.wake_s
        self.startup.labels(deployment, "wake").set(math.nan if wake_s is None else wake_s)
