"""Judges of an analysis run, by name: Fleet's analysis and the two baselines the trace simulator
compares it with. Every judge returns a `rollout.analysis.AnalysisRun`, which the same
`rollout.machine.CanaryMachine` takes (steps, failure limit, promote or roll back): only the
judgement differs.

Owns `Judge` (base class; subclasses register with ``name=...``), `judge_names`, `make_judge`,
and the judges:

- ``fleet``: `rollout.analysis.analyse` (canary against stable, per metric, with minimum samples
  per side; no data is inconclusive, an unreadable signal an error).
- ``abs-p99``: what Argo Rollouts / Flagger analyses usually check (Flagger's built-in
  `request-duration` metric: p99 of whole-request duration under a fixed ``thresholdRange.max``):
  the canary's whole-request (end-to-end) p99 at most ``threshold_s``; a window without canary
  requests passes (the common `len(result) == 0 || result[0] <= X` success condition).
- ``success-rate``: Flagger's built-in `request-success-rate` (``thresholdRange.min: 99``): at
  least 99 % of the canary's requests succeed; a window without canary requests fails (Flagger
  halts with "no values found" and counts the check as failed).

Pure: no I/O, no clock. Called by `fleet.tracesim.rollout`.
"""

from __future__ import annotations

from fleet.rollout.analysis import AnalysisRun, CheckResult, SideSamples, Verdict, analyse
from fleet.rollout.spec import AnalysisSpec
from fleet.base.registry import Registered, Registry
from router.stats.windows import nearest_rank

JUDGES: Registry[Judge] = Registry("judge")
"""The judges by name (`fleet.base.registry`)."""


class Judge(Registered, registry=JUDGES):
    """Judges one window: ``judge(canary, stable, from_s, to_s) -> AnalysisRun``. Subclasses
    register with ``name=...`` (`fleet.base.registry`)."""

    def __init__(self, spec: AnalysisSpec, threshold_s: float | None = None) -> None:
        self.spec = spec
        self.threshold_s = threshold_s

    def judge(self, canary: SideSamples | None, stable: SideSamples | None, from_s: float,
              to_s: float) -> AnalysisRun:  # fmt: skip
        raise NotImplementedError


def judge_names() -> list[str]:
    """Names of the registered judges, sorted."""
    return JUDGES.names()


def make_judge(name: str, spec: AnalysisSpec, threshold_s: float | None = None) -> Judge:
    """A judge by name. Raises KeyError listing the known names."""
    return JUDGES.get(name)(spec, threshold_s)


def _run(from_s: float, to_s: float, check: CheckResult) -> AnalysisRun:
    return AnalysisRun(from_s, to_s, check.verdict, (check,))


class FleetJudge(Judge, name="fleet"):
    def judge(self, canary, stable, from_s, to_s):
        return analyse(self.spec, canary, stable, from_s, to_s)


class AbsoluteP99(Judge, name="abs-p99"):
    def judge(self, canary, stable, from_s, to_s):
        if self.threshold_s is None:
            raise ValueError("abs-p99 needs threshold_s")
        values = canary.e2e_s if canary is not None else []
        if not values:
            return _run(from_s, to_s, CheckResult("e2eP99", "absolute", Verdict.PASS, None, None, self.threshold_s,
                                                  0, 0, "no canary requests: no data passes"))  # fmt: skip
        p99 = nearest_rank(sorted(values), 0.99)
        ok = p99 <= self.threshold_s
        return _run(from_s, to_s, CheckResult(
            "e2eP99", "absolute", Verdict.PASS if ok else Verdict.FAIL, p99, None, self.threshold_s, len(values), 0,
            f"e2eP99: canary {p99 * 1000:.0f} ms {'<=' if ok else '>'} {self.threshold_s * 1000:.0f} ms"))


class SuccessRate(Judge, name="success-rate"):
    MIN_SUCCESS = 0.99

    def judge(self, canary, stable, from_s, to_s):
        n = canary.requests if canary is not None else 0
        if n == 0:
            return _run(from_s, to_s, CheckResult("successRate", "absolute", Verdict.FAIL, None, None,
                                                  self.MIN_SUCCESS, 0, 0, "no values found: counted as failed"))
        rate = 1.0 - canary.errors / n  # type: ignore[union-attr]
        ok = rate >= self.MIN_SUCCESS
        return _run(from_s, to_s, CheckResult(
            "successRate", "absolute", Verdict.PASS if ok else Verdict.FAIL, rate, None, self.MIN_SUCCESS, n, 0,
            f"successRate: canary {rate * 100:.2f} % {'>=' if ok else '<'} 99 %"))
