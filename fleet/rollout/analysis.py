"""Canary analysis: one run judges the canary's requests of a window against the stable
revision's requests of the same window.

Owns `SideSamples` (one revision's samples over a window), `Verdict`, `CheckResult` (one metric
check: values, limit, sample counts, verdict) and `AnalysisRun` (the run's checks and verdict),
and `analyse`, the pure function that makes a run. Called by `rollout.machine` users: the
controller (samples from the router's per-revision statistics) and the trace simulator (samples
from its request log) call the same function. No I/O, no clock: the caller passes ``now_s``.

Why relative: a streamed LLM reply's whole-request latency is mostly its output length, so an
absolute p99 threshold on it judges the prompt mix, not the canary. Canary and stable serve the
same mix at the same time (the split is per request), so comparing TTFT and TPOT quantiles side
by side cancels load and mix; absolute limits remain available per metric.

Verdicts: a check is inconclusive when either side has fewer than
``minSamplesPerSide`` samples of its metric (never a pass, never a failure) and an error when
a side's samples are unavailable (the signal could not be read; never a failure). A run fails
when any check fails; else it is an error when any check is; else inconclusive when any check
is; else it passes.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from fleet.rollout.spec import METRICS, AnalysisSpec, MetricCheck
from router.stats.windows import nearest_rank


class Verdict(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    INCONCLUSIVE = "inconclusive"
    ERROR = "error"


@dataclass
class SideSamples:
    """One revision's requests over an analysis window (seconds; counts).

    ``ttft_s``: time to first token of successful requests; ``tpot_s``: time per output token of
    streamed successful replies with at least two output tokens; ``e2e_s``: end-to-end of
    completed requests; ``queue_time_s``: router or engine queue time; ``requests``: requests
    that finished (successfully or not); ``errors``: those that failed (5xx, cut stream,
    unreachable).
    """

    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    queue_time_s: list[float] = field(default_factory=list)
    requests: int = 0
    errors: int = 0

    def value(self, metric: str) -> tuple[float | None, int]:
        """(the metric's value, the samples it rests on); value None with no samples."""
        attr, q = METRICS[metric]
        if q is None:
            return (self.errors / self.requests if self.requests else None), self.requests
        values = getattr(self, attr)
        if not values:
            return None, 0
        return nearest_rank(sorted(values), q), len(values)


@dataclass(frozen=True)
class CheckResult:
    """One check of one run. ``kind``: ``relative`` (against stable) or ``absolute`` (``max``)."""

    metric: str
    kind: str
    verdict: Verdict
    canary: float | None
    stable: float | None
    limit: float | None
    canary_samples: int
    stable_samples: int
    reason: str

    def to_dict(self) -> dict:
        return {"metric": self.metric, "kind": self.kind, "verdict": self.verdict.value, "canary": self.canary,
                "stable": self.stable, "limit": self.limit, "canary_samples": self.canary_samples,
                "stable_samples": self.stable_samples, "reason": self.reason}  # fmt: skip


@dataclass(frozen=True)
class AnalysisRun:
    """One analysis run over ``[from_s, to_s]`` (the caller's clock, seconds)."""

    from_s: float
    to_s: float
    verdict: Verdict
    checks: tuple[CheckResult, ...]

    def to_dict(self) -> dict:
        return {"from_s": self.from_s, "to_s": self.to_s, "verdict": self.verdict.value,
                "checks": [c.to_dict() for c in self.checks]}  # fmt: skip

    def summary(self) -> str:
        """One line for people: the verdict and each check that did not pass."""
        bad = [c for c in self.checks if c.verdict is not Verdict.PASS]
        return f"{self.verdict.value}" + (": " + "; ".join(c.reason for c in bad) if bad else "")


def _check(check: MetricCheck, canary: SideSamples | None, stable: SideSamples | None,
           min_samples: int) -> list[CheckResult]:  # fmt: skip
    m = check.metric
    kinds = (["relative"] if check.relative else []) + (["absolute"] if check.max is not None else [])
    if canary is None or (stable is None and check.relative):
        side = "canary" if canary is None else "stable"
        return [CheckResult(m, k, Verdict.ERROR, None, None, None, 0, 0, f"{m}: {side} samples unavailable")
                for k in kinds]  # fmt: skip
    c_value, c_n = canary.value(m)
    s_value, s_n = stable.value(m) if stable is not None else (None, 0)
    out = []
    for kind in kinds:
        short = c_n < min_samples or (kind == "relative" and s_n < min_samples)
        if short:
            out.append(CheckResult(m, kind, Verdict.INCONCLUSIVE, c_value, s_value, None, c_n, s_n,
                                   f"{m}: too few samples (canary {c_n}, stable {s_n}; need {min_samples} each)"))
            continue
        assert c_value is not None  # c_n >= min_samples >= 1
        if kind == "relative":
            assert s_value is not None
            limit = check.relative_limit(s_value)
            what = f"stable {_fmt(m, s_value)}"
        else:
            limit = float(check.max)  # type: ignore[arg-type]
            what = "absolute"
        ok = c_value <= limit or math.isclose(c_value, limit, rel_tol=1e-9, abs_tol=1e-12)
        verdict = Verdict.PASS if ok else Verdict.FAIL
        reason = f"{m}: canary {_fmt(m, c_value)} {'<=' if ok else '>'} limit {_fmt(m, limit)} ({what})"
        out.append(CheckResult(m, kind, verdict, c_value, s_value, limit, c_n, s_n, reason))
    return out


def _fmt(metric: str, value: float) -> str:
    return f"{value * 100:.2f} %" if metric == "errorRate" else f"{value * 1000:.1f} ms"


def analyse(spec: AnalysisSpec, canary: SideSamples | None, stable: SideSamples | None,
            from_s: float, to_s: float) -> AnalysisRun:  # fmt: skip
    """Judge ``canary`` against ``stable`` over the window ``[from_s, to_s]``.

    ``canary`` / ``stable``: the revisions' samples of the window, None when they could not be
    read (every check needing them is then an error). Returns the run with one `CheckResult`
    per relative and per absolute limit of each metric, and the run's verdict (module docstring).
    """
    checks: list[CheckResult] = []
    for check in spec.metrics:
        checks.extend(_check(check, canary, stable, spec.min_samples_per_side))
    verdicts = {c.verdict for c in checks}
    for v in (Verdict.FAIL, Verdict.ERROR, Verdict.INCONCLUSIVE):
        if v in verdicts:
            return AnalysisRun(from_s, to_s, v, tuple(checks))
    return AnalysisRun(from_s, to_s, Verdict.PASS, tuple(checks))
