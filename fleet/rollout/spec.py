"""The `spec.rollout` section of a deployment: how a new revision reaches users.

Owns `RolloutSpec` (strategy, steps, analysis, stickiness) and its parts: `RolloutStep` (one of
`{weight: 5}`, `{pauseSeconds: 120}`, `{analysis: {}}`), `AnalysisSpec` (interval, minimum
samples per side, the metric checks, failure and inconclusive limits), `MetricCheck` (one metric
compared with stable and/or an absolute limit) and `StickinessSpec` (which request key keeps a
user on one revision). Included by `fleet.spec.DeploymentSpec`; read by `rollout.analysis`,
`rollout.machine`, the controller and the trace simulator.

A new revision starts when what a replica serves changes (`fleet.spec.LoadedDeployment.serving_hash`:
the model's source and revision, the engine's image, args and env, the replica's shape). With
`strategy: replace` (the default) old replicas are replaced at once; with `strategy: canary` the
new revision takes traffic step by step and is analysed against the stable revision before it
is promoted (a final weight of 100 is implied after the last step).

Defaults and their sources: an analysis every 60 s over at least 50 requests per side; canary
p99 TTFT <= 1.2 x stable, p99 TPOT <= 1.1 x stable, error rate <= stable + 0.5 percentage
points (the limits Fleet's rollout requirements set), and median TPOT <= 1.1 x stable
(a slower decode shifts every request's TPOT; the median shows it with far fewer samples than
the p99, which over a minute's requests is close to their maximum: the trace simulator's
+30 % TPOT canary passed the p99 check alone, docs/benchmarks.md "Canary rollouts in the trace
simulator"); one failed run is tolerated
(Argo Rollouts' `failureLimit` counts the same way: the rollout aborts when failures exceed it).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fleet.base.rules import CrossFieldRule
from fleet.base.spec import SpecModel

METRICS: dict[str, tuple[str, float | None]] = {
    "ttftP50": ("ttft_s", 0.50),
    "ttftP99": ("ttft_s", 0.99),
    "tpotP50": ("tpot_s", 0.50),
    "tpotP99": ("tpot_s", 0.99),
    "e2eP99": ("e2e_s", 0.99),
    "queueTimeP99": ("queue_time_s", 0.99),
    "errorRate": ("errors", None),
}
"""Metric name -> (the samples it reads in `rollout.analysis.SideSamples`, the quantile; None:
a rate). TTFT is arrival at the router until the first token; TPOT is (last token - first token)
/ (output tokens - 1) of a streamed reply; e2e is arrival until the last byte; the error rate is
failed requests / requests (a fraction: 0.005 is 0.5 percentage points)."""

def _canary(**rollout: object) -> dict:
    """A valid canary rollout section with ``rollout`` set in it (the rules' examples)."""
    return {"strategy": "canary", "steps": [{"weight": 10}], **rollout}


MetricName = Literal["ttftP50", "ttftP99", "tpotP50", "tpotP99", "e2eP99", "queueTimeP99", "errorRate"]


class MetricCheck(SpecModel):
    """One metric of the canary judged against the stable revision and/or an absolute limit.

    Relative limit: ``stable x maxRatioToStable``, ``stable + maxIncreaseOverStable``, or with
    both the larger of the two (the increase is then a noise floor for small values, e.g. a
    queue time of 0 s on stable). Absolute limit: ``max``. Values and limits are in seconds for
    latencies, a fraction for ``errorRate``.
    """

    metric: MetricName = Field(..., description=f"What is compared: one of {', '.join(METRICS)}.")
    max_ratio_to_stable: float | None = Field(
        None, gt=0, le=100, description="Canary value at most stable value x this (e.g. 1.2)."
    )
    max_increase_over_stable: float | None = Field(
        None, ge=0, description="Canary value at most stable value + this (seconds; a fraction for errorRate)."
    )
    max: float | None = Field(None, ge=0, description="Absolute limit on the canary's value (seconds or fraction).")

    cross_field_rules = (
        CrossFieldRule(
            cel="has(self.maxRatioToStable) || has(self.maxIncreaseOverStable) || has(self.max)",
            holds=lambda m: m.max_ratio_to_stable is not None or m.max_increase_over_stable is not None
            or m.max is not None,
            field="metric", message="{metric}: set maxRatioToStable, maxIncreaseOverStable and/or max",
            breaks={"rollout": _canary(analysis={"metrics": [{"metric": "ttftP99"}]})},
            keeps=({"rollout": _canary(analysis={"metrics": [{"metric": "ttftP99", "max": 2}]})},),
        ),
        CrossFieldRule(
            cel="self.metric != 'errorRate' || !has(self.max) || self.max <= 1",
            holds=lambda m: m.metric != "errorRate" or m.max is None or m.max <= 1,
            field="max", message="errorRate is a fraction (0.01 = 1 %), got {max}",
            breaks={"rollout": _canary(analysis={"metrics": [{"metric": "errorRate", "max": 5}]})},
            keeps=({"rollout": _canary(analysis={"metrics": [{"metric": "errorRate", "max": 1}]})},),
        ),
    )

    @property
    def relative(self) -> bool:
        return self.max_ratio_to_stable is not None or self.max_increase_over_stable is not None

    def relative_limit(self, stable: float) -> float:
        """The limit on the canary given the stable value (see the class docstring)."""
        limits = []
        if self.max_ratio_to_stable is not None:
            limits.append(stable * self.max_ratio_to_stable)
        if self.max_increase_over_stable is not None:
            limits.append(stable + self.max_increase_over_stable)
        return max(limits)


def default_checks() -> list[MetricCheck]:
    return [
        MetricCheck(metric="ttftP99", max_ratio_to_stable=1.2),
        MetricCheck(metric="tpotP99", max_ratio_to_stable=1.1),
        MetricCheck(metric="tpotP50", max_ratio_to_stable=1.1),
        MetricCheck(metric="errorRate", max_increase_over_stable=0.005),
    ]


class AnalysisSpec(SpecModel):
    """How the canary is judged: every ``intervalSeconds`` one analysis run over the requests of
    that interval, each metric check giving pass, fail or inconclusive (too few samples)."""

    interval_seconds: float = Field(60.0, gt=0, le=86_400, description="Seconds between analysis runs (the window).")
    min_samples_per_side: int = Field(
        50, ge=1, le=1_000_000,
        description="Fewest samples of a metric on each side (canary and stable) for a check to count; "
        "fewer make the check inconclusive, never a pass and never a failure.",
    )  # fmt: skip
    exclude_after_ready_seconds: float = Field(
        30.0, ge=0, le=3600,
        description="Requests a replica served in its first seconds after READY are left out (caches cold).",
    )  # fmt: skip
    metrics: list[MetricCheck] = Field(default_factory=default_checks, min_length=1,
                                       description="The checks of each analysis run.")  # fmt: skip
    failure_limit: int = Field(
        1, ge=0, le=1000, description="Failed runs tolerated; one more rolls the canary back (Argo's failureLimit)."
    )
    inconclusive_limit: int | None = Field(
        None, ge=1, le=100_000,
        description="Inconclusive runs in a row after which the canary is rolled back; unset: hold (never promote "
        "without a pass, never roll back for lack of data).",
    )  # fmt: skip


class StepAnalysis(SpecModel):
    passes: int = Field(1, ge=1, le=1000, description="Passing analysis runs this step needs before the next step.")


class RolloutStep(SpecModel):
    """Exactly one of ``weight`` (percent of requests to the canary from now on), ``pauseSeconds``
    (wait; analysis goes on) or ``analysis`` (wait for passing analysis runs)."""

    weight: float | None = Field(None, gt=0, lt=100, description="Canary share of requests, percent (0 < w < 100).")
    pause_seconds: float | None = Field(None, gt=0, le=7 * 86_400, description="Seconds to wait at this step.")
    analysis: StepAnalysis | None = Field(None, description="Wait here until the analysis passes.")

    cross_field_rules = (
        CrossFieldRule(
            cel="(has(self.weight) ? 1 : 0) + (has(self.pauseSeconds) ? 1 : 0) + (has(self.analysis) ? 1 : 0) == 1",
            holds=lambda s: [s.weight, s.pause_seconds, s.analysis].count(None) == 2,
            field="", message="a step has exactly one of weight, pauseSeconds, analysis",
            breaks={"rollout": _canary(steps=[{"weight": 5, "pauseSeconds": 3}])},
            keeps=({"rollout": _canary(steps=[{"weight": 5}, {"pauseSeconds": 3}, {"analysis": {}}])},),
        ),
    )

    @property
    def kind(self) -> str:
        return "weight" if self.weight is not None else "pause" if self.pause_seconds is not None else "analysis"


class StickinessSpec(SpecModel):
    """Which request key keeps one user on one revision while the weights do not change: a
    header (e.g. ``x-session-id``) or the OpenAI request body's ``user`` field."""

    header: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9-]+$",
                               description="Header whose value is the key (case-insensitive).")  # fmt: skip
    request_field: Literal["user"] | None = Field(None, description="Body field whose value is the key: `user`.")

    cross_field_rules = (
        CrossFieldRule(
            cel="has(self.header) != has(self.requestField)",
            holds=lambda s: (s.header is None) != (s.request_field is None),
            field="header", message="set exactly one of header and requestField",
            breaks={"rollout": _canary(stickiness={})},
            keeps=({"rollout": _canary(stickiness={"header": "x-session-id"})},),
        ),
    )


class RolloutSpec(SpecModel):
    strategy: Literal["replace", "canary"] = Field(
        "replace", description="`replace`: all at once; `canary`: weighted steps judged by analysis."
    )
    steps: list[RolloutStep] = Field(default_factory=list, description="Canary steps; a final weight 100 is implied.")
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec, description="How analysis runs judge the canary.")
    stickiness: StickinessSpec | None = Field(None, description="Keep one user on one revision.")
    surge: bool = Field(
        True, description="Start canary replicas beside the stable ones (default: no capacity is lost) or, with "
        "false, in their place (for a machine or cluster without room for more: a stable replica drains first).",
    )

    cross_field_rules = (
        CrossFieldRule(
            cel="self.strategy != 'replace' || !has(self.steps) || size(self.steps) == 0",
            holds=lambda r: r.strategy != "replace" or not r.steps,
            field="steps", message="only with strategy: canary (strategy is replace)",
            breaks={"rollout": {"strategy": "replace", "steps": [{"weight": 5}]}},
            keeps=({"rollout": {"strategy": "replace", "steps": []}}, {"rollout": {"strategy": "replace"}}),
        ),
        CrossFieldRule(
            cel="self.strategy != 'canary' || (has(self.steps) && size(self.steps) > 0)",
            holds=lambda r: r.strategy != "canary" or bool(r.steps),
            field="steps", message="required with strategy: canary, e.g. [{weight: 10}, {analysis: {}}]",
            breaks={"rollout": {"strategy": "canary"}}, keeps=({"rollout": _canary()}, {"rollout": {}}),
        ),
        CrossFieldRule(
            cel="self.strategy != 'canary' || !has(self.steps) || size(self.steps) == 0 || has(self.steps[0].weight)",
            holds=lambda r: r.strategy != "canary" or not r.steps or r.steps[0].weight is not None,
            field="steps", message="the first step must set a weight (the canary has none before it)",
            breaks={"rollout": {"strategy": "canary", "steps": [{"pauseSeconds": 10}]}},
            keeps=({"rollout": {"strategy": "canary", "steps": [{"weight": 10}, {"pauseSeconds": 10}]}},),
        ),
    )
