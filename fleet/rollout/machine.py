"""The canary rollout state machine: steps, weights, pauses, analysis verdicts, promote or roll back.

Owns `RolloutPhase`, `RolloutState` (everything a rollout has decided, JSON round trip for the
controller's state file) and `CanaryMachine` (the pure transitions over it: `start`, `advance`,
`analysis_due`, `record`, `pause`, `resume`, `promote`, `abort`), `split_replicas` (how many
replicas each revision gets for a deployment size and weight), `replica_targets` and
`needed_rate_per_s` (the load an analysis window needs). Called by the controller on every
tick and by the trace simulator in virtual time; no I/O, no clock (the caller passes ``now_s``).

Semantics (docs/rollouts.md has the user's view):

- A weight step waits until the canary has as many READY replicas as that weight needs
  (`split_replicas`), then sets the weight: a revision gets traffic only once it is warm. Pause
  steps wait their seconds; analysis steps wait for their passing runs. After the last step the
  canary is promoted (weight 100: the implied final step).
- Analysis runs every ``analysis.intervalSeconds`` while the canary has a weight, through pauses
  too, over the window since the previous run. A failed run counts toward ``failureLimit`` (more
  failures than the limit roll back); an inconclusive run never passes a step and, with
  ``inconclusiveLimit``, that many in a row roll back; an error run (signal unavailable) changes
  nothing but is recorded. A canary that never receives traffic is therefore never promoted.
- `pause` stops the steps (a pause step's clock stops too), not the analysis; `resume` continues;
  `promote` skips the remaining steps; `abort` rolls back. Terminal phases ignore everything.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field

from fleet.rollout.analysis import AnalysisRun, Verdict
from fleet.rollout.spec import AnalysisSpec, RolloutSpec

RUNS_KEPT = 10
"""Analysis runs kept in `RolloutState.runs` (the newest), for `fleet rollout status`."""


class RolloutPhase(enum.Enum):
    PROGRESSING = "Progressing"
    PAUSED = "Paused"            # by `fleet rollout pause`: steps wait, analysis goes on
    PROMOTED = "Promoted"        # the canary is the stable revision now
    ROLLED_BACK = "RolledBack"   # weight 0; the canary drains and stops; not retried for this spec

    def terminal(self) -> bool:
        return self in (RolloutPhase.PROMOTED, RolloutPhase.ROLLED_BACK)


@dataclass
class RolloutState:
    """One rollout of ``canary`` (a revision key, e.g. a serving hash) over ``stable``. Times
    are the caller's clock seconds; ``weight`` is the canary's share of requests in percent."""

    canary: str
    stable: str
    started_at_s: float
    step_started_at_s: float
    phase: RolloutPhase = RolloutPhase.PROGRESSING
    step_index: int = 0
    weight: float = 0.0
    window_from_s: float = 0.0          # start of the next analysis window
    passes_in_step: int = 0
    passes: int = 0
    failures: int = 0
    inconclusive_in_row: int = 0
    inconclusive: int = 0
    errors: int = 0
    paused_at_s: float | None = None
    decided_at_s: float | None = None   # promoted or rolled back at
    reason: str = ""
    runs: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {**asdict(self), "phase": self.phase.value}

    @classmethod
    def from_dict(cls, d: dict) -> RolloutState:
        """The record `to_dict` wrote. Raises KeyError, TypeError or ValueError otherwise."""
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["phase"] = RolloutPhase(fields.get("phase", RolloutPhase.PROGRESSING.value))
        return cls(**fields)


def split_replicas(total: int, canary_weight: float) -> tuple[int, int]:
    """(stable, canary) replica counts for a deployment sized ``total`` by the autoscaler and a
    canary weight in percent: the canary gets ceil(total x weight / 100), at least one while its
    weight is above 0; stable the rest, at least one while the weight is below 100 (so a
    one-replica deployment surges to two during a rollout)."""
    total = max(total, 0)
    if canary_weight <= 0:
        return total, 0
    if canary_weight >= 100:
        return 0, max(total, 1)
    canary = max(1, math.ceil(total * canary_weight / 100.0 - 1e-9))
    return max(1, total - canary), canary


def replica_targets(total: int, weight: float, sizing_weight: float, surge: bool = True) -> tuple[int, int]:
    """(stable, canary) replicas wanted during a rollout: the canary gets its share of
    ``sizing_weight`` (`CanaryMachine.sizing_weight`: READY before it gets that traffic); with
    ``surge`` stable keeps its share of the current ``weight`` (it shrinks only once the canary
    carries that traffic), without it stable makes room at once (at least one stays while the
    weight is below 100)."""
    canary = split_replicas(total, sizing_weight)[1]
    if surge:
        return split_replicas(total, weight)[0], canary
    return (max(1, total - canary) if weight < 100 else 0), canary


def load_ratio(total: int, weight: float) -> float | None:
    """Requests per canary replica / requests per stable replica at ``weight`` percent for a
    deployment of ``total`` (`split_replicas`); None when one side has no replica. Below 1 the
    canary's replicas are less loaded than stable's, so its TTFT and TPOT look better than they
    are; weights that are multiples of 100 / total give 1."""
    stable, canary = split_replicas(total, weight)
    if stable == 0 or canary == 0 or not 0 < weight < 100:
        return None
    return (weight / canary) / ((100.0 - weight) / stable)


def needed_rate_per_s(analysis: AnalysisSpec, weight: float) -> float:
    """Requests per second the whole deployment needs so that one analysis window holds
    ``minSamplesPerSide`` samples on each side at ``weight`` percent: the smaller side gets
    min(weight, 100 - weight) % of the requests, so

        rate = minSamplesPerSide / (intervalSeconds x min(weight, 100 - weight) / 100)

    (50 samples, 60 s, weight 10 %: 8.3 req/s; at 25 %: 3.3 req/s). TTFT and TPOT samples come
    only from streamed replies, so it is a rate of streamed requests when those metrics are
    checked; the first window after a canary replica's READY is shorter by
    ``excludeAfterReadySeconds`` and needs more."""
    share = min(weight, 100.0 - weight) / 100.0
    return analysis.min_samples_per_side / (analysis.interval_seconds * share)


class CanaryMachine:
    """Transitions of a `RolloutState` under one `RolloutSpec` (strategy canary). Stateless:
    the same spec, state and inputs always give the same result."""

    def __init__(self, spec: RolloutSpec) -> None:
        if spec.strategy != "canary":
            raise ValueError(f"CanaryMachine needs strategy canary, got {spec.strategy!r}")
        self.spec = spec

    def start(self, canary: str, stable: str, now_s: float) -> RolloutState:
        return RolloutState(canary=canary, stable=stable, started_at_s=now_s, step_started_at_s=now_s,
                            window_from_s=now_s)  # fmt: skip

    def load_notes(self, total: int, tolerance: float = 0.2) -> list[str]:
        """One line per weight step at which a canary replica's load differs from a stable
        replica's by more than ``tolerance`` (`load_ratio`), for a deployment of ``total``."""
        notes = []
        for step in self.spec.steps:
            ratio = load_ratio(total, step.weight) if step.weight is not None else None
            if ratio is not None and abs(ratio - 1.0) > tolerance:
                notes.append(f"note: at weight {step.weight:g} % a canary replica carries {ratio:.2f}x a stable "
                             f"replica's load ({total} replicas), so latency comparisons "
                             f"{'favour' if ratio < 1 else 'penalise'} the canary; multiples of "
                             f"{100 / max(total, 1):g} % compare like with like")  # fmt: skip
        return notes

    def traffic_note(self) -> str:
        """The load the analysis needs (`needed_rate_per_s` at the weight step that needs the
        most), as one line for `fleet apply` and docs/rollouts.md."""
        a = self.spec.analysis
        weights = [s.weight for s in self.spec.steps if s.weight is not None]
        if not weights:
            return ""
        weight = max(weights, key=lambda w: needed_rate_per_s(a, w))
        streamed = any(c.metric.startswith(("ttft", "tpot")) for c in a.metrics)
        return (f"note: the analysis needs at least {needed_rate_per_s(a, weight):.1f} "
                f"{'streamed ' if streamed else ''}req/s to this deployment, steadily (at weight {weight:g} %: "
                f"minSamplesPerSide {a.min_samples_per_side} / (intervalSeconds {a.interval_seconds:g} x "
                f"{min(weight, 100 - weight):g} %)); with less, runs are inconclusive")

    def sizing_weight(self, state: RolloutState) -> float:
        """The weight the revisions' replica counts follow: the weight the current weight step is
        about to set (so the canary's replicas are READY before it gets that traffic), else the
        current weight (100 once promoted, 0 once rolled back)."""
        if not state.phase.terminal() and state.step_index < len(self.spec.steps):
            step = self.spec.steps[state.step_index]
            if step.weight is not None:
                return max(step.weight, state.weight)
        return state.weight

    def advance(self, state: RolloutState, now_s: float, *, canary_ready: int, total: int) -> list[str]:
        """Move through the steps that are done. ``canary_ready``: the canary's READY replicas;
        ``total``: the deployment's size (replicas wanted in all). Returns event lines."""
        events: list[str] = []
        if state.phase is not RolloutPhase.PROGRESSING:
            return events
        steps = self.spec.steps
        while state.step_index < len(steps):
            step = steps[state.step_index]
            if step.weight is not None:
                _, needed = split_replicas(total, step.weight)
                if canary_ready < needed:
                    return events
                if state.weight <= 0:
                    state.window_from_s = now_s   # the canary's first requests start the first window
                state.weight = step.weight
                events.append(f"weight {step.weight:g} % to the canary ({canary_ready} READY)")
            elif step.pause_seconds is not None:
                if now_s - state.step_started_at_s < step.pause_seconds:
                    return events
            elif state.passes_in_step < step.analysis.passes:  # type: ignore[union-attr]
                return events
            state.step_index += 1
            state.step_started_at_s = now_s
            state.passes_in_step = 0
        return events + self._decide(state, RolloutPhase.PROMOTED, now_s, "every step passed")

    def analysis_due(self, state: RolloutState, now_s: float) -> bool:
        """An analysis run is due: the canary has traffic and a whole interval has passed."""
        return (not state.phase.terminal() and state.weight > 0
                and now_s - state.window_from_s >= self.spec.analysis.interval_seconds)  # fmt: skip

    def record(self, state: RolloutState, run: AnalysisRun, now_s: float) -> list[str]:
        """Take one analysis run's verdict (module docstring). Returns event lines."""
        if state.phase.terminal():
            return []
        a = self.spec.analysis
        state.window_from_s = run.to_s
        summary = run.summary(state.weight)
        state.runs = (state.runs + [{**run.to_dict(), "summary": summary}])[-RUNS_KEPT:]
        events = [f"analysis {summary}"]
        if run.verdict is Verdict.PASS:
            state.passes += 1
            state.passes_in_step += 1
            state.inconclusive_in_row = 0
        elif run.verdict is Verdict.FAIL:
            state.failures += 1
            state.inconclusive_in_row = 0
            if state.failures > a.failure_limit:
                why = f"{state.failures} failed analysis runs (failureLimit {a.failure_limit}): {run.summary()}"
                return events + self._decide(state, RolloutPhase.ROLLED_BACK, now_s, why)
        elif run.verdict is Verdict.INCONCLUSIVE:
            state.inconclusive += 1
            state.inconclusive_in_row += 1
            if a.inconclusive_limit is not None and state.inconclusive_in_row >= a.inconclusive_limit:
                why = f"{state.inconclusive_in_row} inconclusive analysis runs in a row (inconclusiveLimit)"
                return events + self._decide(state, RolloutPhase.ROLLED_BACK, now_s, why)
        else:
            state.errors += 1
        return events

    def pause(self, state: RolloutState, now_s: float) -> list[str]:
        if state.phase is not RolloutPhase.PROGRESSING:
            return []
        state.phase, state.paused_at_s = RolloutPhase.PAUSED, now_s
        return ["paused"]

    def resume(self, state: RolloutState, now_s: float) -> list[str]:
        if state.phase is not RolloutPhase.PAUSED:
            return []
        state.step_started_at_s += now_s - (state.paused_at_s or now_s)   # a pause step's clock stood still
        state.phase, state.paused_at_s = RolloutPhase.PROGRESSING, None
        return ["resumed"]

    def promote(self, state: RolloutState, now_s: float, reason: str = "promoted by hand") -> list[str]:
        if state.phase.terminal():
            return []
        return self._decide(state, RolloutPhase.PROMOTED, now_s, reason)

    def abort(self, state: RolloutState, now_s: float, reason: str = "aborted by hand") -> list[str]:
        if state.phase.terminal():
            return []
        return self._decide(state, RolloutPhase.ROLLED_BACK, now_s, reason)

    @staticmethod
    def _decide(state: RolloutState, phase: RolloutPhase, now_s: float, reason: str) -> list[str]:
        state.phase, state.decided_at_s, state.reason = phase, now_s, reason
        state.weight = 100.0 if phase is RolloutPhase.PROMOTED else 0.0
        state.paused_at_s = None
        return [f"{'promoted' if phase is RolloutPhase.PROMOTED else 'rolled back'}: {reason}"]
