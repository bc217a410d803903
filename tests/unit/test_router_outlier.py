"""Outlier ejection (router.pools.outlier) and the first-token deadline (router.request.deadline) on fake time,
and how `router.pools.pool.Pool.pick` leaves ejected endpoints out."""

from __future__ import annotations

import pytest

from router.request.deadline import FirstTokenBudget, first_token_timeout_s
from router.pools.endpoint import EndpointState
from router.pools.outlier import OutlierDetector, OutlierSettings, Outcome
from router.pools.policies import make_policy
from router.pools.pool import Pool
from router.kv.prompt_blocks import RouteRequest


def endpoints(n: int) -> list[EndpointState]:
    return [EndpointState(f"e{i}", f"http://127.0.0.1:{9000 + i}") for i in range(n)]


# --- the policy ---------------------------------------------------------------------------


def test_consecutive_stalls_eject_for_base_time_and_a_success_resets_the_run() -> None:
    detector = OutlierDetector(OutlierSettings(consecutive_stalls=2, base_ejection_time_s=30.0))
    a, b = ready = endpoints(2)
    assert not detector.record(a, Outcome.STALL, 0.0, ready)
    assert not detector.record(a, Outcome.SUCCESS, 1.0, ready)   # the run is broken
    assert not detector.record(a, Outcome.STALL, 2.0, ready)
    assert detector.record(a, Outcome.STALL, 3.0, ready)
    assert a.ejected_until_s == a.outlier.ejected_until_s == 33.0
    assert a.outlier.reason == "stall" and a.outlier.ejections_total == 1 and a.outlier.stalls_total == 3
    assert a.outlier.snapshot(13.0)["ejected_for_s"] == 20.0
    assert not OutlierDetector.release(a, 32.9)
    assert OutlierDetector.release(a, 33.0)
    assert a.ejected_until_s == 0.0 and not a.outlier.ejected(33.0) and b.ejected_until_s == 0.0


def test_envoy_defaults_five_consecutive_5xx_or_gateway_failures() -> None:
    settings = OutlierSettings()
    assert (settings.consecutive_5xx, settings.consecutive_gateway_failure, settings.base_ejection_time_s,
            settings.interval_s, settings.max_ejection_time_s) == (5, 5, 30.0, 10.0, 300.0)  # fmt: skip
    detector = OutlierDetector(settings)
    a, b, c = ready = endpoints(3)
    for t in range(4):
        assert not detector.record(a, Outcome.SERVER_ERROR, float(t), ready)
        assert not detector.record(b, Outcome.GATEWAY_FAILURE, float(t), ready)
    assert detector.record(a, Outcome.SERVER_ERROR, 4.0, ready)
    assert a.outlier.reason == "5xx"
    # b: 5 gateway failures, but max_ejection_percent 50% of 3 = 1 endpoint, already a
    assert not detector.record(b, Outcome.GATEWAY_FAILURE, 4.0, ready)
    assert b.outlier.consecutive_gateway_failures == 5 and b.ejected_until_s == 0.0
    # mixed 5xx and gateway failures count for consecutive_5xx (Envoy counts every 5xx there)
    for t, outcome in enumerate([Outcome.SERVER_ERROR, Outcome.GATEWAY_FAILURE] * 2):
        assert not detector.record(c, outcome, 10.0 + t, [c, b])
    assert not detector.record(c, Outcome.SERVER_ERROR, 20.0, [a, b, c])   # a is out: 1 of 3 is the most
    assert c.outlier.consecutive_5xx == 5 and c.outlier.consecutive_gateway_failures == 0
    assert detector.record(c, Outcome.SERVER_ERROR, 21.0, [b, c]) and c.outlier.reason == "5xx"


def test_max_ejection_percent_never_ejects_the_last_ready_endpoint() -> None:
    s = OutlierSettings(max_ejection_percent=50.0)
    assert [s.max_ejected(n) for n in (0, 1, 2, 3, 4, 10)] == [0, 0, 1, 1, 2, 5]
    assert OutlierSettings(max_ejection_percent=10.0).max_ejected(3) == 1        # at least one, as Envoy
    assert OutlierSettings(max_ejection_percent=100.0).max_ejected(4) == 3       # never the last
    assert OutlierSettings(max_ejection_percent=0.0).max_ejected(4) == 0
    detector = OutlierDetector(OutlierSettings(consecutive_stalls=1))
    (only,) = ready = endpoints(1)
    assert not detector.record(only, Outcome.STALL, 0.0, ready)   # a pool of one never ejects
    a, b = ready = endpoints(2)
    assert detector.record(a, Outcome.STALL, 0.0, ready)
    assert not detector.record(b, Outcome.STALL, 0.0, ready)      # a is out: b is the last one
    assert OutlierDetector.release(a, 30.0)
    assert detector.record(b, Outcome.STALL, 31.0, ready)         # now b may go


def test_ejection_time_grows_with_each_ejection_and_decays_while_healthy() -> None:
    detector = OutlierDetector(OutlierSettings(consecutive_stalls=1, base_ejection_time_s=10.0,
                                               interval_s=10.0, max_ejection_time_s=25.0))  # fmt: skip
    a, b = ready = endpoints(2)
    assert detector.record(a, Outcome.STALL, 0.0, ready) and a.ejected_until_s == 10.0
    assert OutlierDetector.release(a, 10.0)
    assert detector.record(a, Outcome.STALL, 11.0, ready) and a.ejected_until_s == 31.0   # 2 x 10 s
    assert OutlierDetector.release(a, 31.0)
    assert detector.record(a, Outcome.STALL, 32.0, ready) and a.ejected_until_s == 57.0   # 3 x 10, capped at 25
    assert OutlierDetector.release(a, 57.0)
    # 25 s healthy = 2 intervals: the multiplier falls from 3 to 1, the next ejection is 2 x 10 s
    assert detector.record(a, Outcome.STALL, 82.0, ready) and a.ejected_until_s == 102.0
    assert a.outlier.ejections_total == 4


def test_an_ejected_endpoint_is_not_ejected_again_and_draining_ones_never() -> None:
    detector = OutlierDetector(OutlierSettings(consecutive_stalls=1))
    a, b, c = endpoints(3)
    assert detector.record(a, Outcome.STALL, 0.0, [a, b, c])
    until = a.ejected_until_s
    assert not detector.record(a, Outcome.STALL, 1.0, [a, b, c]) and a.ejected_until_s == until
    assert not detector.record(c, Outcome.STALL, 1.0, [a, b])   # c is not ready (draining)
    assert c.outlier.stalls_total == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_ejection_percent"):
        OutlierSettings(max_ejection_percent=120)
    with pytest.raises(ValueError, match="base_ejection_time_s"):
        OutlierSettings(base_ejection_time_s=0)
    with pytest.raises(ValueError, match="consecutive_stalls"):
        OutlierSettings(consecutive_stalls=-1)


# --- the pool leaves ejected endpoints out ------------------------------------------------


def test_pick_skips_ejected_endpoints_until_their_ejection_ends() -> None:
    eps = endpoints(2)
    settings = OutlierSettings(consecutive_stalls=1, base_ejection_time_s=5.0, slow_start_window_s=0.0)
    pool = Pool("m", make_policy("round-robin"), eps, 0.0, outlier=OutlierDetector(settings))
    assert pool.record_outcome(eps[0], Outcome.STALL, 0.0)
    request = RouteRequest()
    assert {pool.pick(request, 1.0).id for _ in range(6)} == {"e1"}
    assert pool.pick(request, 1.0, tried=[eps[1]]).id == "e0"   # nothing else left: trying beats refusing
    assert {pool.pick(request, 5.0).id for _ in range(6)} == {"e0", "e1"}   # back after 5 s
    assert eps[0].ejected_until_s == 0.0


def test_an_endpoint_back_from_an_ejection_ramps_up_its_share_as_envoy_slow_start() -> None:
    settings = OutlierSettings(consecutive_stalls=1, base_ejection_time_s=5.0, slow_start_window_s=10.0)
    detector = OutlierDetector(settings)
    eps = endpoints(2)
    pool = Pool("m", make_policy("round-robin"), eps, 0.0, outlier=detector)
    assert pool.record_outcome(eps[0], Outcome.STALL, 0.0)
    request = RouteRequest()

    def share_of_e0(now_s: float, picks: int = 200) -> float:
        return sum(pool.pick(request, now_s).id == "e0" for _ in range(picks)) / picks

    # Its share is the slow-start weight times the half round-robin gives it in full.
    assert share_of_e0(4.0) == 0.0                                     # ejected
    assert share_of_e0(5.0) == pytest.approx(0.1 * 0.5, abs=0.02)    # back (released by this pick) ...
    assert detector.slow_start_weight(eps[0], 5.0) == pytest.approx(0.1)    # ... at min_weight_percent 10
    assert detector.slow_start_weight(eps[0], 10.0) == pytest.approx(0.5)   # 5 s into a 10 s window
    assert share_of_e0(10.0) == pytest.approx(0.5 * 0.5, abs=0.03)
    assert share_of_e0(15.0) == pytest.approx(0.5, abs=0.01)          # the window is over: its full share
    assert eps[0].slow_start_since_s == 0.0
    with pytest.raises(ValueError, match="slow_start"):
        OutlierSettings(slow_start_aggression=0)


def test_a_ramping_endpoint_alone_takes_every_request() -> None:
    eps = endpoints(2)
    pool = Pool("m", make_policy("round-robin"), eps, 0.0,
                outlier=OutlierDetector(OutlierSettings(consecutive_stalls=1, base_ejection_time_s=5.0)))
    assert pool.record_outcome(eps[0], Outcome.STALL, 0.0)
    assert pool.pick(RouteRequest(), 5.0, tried=[eps[1]]).id == "e0"


def test_pick_prefers_a_cooling_endpoint_to_an_ejected_one() -> None:
    eps = endpoints(3)
    pool = Pool("m", make_policy("round-robin"), eps, 0.0,
                outlier=OutlierDetector(OutlierSettings(consecutive_stalls=1)))
    assert pool.record_outcome(eps[0], Outcome.STALL, 0.0)
    eps[1].record_failure(0.0, cooldown_s=2.0)
    request = RouteRequest()
    assert {pool.pick(request, 1.0).id for _ in range(4)} == {"e2"}
    assert pool.pick(request, 1.0, tried=[eps[2]]).id == "e1"


# --- the first-token deadline -------------------------------------------------------------


def test_default_deadline_is_base_plus_prefill_at_the_floor_rate() -> None:
    assert first_token_timeout_s(None, 0) == 10.0
    assert first_token_timeout_s(None, 4096) == pytest.approx(14.096)
    assert first_token_timeout_s(None, 3000, queued_prefill_tokens=5000) == pytest.approx(18.0)
    budget = FirstTokenBudget(base_s=1.0, prefill_tokens_per_s=100.0, decode_s_per_token=0.5)
    assert first_token_timeout_s(None, 200, budget=budget) == pytest.approx(3.0)


def test_a_pool_timeout_is_used_as_it_is_and_non_streamed_requests_get_their_decode_time() -> None:
    assert first_token_timeout_s(2.5, 100_000, 100_000) == 2.5
    assert first_token_timeout_s(2.5, 10, stream=False, max_tokens=100) == pytest.approx(2.5 + 100 * 0.2)
    assert first_token_timeout_s(2.5, 10, stream=False, max_tokens=None) is None   # may generate for minutes
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        FirstTokenBudget(prefill_tokens_per_s=0)
