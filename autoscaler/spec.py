"""The `spec.autoscaling` section of a deployment: which policy scales it, toward which targets.

Owns `AutoscalingSpec` and the blocks of the baseline policies (`KpaSpec`, `KedaQueueSpec`).
Included by `fleet.spec.DeploymentSpec`; read by the policies (`autoscaler.policy`,
`autoscaler.baselines`) and by `fleet.controller.autoscaling`. The replica bounds are not repeated here:
every policy scales within `spec.replicas.min..max` and starts from `spec.replicas.initial`.

Top-level fields configure Fleet's policy (`fleet`); the stabilisation windows and scale rates
also configure `keda-queue`, which follows the Kubernetes HPA that KEDA drives. Defaults:
scale-down stabilisation 300 s and no scale-up stabilisation are HPA's defaults
(`behavior.scaleDown.stabilizationWindowSeconds`, kubernetes.io "Horizontal Pod Autoscaling");
a scale-up of at most x2 or +4 replicas per decision is HPA's default `scaleUp.policies`
(100 % or 4 pods per 15 s period); at most halving per decision is Knative's
`max-scale-down-rate` 2.0.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fleet.base.registry import Registry
from fleet.base.rules import CrossFieldRule
from fleet.base.spec import SpecModel

SCALING_POLICIES: Registry = Registry("autoscaling policy")
"""The scaling policies by name (`fleet.base.registry`): `spec.autoscaling.policy` must be one. The
policies register themselves (`autoscaler.policy`, `autoscaler.baselines`,
`autoscaler.standby`); the package imports them all (autoscaler/__init__.py), so the registry is
complete before any spec is parsed."""


class KpaSpec(SpecModel):
    """Parameters of the `kpa` baseline (Knative Pod Autoscaler; defaults are Knative's
    `config-autoscaler` defaults, knative.dev/docs/serving/autoscaling/kpa-specific)."""

    target_concurrency_per_replica: float = Field(
        16.0, gt=0, le=100_000,
        description="Concurrent requests one replica should hold (Knative's per-revision `target`, whose "
        "default of 100 suits web servers, not an LLM engine's batch).",
    )  # fmt: skip
    target_utilization_percentage: float = Field(
        70.0, gt=0, le=100, description="Share of the target the autoscaler aims at (Knative default 70)."
    )
    stable_window_seconds: float = Field(
        60.0, ge=6, le=3600, description="Window of the stable-mode average concurrency (Knative default 60 s)."
    )
    panic_window_percentage: float = Field(
        10.0, ge=1, le=100, description="Panic window as a share of the stable window (Knative default 10 %: 6 s)."
    )
    panic_threshold_percentage: float = Field(
        200.0, ge=110, le=1000,
        description="Panic when the panic-window demand reaches this share of the ready replicas (default 200 %).",
    )  # fmt: skip
    max_scale_up_rate: float = Field(
        1000.0, gt=1, description="Desired replicas at most ready x this per decision (Knative default 1000)."
    )
    max_scale_down_rate: float = Field(
        2.0, gt=1, description="Desired replicas at least ready / this per decision (Knative default 2)."
    )

    @property
    def target(self) -> float:
        """Concurrent requests per replica the KPA aims at: target x utilization."""
        return self.target_concurrency_per_replica * self.target_utilization_percentage / 100.0

    @property
    def panic_window_seconds(self) -> float:
        return self.stable_window_seconds * self.panic_window_percentage / 100.0


class KedaQueueSpec(SpecModel):
    """Parameters of the `keda-queue` baseline: KEDA's Prometheus scaler on
    `sum(vllm:num_requests_waiting)` with an `AverageValue` target, as vLLM's production-stack
    tutorial sets it up (docs.vllm.ai/projects/production-stack, "Autoscaling with KEDA")."""

    target_waiting_per_replica: float = Field(
        5.0, gt=0, le=100_000, description="Waiting requests per replica KEDA aims at (the trigger's threshold)."
    )
    tolerance: float = Field(
        0.1, ge=0, lt=1, description="No change while |metric / target - 1| <= this (HPA default 0.1)."
    )


class ForecastSpec(SpecModel):
    """Scaling ahead on a forecast of the arrival rate (policy `standby`; `autoscaler.forecast`):
    Holt-Winters on binned arrival rates, refitted now and then, trusted only while its error
    over a recent validation window is small."""

    bin_seconds: float = Field(
        1800.0, ge=10, le=86_400,
        description="Arrival rates are averaged over bins this long (30 min: on the bursty Azure code mix the "
        "MAPE of 5-minute bins was 40-140 %, of 30-minute bins 10-27 %).",
    )  # fmt: skip
    season_bins: int = Field(
        48, ge=2, le=20_000,
        description="Bins in one season (48 x 30 min: a day; 336: a week, which needs two weeks of history).",
    )  # fmt: skip
    refit_seconds: float = Field(
        1800.0, ge=60, le=86_400, description="Seconds between refits of the model (each a fraction of a second)."
    )
    validation_bins: int = Field(
        4, ge=1, le=10_000,
        description="The forecast is trusted only once this many recent bins were forecast out of sample and scored.",
    )  # fmt: skip
    max_mape: float = Field(
        0.25, gt=0, le=10,
        description="Largest mean absolute percentage error over the validation bins for the forecast to be trusted.",
    )  # fmt: skip
    statistic: Literal["mean", "peak"] = Field(
        "peak",
        description="What is forecast per bin: the peak of the windowed arrival rate (the busiest signal window "
        "of the bin: what the replicas must absorb at once), or the mean arrival rate. Peak by default: on "
        "bursty traffic the mean asks for no more than a reactive policy keeps (days 1-3 of the synthetic "
        "daily trace, docs/benchmarks.md).",
    )
    bound: Literal["point", "upper"] = Field(
        "upper",
        description="Plan replicas for the point forecast, or for its upper bound: the point times the largest "
        "ratio of actual to forecast rate over the validation bins (autoscaler.forecast.ArrivalForecaster."
        "upper_factor; with 4 bins an empirical 80 % bound). Upper: on day 3 of the synthetic daily trace "
        "99.29 % within 2 s at 95.14 replica-hours against 98.65 % at 91.55 with the point (docs/benchmarks.md).",
    )
    rate_headroom: float = Field(
        1.0, ge=1, le=10,
        description="Scale for this multiple of the forecast peak rate (1: the forecast as it is).",
    )  # fmt: skip

    @property
    def horizon_bins(self) -> int:
        """Bins each fit forecasts: until the next refit, plus an hour of look-ahead."""
        return -(-int(self.refit_seconds) // int(self.bin_seconds)) + -(-3600 // int(self.bin_seconds))


class StandbyPoolSpec(SpecModel):
    """How the `standby` policy sizes its pool of sleeping replicas (`autoscaler.standby.StandbyPool`):
    the largest burst excess seen (replicas wanted beyond those READY on a scale-up), each
    burst's weight halving every ``halfLifeSeconds``; sleepers beyond it are released."""

    initial_replicas: int | None = Field(
        2, ge=0, le=10_000,
        description="Standby replicas kept before any burst was seen, for at most initialSeconds. Unset (null): "
        "the deployment's spec.standby.maxReplicas. Chosen on the Azure code and conv traces (docs/benchmarks.md).",
    )  # fmt: skip
    initial_seconds: float = Field(
        60.0, ge=0, le=7 * 86_400,
        description="Before any burst, the starting pool (initialReplicas) is kept this long at least, then only "
        "while the traffic looks bursty (autoscaler.standby.STEADY_PEAK_TO_MEAN): a steady deployment keeps no "
        "sleeper. Chosen on the Azure code and conv traces.",
    )  # fmt: skip
    half_life_seconds: float = Field(
        900.0, gt=0, le=7 * 86_400,
        description="A burst's excess counts half as much this long after it was seen (a pool of 1 from one burst "
        "lasts one half-life, of 4 about three).",
    )  # fmt: skip
    forecast_ahead_seconds: float = Field(
        3600.0, ge=0, le=86_400,
        description="With a trusted forecast (spec.autoscaling.forecast): the pool also holds the replicas its peak "
        "over this many seconds ahead asks for beyond the target. 0: the forecast does not size the pool. An hour: "
        "on day 3 of the synthetic daily trace 98.80 % at 102.79 replica-hours against 98.74 % at 103.80 with 0.",
    )  # fmt: skip
    floor_half_life_seconds: float = Field(
        3600.0, ge=0, le=7 * 86_400,
        description="Burst floor: a scale-down keeps at least the replicas a burst reached within seconds (the "
        "target of a scale-up, at most the READY and standby replicas then), each burst's count halving every "
        "this many seconds; replicas it keeps awake beyond the load's need count as the standby pool, which still "
        "keeps one sleeper while it holds any burst (autoscaler.standby.StandbyPolicy). 0: off. 3600 was chosen on "
        "Azure code and conv and four days of the synthetic daily trace (seeds 7 and 8) by a rule fixed before the "
        "runs; with it `standby` met a held-out day, 99.5 % within 2 s at 0.93x the best fixed fleet "
        "(docs/benchmarks.md, \"Standby on a held-out day\").",
    )  # fmt: skip


def _scaling(autoscaling: dict) -> dict:
    """A spec change setting ``autoscaling`` with room to scale (the rules' examples)."""
    return {"replicas": {"min": 1, "max": 4}, "autoscaling": autoscaling}


class AutoscalingSpec(SpecModel):
    """Scale the deployment between `spec.replicas.min` and `spec.replicas.max`."""

    policy: str = Field("fleet", description="Scaling policy: fleet, standby, keda-queue, kpa or fixed.")
    queue_time_target_seconds: float = Field(
        0.5, gt=0, le=3600,
        description="Target mean queue time: router admission queue + engine scheduler queue (seconds).",
    )  # fmt: skip
    ttft_p99_target_seconds: float = Field(
        2.0, gt=0, le=3600, description="Target p99 time to first token as clients see it (seconds)."
    )
    interval_seconds: float | None = Field(
        None, gt=0, le=600,
        description="Seconds between decisions; default: the policy's own (fleet 5, kpa 2 = Knative's tick, "
        "keda-queue 15 = HPA's sync period, fixed 5).",
    )  # fmt: skip
    window_seconds: float = Field(
        30.0, ge=1, le=600, description="Window of the signals: queue time, percentiles, arrival rate (seconds)."
    )
    scale_up_stabilization_seconds: float = Field(
        0.0, ge=0, le=3600, description="A scale-up goes to the lowest recommendation of this window (HPA default 0)."
    )
    scale_down_stabilization_seconds: float = Field(
        300.0, ge=0, le=3600,
        description="A scale-down goes to the highest recommendation of this window (HPA default 300 s).",
    )  # fmt: skip
    max_scale_up_rate: float = Field(
        2.0, ge=1, le=1000,
        description="One decision at most multiplies the replicas by this or adds maxScaleUpStep, whichever "
        "allows more (HPA default scaleUp policies: 100 % or 4 pods).",
    )  # fmt: skip
    max_scale_up_step: int = Field(
        4, ge=1, le=10_000, description="Replicas one decision may add at least (see maxScaleUpRate)."
    )
    max_scale_down_rate: float = Field(
        2.0, gt=1, le=1000, description="One decision at most divides the replicas by this (Knative default 2)."
    )
    scale_down_below_fraction: float = Field(
        0.5, gt=0, lt=1,
        description="Hysteresis: scale down only while every signal is below this fraction of its target.",
    )  # fmt: skip
    trend_window_seconds: float = Field(
        60.0, ge=1, le=3600,
        description="Window of the linear trend that projects a signal to when a new replica would be ready.",
    )  # fmt: skip
    warm_startup_seconds: float = Field(
        60.0, gt=0, le=86_400,
        description="Initial estimate of placement-to-READY on a warm node (image and weights present); "
        "replaced by observed start-ups.",
    )  # fmt: skip
    cold_startup_seconds: float = Field(
        600.0, gt=0, le=86_400,
        description="Initial estimate of placement-to-READY on a cold node (a 4-GPU model load alone can take "
        "10 minutes, docs/anchors.md); replaced by observed start-ups.",
    )  # fmt: skip
    forecast: ForecastSpec | None = Field(
        None, description="Policy `standby`: scale ahead on a forecast of the arrival rate (off when absent)."
    )
    standby_pool: StandbyPoolSpec | None = Field(
        None, description="Policy `standby`: how its standby pool is sized (defaults of StandbyPoolSpec when absent)."
    )
    kpa: KpaSpec | None = Field(None, description="Parameters of policy `kpa`.")
    keda_queue: KedaQueueSpec | None = Field(None, description="Parameters of policy `keda-queue`.")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        return SCALING_POLICIES.check(v)

    cross_field_rules = (
        CrossFieldRule(
            cel="self.queueTimeTargetSeconds < self.ttftP99TargetSeconds",
            holds=lambda a: a.queue_time_target_seconds < a.ttft_p99_target_seconds,
            field="queueTimeTargetSeconds",
            message="must be < ttftP99TargetSeconds ({queueTimeTargetSeconds} >= {ttftP99TargetSeconds}): queue time "
            "is part of the time to first token",
            breaks=_scaling({"queueTimeTargetSeconds": 3, "ttftP99TargetSeconds": 2}),
            keeps=(_scaling({"queueTimeTargetSeconds": 1.5, "ttftP99TargetSeconds": 2}),),
        ),
        CrossFieldRule(
            cel="self.coldStartupSeconds >= self.warmStartupSeconds",
            holds=lambda a: a.cold_startup_seconds >= a.warm_startup_seconds,
            field="coldStartupSeconds",
            message="must be >= warmStartupSeconds ({coldStartupSeconds} < {warmStartupSeconds})",
            breaks=_scaling({"coldStartupSeconds": 10, "warmStartupSeconds": 60}),
            keeps=(_scaling({"coldStartupSeconds": 60, "warmStartupSeconds": 60}),),
        ),
        CrossFieldRule(
            cel="!has(self.intervalSeconds) || self.intervalSeconds <= self.windowSeconds",
            holds=lambda a: a.interval_seconds is None or a.interval_seconds <= a.window_seconds,
            field="intervalSeconds",
            message="must be <= windowSeconds ({intervalSeconds} > {windowSeconds}): each decision needs fresh samples",
            breaks=_scaling({"intervalSeconds": 60, "windowSeconds": 30}),
            keeps=(_scaling({"intervalSeconds": 30, "windowSeconds": 30}),),
        ),
        *(
            CrossFieldRule(
                cel=f"!has(self.{block}) || self.policy == '{policy}'",
                holds=lambda a, attr=attr, policy=policy: getattr(a, attr) is None or a.policy == policy,
                field=block, message=f"applies to policy {policy} only (policy is {{policy}})",
                breaks=_scaling({"policy": "fleet", block: {}}),
                keeps=(_scaling({"policy": policy, block: {}}), _scaling({"policy": "fleet", block: None})),
            )
            for block, attr, policy in (("kpa", "kpa", "kpa"), ("kedaQueue", "keda_queue", "keda-queue"),
                                        ("forecast", "forecast", "standby"),
                                        ("standbyPool", "standby_pool", "standby"))
        ),  # fmt: skip
    )

    @property
    def standby_pool_params(self) -> StandbyPoolSpec:
        return self.standby_pool or StandbyPoolSpec()

    @property
    def kpa_params(self) -> KpaSpec:
        return self.kpa or KpaSpec()

    @property
    def keda_params(self) -> KedaQueueSpec:
        return self.keda_queue or KedaQueueSpec()
