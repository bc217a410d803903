"""The rollout state machine on fake time: steps and weights wait for READY canary replicas, pauses,
analysis gates, failure and inconclusive limits, pause/resume/promote/abort, and the state's JSON
round trip (what the controller persists)."""

from __future__ import annotations

import json

import pytest

from fleet.rollout.analysis import AnalysisRun, SideSamples, Verdict, analyse
from fleet.rollout.machine import CanaryMachine, RolloutPhase, RolloutState, split_replicas
from fleet.rollout.spec import AnalysisSpec, RolloutSpec, RolloutStep, StepAnalysis

P = RolloutPhase


def spec(failure_limit: int = 1, inconclusive_limit: int | None = None, interval_s: float = 60.0) -> RolloutSpec:
    return RolloutSpec(strategy="canary", steps=[
        RolloutStep(weight=10), RolloutStep(analysis=StepAnalysis(passes=2)),
        RolloutStep(weight=50), RolloutStep(pause_seconds=120), RolloutStep(analysis=StepAnalysis())],
        analysis=AnalysisSpec(interval_seconds=interval_s, min_samples_per_side=10, failure_limit=failure_limit,
                              inconclusive_limit=inconclusive_limit))  # fmt: skip


def run(verdict: Verdict, to_s: float) -> AnalysisRun:
    return AnalysisRun(to_s - 60.0, to_s, verdict, ())


class Rollout:
    """A rollout driven as the controller drives it: one `advance` per tick on fake time."""

    def __init__(self, s: RolloutSpec, total: int = 4) -> None:
        self.m = CanaryMachine(s)
        self.now_s = 1000.0
        self.total = total
        self.canary_ready = 0
        self.state = self.m.start("v2", "v1", self.now_s)
        self.events: list[str] = []

    def tick(self, seconds: float = 1.0, verdict: Verdict | None = None) -> None:
        self.now_s += seconds
        if verdict is not None:
            assert self.m.analysis_due(self.state, self.now_s)
            self.events += self.m.record(self.state, run(verdict, self.now_s), self.now_s)
        self.events += self.m.advance(self.state, self.now_s, canary_ready=self.canary_ready, total=self.total)


def test_split_replicas_follows_the_weight_and_keeps_one_of_each_while_both_serve():
    assert split_replicas(4, 0) == (4, 0)
    assert split_replicas(4, 10) == (3, 1)
    assert split_replicas(4, 50) == (2, 2)
    assert split_replicas(10, 25) == (7, 3)
    assert split_replicas(1, 10) == (1, 1)        # surge: stable keeps serving 90 %
    assert split_replicas(4, 100) == (0, 4)
    assert split_replicas(0, 100) == (0, 1)


def test_no_traffic_before_the_canary_is_ready_then_the_steps_and_promotion():
    r = Rollout(spec())
    assert r.m.sizing_weight(r.state) == 10      # canary replicas are sized for the coming weight
    r.tick(30)
    assert r.state.weight == 0 and r.state.step_index == 0 and not r.m.analysis_due(r.state, r.now_s + 999)
    r.canary_ready = 1
    r.tick()
    assert r.state.weight == 10 and r.state.step_index == 1 and r.state.window_from_s == r.now_s
    assert not r.m.analysis_due(r.state, r.now_s + 59) and r.m.analysis_due(r.state, r.now_s + 60)
    r.tick(60, Verdict.PASS)
    assert r.state.step_index == 1 and r.state.passes_in_step == 1    # needs two passes
    r.tick(60, Verdict.PASS)
    assert r.state.step_index == 2 and r.state.weight == 10          # 50 % needs 2 READY canary replicas
    assert r.m.sizing_weight(r.state) == 50
    r.canary_ready = 2
    r.tick()
    assert r.state.weight == 50 and r.state.step_index == 3          # pause 120 s starts
    r.tick(60, Verdict.PASS)                                         # a pass during a pause does not skip it
    assert r.state.step_index == 3
    r.tick(60)
    assert r.state.step_index == 4
    r.tick(1)
    assert r.state.phase is P.PROGRESSING                            # the last analysis step waits for a pass
    r.tick(59, Verdict.PASS)
    assert r.state.phase is P.PROMOTED and r.state.weight == 100 and r.state.decided_at_s == r.now_s
    assert r.events[-1] == "promoted: every step passed"
    assert r.m.sizing_weight(r.state) == 100


def test_failures_beyond_the_limit_roll_back_during_a_pause_too():
    r = Rollout(spec(failure_limit=1))
    r.canary_ready = 1
    r.tick()
    r.tick(60, Verdict.FAIL)
    assert r.state.phase is P.PROGRESSING and r.state.failures == 1
    r.tick(60, Verdict.PASS)
    r.m.pause(r.state, r.now_s)
    r.tick(60, Verdict.FAIL)
    assert r.state.phase is P.ROLLED_BACK and r.state.weight == 0
    assert "2 failed analysis runs (failureLimit 1)" in r.state.reason
    assert r.m.sizing_weight(r.state) == 0
    r.tick(60)                                          # terminal: nothing moves any more
    assert r.m.record(r.state, run(Verdict.PASS, r.now_s), r.now_s) == [] and r.state.phase is P.ROLLED_BACK
    assert not r.m.analysis_due(r.state, r.now_s + 1000)


def test_failure_limit_zero_rolls_back_on_the_first_failed_run():
    r = Rollout(spec(failure_limit=0))
    r.canary_ready = 1
    r.tick()
    r.tick(60, Verdict.FAIL)
    assert r.state.phase is P.ROLLED_BACK


def test_inconclusive_runs_never_promote_and_roll_back_only_with_a_limit():
    held = Rollout(spec())
    held.canary_ready = 1
    held.tick()
    for _ in range(50):
        held.tick(60, Verdict.INCONCLUSIVE)
    assert held.state.phase is P.PROGRESSING and held.state.step_index == 1 and held.state.weight == 10
    limited = Rollout(spec(inconclusive_limit=3))
    limited.canary_ready = 1
    limited.tick()
    limited.tick(60, Verdict.INCONCLUSIVE)
    limited.tick(60, Verdict.INCONCLUSIVE)
    limited.tick(60, Verdict.PASS)                     # a pass resets the count
    limited.tick(60, Verdict.INCONCLUSIVE)
    limited.tick(60, Verdict.INCONCLUSIVE)
    assert limited.state.phase is P.PROGRESSING
    limited.tick(60, Verdict.INCONCLUSIVE)
    assert limited.state.phase is P.ROLLED_BACK and "3 inconclusive" in limited.state.reason


def test_error_runs_change_nothing_but_are_counted():
    r = Rollout(spec(failure_limit=0, inconclusive_limit=1))
    r.canary_ready = 1
    r.tick()
    for _ in range(5):
        r.tick(60, Verdict.ERROR)
    assert r.state.phase is P.PROGRESSING and r.state.errors == 5 and r.state.step_index == 1


def test_a_user_pause_stops_the_steps_and_the_pause_clock_not_the_analysis():
    r = Rollout(spec())
    r.canary_ready = 2
    r.tick()
    r.tick(60, Verdict.PASS)
    r.tick(60, Verdict.PASS)
    r.tick()
    assert r.state.step_index == 3                     # in the 120 s pause step
    r.tick(60)
    assert r.m.pause(r.state, r.now_s) == ["paused"] and r.state.phase is P.PAUSED
    r.tick(600, Verdict.PASS)                          # analysis still runs while paused
    assert r.state.step_index == 3 and r.state.passes == 3
    r.m.resume(r.state, r.now_s)
    r.tick(58)
    assert r.state.step_index == 3                     # 61 s before the pause + 58 s after it
    r.tick(1)
    assert r.state.step_index == 4


def test_promote_and_abort_by_hand():
    r = Rollout(spec())
    r.canary_ready = 1
    r.tick()
    assert r.m.promote(r.state, r.now_s) == ["promoted: promoted by hand"] and r.state.weight == 100
    assert r.m.abort(r.state, r.now_s) == [] and r.state.phase is P.PROMOTED
    r2 = Rollout(spec())
    assert r2.m.abort(r2.state, r2.now_s) == ["rolled back: aborted by hand"] and r2.state.phase is P.ROLLED_BACK


def test_state_round_trips_through_json_mid_rollout():
    r = Rollout(spec())
    r.canary_ready = 1
    r.tick()
    r.tick(60, Verdict.PASS)
    r.m.pause(r.state, r.now_s)
    again = RolloutState.from_dict(json.loads(json.dumps(r.state.to_dict())))
    assert again == r.state and again.phase is P.PAUSED and again.runs[0]["verdict"] == "pass"


def test_the_machine_judges_real_analysis_runs_end_to_end():
    s = spec(failure_limit=0)
    m = CanaryMachine(s)
    state = m.start("v2", "v1", 0.0)
    m.advance(state, 0.0, canary_ready=1, total=4)
    slow = SideSamples(ttft_s=[0.3] * 20, tpot_s=[0.02] * 20, requests=20)
    fast = SideSamples(ttft_s=[0.2] * 20, tpot_s=[0.02] * 20, requests=20)
    m.record(state, analyse(s.analysis, slow, fast, 0.0, 60.0), 60.0)
    assert state.phase is P.ROLLED_BACK and "ttftP99: canary 300.0 ms > limit 240.0 ms" in state.reason


def test_only_canary_specs_drive_the_machine():
    with pytest.raises(ValueError, match="strategy canary"):
        CanaryMachine(RolloutSpec())


def test_replica_targets_with_and_without_surge():
    from fleet.rollout.machine import replica_targets

    assert replica_targets(2, 0, 25) == (2, 1)                 # surge: stable keeps serving while the canary warms
    assert replica_targets(2, 25, 25) == (1, 1)
    assert replica_targets(2, 0, 25, surge=False) == (1, 1)    # no room: a stable replica makes way first
    assert replica_targets(1, 0, 25, surge=False) == (1, 1)    # the last stable replica never goes before 100
    assert replica_targets(4, 100, 100, surge=False) == (0, 4)


def test_load_ratio_and_notes_say_when_canary_replicas_carry_another_load_than_stable_ones():
    from fleet.rollout.machine import load_ratio

    assert load_ratio(4, 25) == pytest.approx(1.0) and load_ratio(4, 50) == pytest.approx(1.0)
    assert load_ratio(4, 10) == pytest.approx((10 / 1) / (90 / 3))        # a third of a stable replica's load
    assert load_ratio(1, 25) == pytest.approx(25 / 75)                    # the surge replica of a one-replica deployment
    assert load_ratio(4, 0) is None
    notes = CanaryMachine(spec()).load_notes(4)                          # weights 10 and 50
    assert notes == ["note: at weight 10 % a canary replica carries 0.33x a stable replica's load (4 replicas), so "
                     "latency comparisons favour the canary; multiples of 25 % compare like with like"]
    assert CanaryMachine(spec()).load_notes(10) == []


def test_the_needed_rate_fills_one_window_on_the_smaller_side_and_the_note_names_the_binding_step():
    from fleet.rollout.machine import needed_rate_per_s

    a = AnalysisSpec(interval_seconds=60, min_samples_per_side=50)
    assert needed_rate_per_s(a, 10) == pytest.approx(50 / 6)              # 8.3 req/s: the canary gets 10 %
    assert needed_rate_per_s(a, 25) == pytest.approx(50 / 15)
    assert needed_rate_per_s(a, 90) == needed_rate_per_s(a, 10)          # stable is the smaller side then
    note = CanaryMachine(spec()).traffic_note()                          # weights 10 and 50, 10 samples, 60 s
    assert note == ("note: the analysis needs at least 1.7 streamed req/s to this deployment, steadily (at weight "
                    "10 %: minSamplesPerSide 10 / (intervalSeconds 60 x 10 %)); with less, runs are inconclusive")
    # the canary at exactly the needed rate fills a window: the analysis of such a window is not short
    rate = needed_rate_per_s(a, 25)
    n = round(rate * 0.25 * 60)
    full = SideSamples(ttft_s=[0.1] * n, tpot_s=[0.01] * n, e2e_s=[1.0] * n, queue_time_s=[0.0] * n, requests=n)
    stable = SideSamples(ttft_s=[0.1] * 3 * n, tpot_s=[0.01] * 3 * n, e2e_s=[1.0] * 3 * n, requests=3 * n)
    assert analyse(a, full, stable, 0.0, 60.0).verdict is Verdict.PASS


def test_an_inconclusive_run_is_recorded_with_what_it_waits_for():
    r = Rollout(spec())
    r.canary_ready = 1
    r.tick(0)
    few = SideSamples(ttft_s=[0.1] * 3, tpot_s=[0.01] * 3, e2e_s=[1.0] * 3, requests=3)
    many = SideSamples(ttft_s=[0.1] * 40, tpot_s=[0.01] * 40, e2e_s=[1.0] * 40, requests=40)
    events = r.m.record(r.state, analyse(r.m.spec.analysis, few, many, r.now_s, r.now_s + 60), r.now_s + 60)
    assert r.state.weight == 10 and events == ["analysis " + r.state.runs[-1]["summary"]]
    assert "canary has 3 of 10 samples" in events[0] and "in all at weight 10 %" in events[0]
