"""Canary analysis: verdicts pass / fail / inconclusive / error, relative and absolute limits, and
every check recording its value, limit and sample counts."""

from __future__ import annotations

import pytest

from fleet.rollout.analysis import SideSamples, Verdict, analyse
from fleet.rollout.spec import AnalysisSpec, MetricCheck

SPEC = AnalysisSpec(min_samples_per_side=20)


def side(ttft_s: float, tpot_s: float, n: int = 100, errors: int = 0, spread: float = 0.01) -> SideSamples:
    """n requests whose TTFT and TPOT spread evenly over [x, x * (1 + spread)]."""
    ttft = [ttft_s * (1 + spread * i / n) for i in range(n)]
    tpot = [tpot_s * (1 + spread * i / n) for i in range(n)]
    return SideSamples(ttft_s=ttft, tpot_s=tpot, e2e_s=[t + 0.5 for t in ttft], queue_time_s=[0.0] * n,
                       requests=n, errors=errors)


def test_an_identical_canary_passes_and_every_check_records_value_limit_and_samples():
    run = analyse(SPEC, side(0.2, 0.02), side(0.2, 0.02), 100.0, 160.0)
    assert run.verdict is Verdict.PASS
    assert [(c.metric, c.kind, c.verdict) for c in run.checks] == [
        ("ttftP99", "relative", Verdict.PASS), ("tpotP99", "relative", Verdict.PASS),
        ("tpotP50", "relative", Verdict.PASS), ("errorRate", "relative", Verdict.PASS)]
    ttft = run.checks[0]
    assert ttft.canary == pytest.approx(0.2 * (1 + 0.01 * 98 / 100))      # nearest-rank p99 of 100: the 99th
    assert ttft.limit == pytest.approx(ttft.stable * 1.2)
    assert (ttft.canary_samples, ttft.stable_samples) == (100, 100)
    d = run.to_dict()
    assert d["verdict"] == "pass" and d["checks"][0]["limit"] == ttft.limit and (d["from_s"], d["to_s"]) == (100, 160)


@pytest.mark.parametrize("canary, failing", [
    (side(0.26, 0.02), {"ttftP99"}),               # +30 % TTFT > 1.2x
    (side(0.2, 0.026), {"tpotP99", "tpotP50"}),    # +30 % TPOT > 1.1x
    (side(0.2, 0.02, errors=2), {"errorRate"}),    # 2 % errors > 0 % + 0.5 pp
])
def test_a_worse_canary_fails_on_the_metric_that_is_worse(canary, failing):
    run = analyse(SPEC, canary, side(0.2, 0.02), 0.0, 60.0)
    assert run.verdict is Verdict.FAIL
    assert {c.metric for c in run.checks if c.verdict is Verdict.FAIL} == failing
    assert all(m in run.summary() for m in failing)


def test_a_slightly_slower_canary_within_the_ratio_passes():
    assert analyse(SPEC, side(0.23, 0.021), side(0.2, 0.02), 0.0, 60.0).verdict is Verdict.PASS


def test_too_few_samples_on_either_side_is_inconclusive_never_a_pass_or_a_failure():
    slow_but_few = side(5.0, 0.5, n=19, errors=19)
    run = analyse(SPEC, slow_but_few, side(0.2, 0.02), 0.0, 60.0)
    assert run.verdict is Verdict.INCONCLUSIVE
    assert all(c.verdict is Verdict.INCONCLUSIVE and c.limit is None for c in run.checks)
    assert "too few samples (canary 19, stable 100; need 20 each)" in run.checks[0].reason
    assert analyse(SPEC, side(0.2, 0.02), side(0.2, 0.02, n=3), 0.0, 60.0).verdict is Verdict.INCONCLUSIVE
    assert analyse(SPEC, SideSamples(), SideSamples(), 0.0, 60.0).verdict is Verdict.INCONCLUSIVE


def test_an_unreadable_side_is_an_error_never_a_failure():
    run = analyse(SPEC, None, side(0.2, 0.02), 0.0, 60.0)
    assert run.verdict is Verdict.ERROR and "canary samples unavailable" in run.checks[0].reason
    assert analyse(SPEC, side(9.0, 0.02), None, 0.0, 60.0).verdict is Verdict.ERROR


def test_a_failure_outweighs_inconclusive_checks():
    canary = side(0.4, 0.02)
    canary.tpot_s = []                         # non-streamed replies only: no TPOT
    run = analyse(SPEC, canary, side(0.2, 0.02), 0.0, 60.0)
    assert run.verdict is Verdict.FAIL
    assert {c.metric: c.verdict for c in run.checks}["tpotP99"] is Verdict.INCONCLUSIVE


def test_absolute_limits_need_only_the_canary_side_and_combine_with_relative_ones():
    spec = AnalysisSpec(min_samples_per_side=20, metrics=[
        MetricCheck(metric="ttftP99", max_ratio_to_stable=1.2, max=0.25),
        MetricCheck(metric="e2eP99", max=1.0)])
    run = analyse(spec, side(0.3, 0.02), side(0.3, 0.02), 0.0, 60.0)   # as fast as stable, above 250 ms
    assert [(c.kind, c.verdict) for c in run.checks] == [
        ("relative", Verdict.PASS), ("absolute", Verdict.FAIL), ("absolute", Verdict.PASS)]
    only_absolute = AnalysisSpec(min_samples_per_side=20, metrics=[MetricCheck(metric="ttftP99", max=0.25)])
    assert analyse(only_absolute, side(0.2, 0.02), None, 0.0, 60.0).verdict is Verdict.PASS


def test_a_queue_time_of_zero_on_stable_uses_the_increase_as_a_floor():
    spec = AnalysisSpec(min_samples_per_side=20, metrics=[
        MetricCheck(metric="queueTimeP99", max_ratio_to_stable=1.5, max_increase_over_stable=0.25)])
    stable = side(0.2, 0.02)
    canary = side(0.2, 0.02)
    canary.queue_time_s = [0.1] * 100
    assert analyse(spec, canary, stable, 0.0, 60.0).verdict is Verdict.PASS
    canary.queue_time_s = [0.3] * 100
    assert analyse(spec, canary, stable, 0.0, 60.0).verdict is Verdict.FAIL


def test_an_inconclusive_run_says_what_it_waits_for_and_the_rate_that_fills_a_window():
    spec = AnalysisSpec(min_samples_per_side=50)
    run = analyse(spec, side(0.2, 0.02, n=12), side(0.2, 0.02, n=108), 0.0, 60.0)
    assert run.verdict is Verdict.INCONCLUSIVE
    said = run.summary(weight=10.0)
    assert said.startswith("inconclusive: canary has 12 of 50 samples in this 60 s window (0.20 req/s counted); "
                           "50 per window need 0.83 req/s to the canary, 8.3 req/s in all at weight 10 %"), said
    assert "streamed" in said
    short_stable = analyse(spec, side(0.2, 0.02, n=80), side(0.2, 0.02, n=30), 0.0, 30.0)
    assert "stable has 30 of 50 samples in this 30 s window (1.00 req/s counted)" in short_stable.summary(weight=50.0)
    assert "3.3 req/s in all at weight 50 %" in short_stable.summary(weight=50.0)
    assert run.shortfall() and not analyse(spec, side(0.2, 0.02), side(0.2, 0.02), 0.0, 60.0).shortfall()


@pytest.mark.parametrize("canary_ms, stable_ms, ratio", [(9.64, 8.0, 1.2), (9.6004, 8.0, 1.2), (20.05, 20.0, 1.0)])
def test_a_failed_check_prints_its_canary_value_apart_from_its_limit(canary_ms, stable_ms, ratio):
    spec = AnalysisSpec(min_samples_per_side=5, metrics=[MetricCheck(metric="tpotP99", max_ratio_to_stable=ratio)])
    run = analyse(spec, side(0.2, canary_ms / 1000, n=10, spread=0), side(0.2, stable_ms / 1000, n=10, spread=0),
                  0.0, 60.0)
    check = run.checks[0]
    assert check.verdict is Verdict.FAIL
    canary_text, limit_text = check.reason.split(": canary ")[1].split(" (")[0].split(" > limit ")
    assert canary_text != limit_text, check.reason
    assert float(canary_text.removesuffix(" ms")) > float(limit_text.removesuffix(" ms"))


def test_a_passing_check_keeps_one_decimal():
    spec = AnalysisSpec(min_samples_per_side=5, metrics=[MetricCheck(metric="tpotP99", max_ratio_to_stable=1.2)])
    run = analyse(spec, side(0.2, 0.00912, n=10, spread=0), side(0.2, 0.008, n=10, spread=0), 0.0, 60.0)
    assert run.checks[0].reason == "tpotP99: canary 9.1 ms <= limit 9.6 ms (stable 8.0 ms)"
