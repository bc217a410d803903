"""The arrival-rate forecast (autoscaler/forecast.py): binning, the out-of-sample error check
that gates trust, the cost of a refit, priming from history; and how `standby` scales ahead on
it (autoscaler/standby.py). statsmodels fits a real Holt-Winters model here: small series, fast."""

from __future__ import annotations

import math
import time

import pytest

from autoscaler.forecast import ArrivalForecaster, rate_bins
from autoscaler.policy import ReplicaBounds, ScalingContext, make_policy
from autoscaler.signals import Signals
from autoscaler.spec import AutoscalingSpec, ForecastSpec
from autoscaler.standby import StandbyPolicy
from autoscaler.startup import StartupEstimate

pytest.importorskip("statsmodels")

BIN_S = 600.0
SEASON = 24                       # a "day" of 24 bins of 10 minutes: small series, fast fits
DAY_S = BIN_S * SEASON


def daily(t_s: float) -> float:
    """A smooth daily rate (requests/s) between 1 and 3."""
    return 2.0 + math.sin(2 * math.pi * t_s / DAY_S)


def spec(**kw: object) -> ForecastSpec:
    base = {"bin_seconds": BIN_S, "season_bins": SEASON, "refit_seconds": BIN_S, "validation_bins": 4,
            "max_mape": 0.2, "statistic": "mean"}  # fmt: skip
    return ForecastSpec(**{**base, **kw})  # type: ignore[arg-type]


def primed(rate=daily, days: int = 2, **kw: object) -> ArrivalForecaster:
    f = ArrivalForecaster(spec(**kw))
    f.prime([(t, rate(t)) for t in (-days * DAY_S + i * BIN_S for i in range(days * SEASON))])
    return f


def feed(f: ArrivalForecaster, rate, start_s: float, end_s: float, step_s: float = 60.0) -> None:
    t = start_s
    while t < end_s:
        f.observe(t, rate(t))
        t += step_s


def test_no_fit_before_two_seasons_and_not_trusted() -> None:
    f = primed(days=1)
    feed(f, daily, 0.0, 2 * BIN_S)
    assert f.fits == 0 and not f.trusted and "two seasons" in f.status
    assert f.peak_ahead(2 * BIN_S, 60.0) is None


def test_trusted_only_after_a_whole_validation_window_scored_out_of_sample() -> None:
    f = primed()
    feed(f, daily, 0.0, 3 * BIN_S)            # 3 bins scored: one short of the window
    assert f.fits >= 1 and not f.trusted
    feed(f, daily, 3 * BIN_S, 6 * BIN_S)
    assert f.trusted and f.mape is not None and f.mape < 0.05
    peak = f.peak_ahead(6 * BIN_S, BIN_S)
    assert peak == pytest.approx(max(daily(6 * BIN_S), daily(7 * BIN_S)), rel=0.1)


def test_the_upper_bound_is_the_point_times_the_worst_shortfall_scored() -> None:
    f = primed()
    feed(f, lambda t: 1.15 * daily(t), 0.0, 6 * BIN_S)   # 15 % busier than the days it learned from
    assert f.trusted and f.upper_factor > 1.1            # every bin scored came in above its forecast
    point, upper = f.peak_ahead(6 * BIN_S, BIN_S), f.peak_ahead(6 * BIN_S, BIN_S, upper=True)
    assert point is not None and upper == pytest.approx(point * f.upper_factor)
    assert point < upper and upper >= 0.98 * max(1.15 * daily(6 * BIN_S), 1.15 * daily(7 * BIN_S))  # covers it
    over = primed()
    feed(over, lambda t: 0.9 * daily(t), 0.0, 6 * BIN_S)  # over-forecast only: the bound is the point
    assert over.trusted and over.upper_factor == 1.0
    far = ArrivalForecaster(spec())
    far._errors.extend([0.95, 0.0])                        # a bin at 20x its forecast: capped
    assert far.upper_factor == 2.0


def test_a_forecast_that_misses_is_not_trusted() -> None:
    f = primed()
    feed(f, lambda t: 3 * daily(t), 0.0, 6 * BIN_S)   # the traffic tripled: the old shape misses by ~67 %
    assert f.mape is not None and f.mape > 0.2
    assert not f.trusted and f.peak_ahead(6 * BIN_S, 60.0) is None


def test_quiet_bins_are_not_scored() -> None:
    f = primed(rate=lambda t: 0.0 if (t // BIN_S) % 2 else daily(t))
    feed(f, lambda t: 0.0, 0.0, 6 * BIN_S)
    assert f.mape is None and not f.trusted


def test_a_refit_is_cheap_and_decisions_between_refits_cost_nothing() -> None:
    f = primed(days=3)
    started = time.perf_counter()
    feed(f, daily, 0.0, 4 * BIN_S, step_s=5.0)        # 480 decisions, 4 refits and the first one's backtest
    assert f.fits == 5
    assert time.perf_counter() - started < 5.0


def test_the_peak_statistic_forecasts_the_busiest_window_of_each_bin() -> None:
    f = primed(statistic="peak")
    feed(f, lambda t: 4.0 if t % BIN_S < 30 else daily(t), 0.0, 6 * BIN_S)   # a 30 s burst at 4 req/s each bin
    assert f._bins[0] == [4.0, 1.0] and f.mape is not None
    assert f.mape > 0.2  # primed without bursts, the forecast misses them: not trusted
    assert not f.trusted


def test_rate_bins_counts_arrivals_with_empty_bins() -> None:
    assert rate_bins([0.5, 1.0, 250.0], 100.0, -300.0) == [(-300.0, 0.02), (-200.0, 0.0), (-100.0, 0.01)]
    assert rate_bins([], 100.0, 0.0) == []


def test_the_forecast_block_belongs_to_standby() -> None:
    with pytest.raises(ValueError, match="applies to policy standby only"):
        AutoscalingSpec(policy="fleet", forecast=ForecastSpec())
    assert AutoscalingSpec(policy="standby", forecast={"binSeconds": 600}).forecast.bin_seconds == 600  # type: ignore[union-attr,arg-type]


def _ctx(now_s: float, desired: int, rate: float) -> ScalingContext:
    s = Signals(at_s=now_s, window_s=30.0, arrival_rate_per_s=rate, router_queue_time_mean_s=0.01,
                ttft_p99_s=None, in_flight=1, e2e_mean_s=1.0)  # fmt: skip
    return ScalingContext(now_s, desired, desired, 0, s, StartupEstimate(60.0, 600.0), 0)


def test_standby_scales_ahead_on_a_trusted_forecast_and_holds_a_scale_down_at_it() -> None:
    policy = make_policy(AutoscalingSpec(policy="standby", forecast=spec()), ReplicaBounds(1, 16, 1))
    assert isinstance(policy, StandbyPolicy)
    policy.prime([(t, 1.0) for t in (-2 * DAY_S + i * BIN_S for i in range(2 * SEASON))])
    t = 0.0
    while t < 6 * BIN_S:                      # a steady 1 req/s on one replica, well within target
        d = policy.decide(_ctx(t, 1, 1.0))
        t += 5.0
    assert d.desired == 1 and policy.forecaster is not None and policy.forecaster.trusted
    need, why = policy.forecast_need(_ctx(t, 1, 1.0))
    assert need == 1 and "needs 1" in why
    # The forecast now says 3 req/s ahead: at the 1 req/s per replica confirmed, it needs 3.
    policy.forecaster._forecast = {b: 3.0 for b in range(int(t // BIN_S), int(t // BIN_S) + 3)}
    up = policy.decide(_ctx(t + 5.0, 1, 1.0))
    assert (up.desired, up.reason) == (3, "forecast_ahead") and up.inputs["forecast_need"] == 3
    hold = policy.decide(_ctx(t + 10.0, 3, 0.0))  # no load now: the forecast still holds 3
    assert hold.desired == 3


def test_without_a_forecast_block_standby_never_scales_ahead() -> None:
    policy = make_policy(AutoscalingSpec(policy="standby"), ReplicaBounds(1, 16, 1))
    assert isinstance(policy, StandbyPolicy) and policy.forecaster is None
    assert policy.forecast_need(_ctx(0.0, 1, 5.0)) == (None, "forecast off")


def test_a_primed_start_with_history_enough_is_scored_on_a_backtest_at_once() -> None:
    f = primed(days=3)
    f.observe(0.0, daily(0.0))
    assert f.fits == 2 and f.trusted and f.mape is not None and f.mape < 0.05
    missed = primed(rate=lambda t: daily(t) if t < -4 * BIN_S else 3 * daily(t), days=3)
    missed.observe(0.0, 3 * daily(0.0))
    assert not missed.trusted     # the history's last bins tripled: the backtest misses them


def test_a_deferred_refit_waits_as_a_job_and_the_last_model_forecasts_until_it_is_installed() -> None:
    f = primed(days=3)
    f.defer_fits = True
    f.observe(0.0, daily(0.0))
    assert f.fits == 0 and not f.trusted          # nothing fitted inside observe
    job = f.take_fit()
    assert job is not None and f.take_fit() is None and job.backtest
    f.install(job.run())                          # what the controller does after a worker thread ran it
    assert f.fits == 2 and f.trusted
    before = f.peak_ahead(60.0, 60.0)
    f.observe(BIN_S + 1, daily(BIN_S + 1))        # a refit falls due: deferred, the model in use stays
    assert f.pending is not None and f.peak_ahead(60.0, 60.0) == before


def test_standby_hands_its_deferred_refit_to_the_caller() -> None:
    policy = make_policy(AutoscalingSpec(policy="standby", forecast=spec()), ReplicaBounds(1, 16, 2))
    assert isinstance(policy, StandbyPolicy) and policy.forecaster is not None
    policy.prime([(t, daily(t)) for t in (-3 * DAY_S + i * BIN_S for i in range(3 * SEASON))])
    policy.defer_work = True
    s = Signals(at_s=0.0, window_s=30.0, router_queue_time_mean_s=0.1, arrival_rate_per_s=daily(0.0))
    policy.decide(ScalingContext(0.0, 2, 2, 0, s, StartupEstimate(60.0, 600.0)))
    work = policy.take_background()
    assert work is not None and policy.forecaster.fits == 0 and policy.take_background() is None
    work()()                                      # run (a thread in the controller), then apply
    assert policy.forecaster.fits == 2
