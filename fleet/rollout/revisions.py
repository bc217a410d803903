"""Revisions of a deployment as the controller keeps them, and what a rollout needs from outside.

Owns `Revisions` (a deployment's serving specs by serving hash: the stable revision, the canary
during a rollout, the rolled-back hashes that are not retried, the rollout's `RolloutState`, and
their JSON round trip for the state file), `revision_targets` (replicas wanted per revision for
a deployment size: the split follows the weight), `endpoint_weights`, `revision_label`, the
`AnalysisSource` protocol (where per-request samples of the revisions come from: the router's
admin API, `fleet.controller.router_admin`) and `side_samples` (the samples of one revision in a window,
without requests served by a replica in its first seconds after READY). Used by
`fleet.controller.reconcile`; pure apart from the protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from fleet.spec import LoadedDeployment, SpecError, parse_document
from fleet.rollout.analysis import SideSamples
from fleet.rollout.machine import CanaryMachine, RolloutPhase, RolloutState, replica_targets


def revision_label(ld: LoadedDeployment) -> str:
    """The router `version` of a revision: ``spec.model.revision@<first 8 hex of the serving
    hash>`` (two revisions may share the model revision label: an engine-args change)."""
    return f"{ld.deployment.spec.model.revision}@{ld.serving_hash[:8]}"


@dataclass(frozen=True)
class RequestSample:
    """One finished request as the router saw it (`GET /admin/v1/revisions/{model}`): its
    ``version`` and ``endpoint``, ``age_s`` (seconds before the router's answer that it
    finished), ``ttft_s`` (None: failed), ``tpot_s`` (None: not streamed, or < 2 events),
    ``e2e_s``, ``queue_time_s`` and ``error`` (5xx, failed or cut)."""

    version: str
    endpoint: str
    age_s: float
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float | None
    queue_time_s: float
    error: bool

    @classmethod
    def from_row(cls, row: list) -> RequestSample:
        v, e, age, ttft, tpot, e2e, q, err = row
        return cls(str(v), str(e), float(age), ttft, tpot, e2e, float(q or 0.0), bool(err))


class AnalysisSource(Protocol):
    async def revision_samples(self, model: str, window_s: float) -> list[RequestSample]:
        """The requests of ``model`` that finished in the last ``window_s`` seconds. Raises
        on failure (the analysis run is then an error, never a failure)."""
        ...


def side_samples(samples: Iterable[RequestSample], version: str, window_s: float,
                 eligible_age_s: Mapping[str, float]) -> SideSamples:  # fmt: skip
    """The samples of ``version`` no older than ``window_s``, from endpoints in
    ``eligible_age_s`` and no older than its value there (seconds since the endpoint's
    exclusion after READY ended; a negative value excludes the endpoint entirely)."""
    out = SideSamples()
    for s in samples:
        if s.version != version or s.age_s > window_s or s.age_s > eligible_age_s.get(s.endpoint, -1.0):
            continue
        out.requests += 1
        if s.error:
            out.errors += 1
            continue
        out.queue_time_s.append(s.queue_time_s)
        if s.ttft_s is not None:
            out.ttft_s.append(s.ttft_s)
        if s.tpot_s is not None:
            out.tpot_s.append(s.tpot_s)
        if s.e2e_s is not None:
            out.e2e_s.append(s.e2e_s)
    return out


@dataclass
class Revisions:
    """What a deployment serves: specs by serving hash, the stable hash, the canary hash (during
    a rollout), the rollout's state (kept after it ends, for `fleet status`), the hashes rolled
    back (not retried until the spec changes again) and recent rollout events."""

    specs: dict[str, LoadedDeployment]
    stable: str
    canary: str | None = None
    rollout: RolloutState | None = None
    rolled_back: dict[str, float] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, ld: LoadedDeployment) -> Revisions:
        return cls({ld.serving_hash: ld}, ld.serving_hash)

    def machine(self) -> CanaryMachine | None:
        """The state machine of the running rollout (the canary spec's `spec.rollout`), or None."""
        if self.canary is None or self.rollout is None:
            return None
        return CanaryMachine(self.specs[self.canary].deployment.spec.rollout)

    def declare(self, ld: LoadedDeployment, now_s: float, total: int = 0) -> list[str]:
        """The declared spec changed (or was read again): start, continue or end a rollout, or
        replace. ``total``: the deployment's size now (for the notes on per-replica load).
        Returns event lines."""
        h = ld.serving_hash
        if h == self.stable:
            self.specs[h] = ld
            if self.canary is not None and self.rollout is not None:
                machine = self.machine()
                assert machine is not None
                events = machine.abort(self.rollout, now_s, "the spec returned to the stable revision")
                self.canary = None
                return events
            return []
        if h == self.canary:
            self.specs[h] = ld
            return []
        if h in self.rolled_back:
            return [f"revision {revision_label(ld)} was rolled back; not retried until the spec changes again"]
        self.specs[h] = ld
        events = []
        if self.canary is not None:
            events.append(f"rollout of {revision_label(self.specs[self.canary])} superseded by {revision_label(ld)}")
        if ld.deployment.spec.rollout.strategy == "canary":
            self.canary = h
            machine = CanaryMachine(ld.deployment.spec.rollout)
            self.rollout = machine.start(h, self.stable, now_s)
            return events + [f"canary rollout of {revision_label(ld)} over {revision_label(self.specs[self.stable])}",
                             *machine.load_notes(total), *filter(None, [machine.traffic_note()])]
        self.stable, self.canary, self.rollout = h, None, None
        return events + [f"replacing with {revision_label(ld)}"]

    def conclude(self, now_s: float) -> None:
        """After the rollout reached a terminal phase: the canary is stable now, or remembered
        as rolled back."""
        if self.rollout is None or self.canary is None or not self.rollout.phase.terminal():
            return
        if self.rollout.phase is RolloutPhase.PROMOTED:
            self.stable = self.canary
        else:
            self.rolled_back[self.canary] = now_s
        self.canary = None

    def targets(self, total: int) -> dict[str, int]:
        """Replicas wanted per revision (serving hash) for ``total`` (`revision_targets`)."""
        return revision_targets(self, total)

    def prune(self, in_use: set[str]) -> None:
        """Forget specs no replica, stable or canary uses."""
        keep = in_use | {self.stable} | ({self.canary} if self.canary else set())
        for h in [h for h in self.specs if h not in keep]:
            del self.specs[h]

    def to_dict(self) -> dict:
        return {
            "stable": self.stable,
            "canary": self.canary,
            "rollout": self.rollout.to_dict() if self.rollout else None,
            "rolled_back": dict(self.rolled_back),
            "events": list(self.events[-20:]),
            "specs": {h: {"document": ld.deployment.to_document(), "path": str(ld.path), "index": ld.index,
                          "label": revision_label(ld)} for h, ld in self.specs.items()},
        }

    def restore(self, d: dict) -> None:
        """Read back what `to_dict` wrote (specs whose document no longer parses, or whose hash
        differs today, are dropped). Raises KeyError, TypeError or ValueError on a malformed record."""
        for h, rec in (d.get("specs") or {}).items():
            try:
                ld = LoadedDeployment(parse_document(rec["document"]), Path(rec["path"]), int(rec["index"]))
            except SpecError:
                continue
            if ld.serving_hash == h:
                self.specs.setdefault(h, ld)
        if d.get("stable") in self.specs:
            self.stable = d["stable"]
        if d.get("canary") in self.specs and d.get("rollout"):
            self.canary = d["canary"]
            self.rollout = RolloutState.from_dict(d["rollout"])
        elif d.get("rollout"):
            self.rollout = RolloutState.from_dict(d["rollout"])
        self.rolled_back = {str(h): float(t) for h, t in (d.get("rolled_back") or {}).items()}
        self.events = list(d.get("events") or [])


def revision_targets(revs: Revisions, total: int) -> dict[str, int]:
    """Replicas wanted per serving hash: all ``total`` for stable without a rollout; during one,
    stable keeps its share of the current weight (it shrinks only once the canary carries its
    traffic) and the canary gets its share of the weight it is about to take
    (`rollout.machine.CanaryMachine.sizing_weight`: READY before it gets traffic)."""
    machine = revs.machine()
    if machine is None:
        return {revs.stable: total}
    assert revs.rollout is not None and revs.canary is not None
    stable_n, canary_n = replica_targets(total, revs.rollout.weight, machine.sizing_weight(revs.rollout),
                                         machine.spec.surge)  # fmt: skip
    return {revs.stable: stable_n, revs.canary: canary_n}


def endpoint_weights(revs: Revisions, ready_by_hash: Mapping[str, int]) -> dict[str, float]:
    """Router weight of each endpoint of a revision (serving hash -> weight): during a rollout,
    stable ``(100 - w) / its endpoints``, canary ``w / its endpoints``, any other revision 0;
    otherwise 1 for every endpoint (the pool is split by endpoint count, as without revisions)."""
    if revs.canary is None or revs.rollout is None:
        return {h: 1.0 for h in ready_by_hash}
    w = revs.rollout.weight
    out = {h: 0.0 for h in ready_by_hash}
    if ready_by_hash.get(revs.stable):
        out[revs.stable] = (100.0 - w) / ready_by_hash[revs.stable]
    if ready_by_hash.get(revs.canary):
        out[revs.canary] = w / ready_by_hash[revs.canary]
    return out
