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
    """One check of one run. ``kind``: ``relative`` (against stable) or ``absolute`` (``max``).
    Values and limit in seconds (a fraction for ``errorRate``); ``needed_samples``: the fewest
    samples per side the check counts with (``minSamplesPerSide``)."""

    metric: str
    kind: str
    verdict: Verdict
    canary: float | None
    stable: float | None
    limit: float | None
    canary_samples: int
    stable_samples: int
    reason: str
    needed_samples: int = 1   # ``minSamplesPerSide`` of the run

    def to_dict(self) -> dict:
        return {"metric": self.metric, "kind": self.kind, "verdict": self.verdict.value, "canary": self.canary,
                "stable": self.stable, "limit": self.limit, "canary_samples": self.canary_samples,
                "stable_samples": self.stable_samples, "reason": self.reason,
                "needed_samples": self.needed_samples}  # fmt: skip


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

    def summary(self, weight: float | None = None) -> str:
        """One line for people: the verdict and each check that did not pass; an inconclusive
        run says instead what it waits for (`shortfall`), with ``weight`` (the canary's percent)
        the rate the whole deployment needs too."""
        if self.verdict is Verdict.INCONCLUSIVE:
            return f"{self.verdict.value}: {self.shortfall(weight)}"
        bad = [c for c in self.checks if c.verdict is not Verdict.PASS]
        return f"{self.verdict.value}" + (": " + "; ".join(c.reason for c in bad) if bad else "")

    def shortfall(self, weight: float | None = None) -> str:
        """What an inconclusive run waits for: the side with the fewest samples, the rate they
        make over this window, and the rate that fills a window of the same length (e.g. "canary
        has 12 of 50 samples in this 60 s window (0.20 req/s counted); 50 per window need 0.83
        req/s to the canary, 8.3 req/s in all at weight 10 %"). Requests a replica served in its
        first ``excludeAfterReadySeconds`` are not counted, so a window that began with a
        replica's READY counts less than it received. Empty when no check is inconclusive."""
        short = [c for c in self.checks if c.verdict is Verdict.INCONCLUSIVE]
        if not short:
            return ""
        sides = [(c.canary_samples, "canary", c) for c in short]
        sides += [(c.stable_samples, "stable", c) for c in short if c.kind == "relative"]
        have, side, check = min(sides, key=lambda t: t[0] / t[2].needed_samples)
        need = check.needed_samples
        window_s = max(self.to_s - self.from_s, 1e-9)
        line = (f"{side} has {have} of {need} samples in this {window_s:.0f} s window ({have / window_s:.2f} req/s "
                f"counted); {need} per window need {need / window_s:.2f} req/s to the {side}")
        share = None if weight is None else (weight if side == "canary" else 100.0 - weight)
        if share:
            line += f", {need / window_s * 100.0 / share:.1f} req/s in all at weight {weight:g} %"
        return line + (" (streamed: TTFT and TPOT come from streamed replies)"
                       if check.metric.startswith(("ttft", "tpot")) else "")


def _check(check: MetricCheck, canary: SideSamples | None, stable: SideSamples | None,
           min_samples: int) -> list[CheckResult]:  # fmt: skip
    m = check.metric
    kinds = (["relative"] if check.relative else []) + (["absolute"] if check.max is not None else [])
    if canary is None or (stable is None and check.relative):
        side = "canary" if canary is None else "stable"
        return [CheckResult(m, k, Verdict.ERROR, None, None, None, 0, 0, f"{m}: {side} samples unavailable",
                            min_samples) for k in kinds]  # fmt: skip
    c_value, c_n = canary.value(m)
    s_value, s_n = stable.value(m) if stable is not None else (None, 0)
    out = []
    for kind in kinds:
        short = c_n < min_samples or (kind == "relative" and s_n < min_samples)
        if short:
            out.append(CheckResult(m, kind, Verdict.INCONCLUSIVE, c_value, s_value, None, c_n, s_n,
                                   f"{m}: too few samples (canary {c_n}, stable {s_n}; need {min_samples} each)",
                                   min_samples))
            continue
        assert c_value is not None and (s_value is not None or kind == "absolute")  # n >= min_samples >= 1
        limit = check.relative_limit(s_value) if kind == "relative" else float(check.max)  # type: ignore[arg-type]
        ok = c_value <= limit or math.isclose(c_value, limit, rel_tol=1e-9, abs_tol=1e-12)
        digits = _digits(m, c_value, limit, ok)
        what = f"stable {_fmt(m, s_value, digits)}" if kind == "relative" else "absolute"
        reason = (f"{m}: canary {_fmt(m, c_value, digits)} {'<=' if ok else '>'} limit {_fmt(m, limit, digits)} "
                  f"({what})")
        out.append(CheckResult(m, kind, Verdict.PASS if ok else Verdict.FAIL, c_value, s_value, limit, c_n, s_n,
                               reason, min_samples))  # fmt: skip
    return out


def _fmt(metric: str, value: float | None, digits: int) -> str:
    """Milliseconds (a percent for errorRate) with ``digits`` decimals."""
    if value is None:
        return "?"
    return f"{value * 100:.{digits + 1}f} %" if metric == "errorRate" else f"{value * 1000:.{digits}f} ms"


def _digits(metric: str, canary: float, limit: float, ok: bool) -> int:
    """Decimals that show the comparison the check made: one, or as many more (up to six) as it
    takes for a canary above its limit not to print equal to it ("9.6 ms > limit 9.6 ms")."""
    digits = 1
    while not ok and digits < 6 and _fmt(metric, canary, digits) == _fmt(metric, limit, digits):
        digits += 1
    return digits


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
