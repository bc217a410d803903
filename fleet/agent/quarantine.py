"""The quarantine policy: which GPUs and MIG instances to keep away from serving, and when to
give them back. Pure: state in, state and decisions out, time from the injected clock.

Owns `QuarantineConfig`, `QuarantineState` (and its JSON form: `QuarantineState.to_json`,
`QuarantineState.from_json`; the runner keeps it in a file so a restart forgets nothing),
`Decision` and `QuarantinePolicy.decide`. Called by
`fleet.agent.runner.NodeAgent` every check, on its own node's findings (the cap's base is the
fleet's GPU count the agent is given, else its node's). Acting on a decision (placement skipping
the target, draining the replicas on it) is the caller's.

Rules (docs/node-agent.md, "Quarantine"):
- a *fault* finding quarantines its target at once; a *degraded* condition when it has been seen
  at every check for ``degraded_after_s`` (a brief thermal slowdown does not); unclassified
  (*suspect*) Xids when ``unknown_xid_repeats`` arrive within ``suspect_window_s``; application
  Xids never do (they are the process's fault: NVIDIA's device plugin skips them too);
- an Xid fault is evidence for ``xid_evidence_s`` after it happened; a condition while it is read;
- a quarantine is lifted when there has been no evidence for ``hold_off_s`` (automatically: the
  anchors' users report quarantines that never lift);
- at most ``max_quarantined_share`` of the fleet's GPUs (MIG instances weigh their share of a
  GPU) are quarantined at once; beyond it the decision is ``withheld``: an alert, no quarantine
  (one noisy Xid flagging dozens of nodes is the failure this prevents). Faults take free places
  before degraded targets;
- except a *certain* fault (`fleet.agent.health.Finding.certain`: the GPU lost, an uncorrected
  ECC error, a row remap pending or failed, Xid 48/63/64/79/94/95/140): it quarantines whatever
  the cap says, and counts against it. On a node of 1 to 3 GPUs the 25% cap is below one GPU, so
  without this rule a GPU with a double-bit ECC error kept serving. A certain Xid stays certain
  evidence for ``xid_evidence_s``, like any Xid fault.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable

from fleet.agent.health import Finding, Severity


@dataclass(frozen=True)
class QuarantineConfig:
    hold_off_s: float = 600.0
    """Seconds without evidence before a quarantine is lifted."""
    degraded_after_s: float = 60.0
    """Seconds a degraded condition must persist before it quarantines (DCGM, too, wants about a
    minute of samples before its first verdict; docs/anchors.md)."""
    xid_evidence_s: float = 3600.0
    """Seconds an Xid fault counts as evidence after it happened (a reset clears the readings,
    not the event)."""
    unknown_xid_repeats: int = 3
    suspect_window_s: float = 600.0
    max_quarantined_share: float = 0.25
    """Most of the fleet's GPUs quarantined at once (0..1)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.max_quarantined_share <= 1.0:
            raise ValueError(f"max_quarantined_share must be within 0..1, got {self.max_quarantined_share}")
        for name in ("hold_off_s", "degraded_after_s", "xid_evidence_s", "suspect_window_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds")
        if self.unknown_xid_repeats < 1:
            raise ValueError("unknown_xid_repeats must be >= 1")


@dataclass(frozen=True)
class TargetState:
    quarantined_since_s: float | None = None
    reason: str = ""
    degraded_since_s: float | None = None
    last_evidence_s: float | None = None
    xid_fault_s: float | None = None
    suspect_s: tuple[float, ...] = ()
    withheld: bool = False
    certain_xid_s: float | None = None
    """When the last certain Xid fault happened (clock seconds)."""


STATE_FORMAT = 1
"""Version of `QuarantineState.to_json`'s document."""


@dataclass(frozen=True)
class QuarantineState:
    targets: dict[str, TargetState] = field(default_factory=dict)

    def quarantined(self) -> dict[str, str]:
        """``{target: reason}`` of the targets quarantined now."""
        return {t: s.reason for t, s in self.targets.items() if s.quarantined_since_s is not None}

    def to_json(self) -> dict[str, Any]:
        """``{"format": 1, "targets": {target: {field: value}}}``: every `TargetState` field, times
        in the policy's clock seconds (wall-clock seconds in the agent, so they mean the same
        after a restart). Pure."""
        return {"format": STATE_FORMAT,
                "targets": {t: {**asdict(s), "suspect_s": list(s.suspect_s)} for t, s in sorted(self.targets.items())}}

    @classmethod
    def from_json(cls, doc: Any) -> QuarantineState:
        """The state `to_json` wrote. Unknown fields are ignored (a newer agent's file). Raises
        ValueError naming what is wrong (not a state document, an unknown format, a bad field)."""
        if not isinstance(doc, dict) or not isinstance(doc.get("targets"), dict):
            raise ValueError("not a quarantine state: expected {\"format\": 1, \"targets\": {...}}")
        if doc.get("format") != STATE_FORMAT:
            raise ValueError(f"quarantine state format {doc.get('format')!r}; this agent reads {STATE_FORMAT}")
        known = {f.name for f in fields(TargetState)}
        targets = {}
        for target, raw in doc["targets"].items():
            if not isinstance(raw, dict):
                raise ValueError(f"quarantine state of {target}: expected an object, got {type(raw).__name__}")
            values = {k: v for k, v in raw.items() if k in known}
            try:
                values["suspect_s"] = tuple(float(t) for t in values.get("suspect_s", ()))
                for name in ("quarantined_since_s", "degraded_since_s", "last_evidence_s", "xid_fault_s",
                             "certain_xid_s"):
                    if values.get(name) is not None:
                        values[name] = float(values[name])
            except (TypeError, ValueError) as err:
                raise ValueError(f"quarantine state of {target}: {err}") from None
            targets[str(target)] = TargetState(**{**values, "reason": str(values.get("reason", "")),
                                                  "withheld": bool(values.get("withheld", False))})
        return cls(targets)


@dataclass(frozen=True)
class Decision:
    """``action``: ``quarantine``, ``lift`` or ``withheld`` (the cap is reached: alert only)."""

    target: str
    action: str
    reason: str
    at_s: float


class QuarantinePolicy:
    def __init__(self, config: QuarantineConfig, clock: Callable[[], float]) -> None:
        self.config = config
        self.clock = clock

    def decide(self, state: QuarantineState, findings: list[Finding], targets: dict[str, tuple[str, float]],
               fleet_gpus: float) -> tuple[QuarantineState, list[Decision]]:
        """One step. ``findings``: this check's; ``targets``: every GPU and MIG instance known,
        ``{target: (gpu uuid, weight)}`` (`GpuHealthChecker.targets`); ``fleet_gpus``: GPUs of
        the whole fleet (the cap's base). Returns the new state and what changed."""
        cfg, now = self.config, self.clock()
        by_target: dict[str, list[Finding]] = {}
        for f in findings:
            by_target.setdefault(f.target, []).append(f)
        new: dict[str, TargetState] = {}
        wants: list[tuple[int, str, str]] = []   # (rank, target, reason); rank 0: certain, past the cap
        for target in sorted(set(state.targets) | set(by_target)):
            st = state.targets.get(target, TargetState())
            fs = by_target.get(target, [])
            faults = [f for f in fs if f.severity is Severity.FAULT]
            certain_now = [f for f in faults if f.certain]
            degraded = [f for f in fs if f.severity is Severity.DEGRADED]
            suspects = [f for f in fs if f.severity is Severity.SUSPECT]
            xid_fault_s = max([f.observed_s for f in faults if f.event], default=st.xid_fault_s)
            suspect_s = tuple(t for t in st.suspect_s + tuple(f.observed_s for f in suspects)
                              if now - t <= cfg.suspect_window_s)
            degraded_since = (st.degraded_since_s if st.degraded_since_s is not None else now) if degraded else None
            xid_recent = xid_fault_s is not None and now - xid_fault_s <= cfg.xid_evidence_s
            certain_xid_s = max([f.observed_s for f in certain_now if f.event], default=st.certain_xid_s)
            certain = bool(certain_now) or (certain_xid_s is not None and now - certain_xid_s <= cfg.xid_evidence_s)
            suspect_hit = len(suspect_s) >= cfg.unknown_xid_repeats
            degraded_hit = degraded and now - degraded_since >= cfg.degraded_after_s
            evidence = bool(faults or xid_recent or degraded or suspect_hit)
            reason = _reason(faults, degraded if degraded_hit else [], suspects if suspect_hit else [],
                             st.reason)
            st = replace(st, degraded_since_s=degraded_since, xid_fault_s=xid_fault_s, suspect_s=suspect_s,
                         certain_xid_s=certain_xid_s, last_evidence_s=now if evidence else st.last_evidence_s)
            if st.quarantined_since_s is None:
                if certain:
                    wants.append((0, target, reason))
                elif faults or xid_recent:
                    wants.append((1, target, reason))
                elif degraded_hit or suspect_hit:
                    wants.append((2, target, reason))
                elif st.withheld:
                    st = replace(st, withheld=False)
            new[target] = st
        decisions: list[Decision] = []
        for target, st in list(new.items()):   # lifts first: they free places under the cap
            if st.quarantined_since_s is None:
                continue
            evidence_until = max(st.last_evidence_s or 0.0,
                                 st.xid_fault_s + cfg.xid_evidence_s if st.xid_fault_s is not None else 0.0)
            if now - evidence_until >= cfg.hold_off_s:
                decisions.append(Decision(target, "lift", f"no evidence for {now - evidence_until:.0f} s "
                                          f"(hold-off {cfg.hold_off_s:.0f} s); was: {st.reason}", now))
                new[target] = TargetState()
        used = sum(targets.get(t, (t, 1.0))[1] for t, s in new.items() if s.quarantined_since_s is not None)
        cap = cfg.max_quarantined_share * fleet_gpus
        for rank, target, reason in sorted(wants):
            weight = targets.get(target, (target, 1.0))[1]
            st = new[target]
            if used + weight <= cap + 1e-9 or rank == 0:
                if used + weight > cap + 1e-9:
                    reason = (f"{reason}; quarantined past the cap ({cfg.max_quarantined_share:.0%} of "
                              f"{fleet_gpus:g} GPU(s)): a certain hardware fault")
                used += weight
                new[target] = replace(st, quarantined_since_s=now, reason=reason, withheld=False)
                decisions.append(Decision(target, "quarantine", reason, now))
            elif not st.withheld:
                new[target] = replace(st, withheld=True)
                decisions.append(Decision(
                    target, "withheld", f"{reason}; not quarantined: {used:g} of {fleet_gpus:g} GPU(s) already "
                    f"quarantined, the cap is {cfg.max_quarantined_share:.0%}", now))
        # Forget targets with nothing left to remember.
        new = {t: s for t, s in new.items() if s != TargetState()}
        return QuarantineState(new), decisions


def _reason(faults: list[Finding], degraded: list[Finding], suspects: list[Finding], previous: str) -> str:
    picked = faults or degraded or suspects
    if not picked:
        return previous
    return "; ".join(sorted({f"{f.check}: {f.detail}" for f in picked}))
