"""The synthetic daily-cycle trace (loadtests/daily_trace.py): the assumed shape's range and peak,
a real trace's minutes resampled with their sizes, and the same seed giving the same days."""

from __future__ import annotations

import pytest

from fleet.tracesim.traces import Trace, TraceRequest
from loadtests.daily_trace import DAY_S, MINUTE_S, PEAK_HOUR, TROUGH_FRACTION, daily_shape, make_days


def test_the_shape_spans_trough_to_peak_and_peaks_at_the_peak_hour() -> None:
    values = [daily_shape(m * MINUTE_S) for m in range(1440)]
    assert min(values) == pytest.approx(TROUGH_FRACTION) and max(values) == pytest.approx(1.0)
    assert daily_shape(PEAK_HOUR * 3600) == pytest.approx(1.0)
    assert daily_shape(4 * 3600) < 0.35


def source() -> Trace:
    # three minutes: a burst of 60 requests in the first 2 s of minute 0, idle minute 1, 30 spread in minute 2
    reqs = [TraceRequest(i * 2 / 60, 1000 + i, 10) for i in range(60)]
    reqs += [TraceRequest(120 + i * 2, 500, 5) for i in range(30)]
    reqs.append(TraceRequest(185.0, 1, 1))
    return Trace("src", tuple(reqs))


def test_days_resample_real_minutes_thinned_by_the_shape_and_are_reproducible() -> None:
    days = make_days(source(), 2, seed=3)
    assert [len(d.requests) for d in days] == [len(d.requests) for d in make_days(source(), 2, seed=3)]
    assert days[0].requests != days[1].requests
    sizes = {(r.prompt_tokens, r.output_tokens) for r in source().requests}
    for day in days:
        assert all(0 <= r.arrival_s < DAY_S and (r.prompt_tokens, r.output_tokens) in sizes for r in day.requests)
        night = sum(1 for r in day.requests if 3 * 3600 <= r.arrival_s < 5 * 3600)
        noon = sum(1 for r in day.requests if 13 * 3600 <= r.arrival_s < 15 * 3600)
        assert noon > 2 * night      # the daily cycle shows
    # a burst minute stays a burst: every request of minute 0's copy falls in its first 2 s
    burst = [r.arrival_s % MINUTE_S for r in days[0].requests if r.prompt_tokens >= 1000]
    assert burst and max(burst) < 2.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="days"):
        make_days(source(), 0, seed=1)
    with pytest.raises(ValueError, match="shorter than a minute"):
        make_days(Trace("x", (TraceRequest(0.0, 1, 1),)), 1, seed=1)


def test_history_rates_lay_traces_back_to_back_before_zero_as_windowed_rates() -> None:
    from fleet.tracesim.workload import history_rates

    one = Trace("a", (TraceRequest(0.0, 1, 1), TraceRequest(12.0, 1, 1)))
    rates = history_rates([one, one], bin_s=5.0, window_s=10.0)
    assert len(rates) == 2 * 720 and rates[0][0] == -7200.0 and rates[-1][0] == -5.0   # an hour each
    assert [r for _, r in rates[:4]] == [0.1, 0.1, 0.1, 0.1]     # (t, 1 in the 10 s window / 10 s)
    assert [r for _, r in rates[720:722]] == [0.1, 0.1]          # the second trace starts at -3600
