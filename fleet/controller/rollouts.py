"""The rollout driver: new specs handed to a running controller, and canary rollouts driven tick
by tick.

Owns `RolloutDriver`, a collaborator of `fleet.controller.reconcile.Controller` that works on the
controller's `fleet.controller.targets.FleetRecords`: it takes changed deployments (`apply`: a
change of what a replica serves starts a revision, other changes apply in place), drives each
running rollout once per tick (`step`: `fleet.rollout.machine.CanaryMachine.advance`, an analysis
run when one is due over the router's per-revision samples, promotion or roll back), and answers
`fleet rollout status|pause|resume|promote|abort` (`command`, `status`). The decisions are the
pure state machine's; this module feeds it facts. It never persists: each method says whether
it changed a target, and the controller saves before the reconcile step acts on it (the new
targets are written in the same tick, before any replica is created or drained). Called by the
controller and, through it, by `fleet.local.up` (the control channel, `fleet.local.control`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fleet.controller.lifecycle import ReplicaStatus
from fleet.controller.targets import DeploymentRecord, FleetRecords
from fleet.rollout.analysis import AnalysisRun, analyse
from fleet.rollout.revisions import AnalysisSource, revision_label, side_samples
from fleet.spec import LoadedDeployment

log = logging.getLogger("fleet.controller")

CANARY_START_FAILURES = 3
"""Canary replicas that fail (to start, warm up, or stay up) before the rollout is rolled back:
a revision that cannot run is not waited on forever."""

COMMANDS = ("status", "pause", "resume", "promote", "abort")


class UnknownDeployment(KeyError):
    """`apply` or `command` named a deployment this controller does not run."""


class RolloutDriver:
    """Drives the revisions of every deployment in ``records``.

    ``clock``: the controller's clock (seconds); ``analysis_source``: where per-request samples
    of the revisions come from (the router's admin API; None: every analysis run is an error
    run); ``on_event(deployment, line)``: told of every rollout event (`fleet up` prints them).
    """

    def __init__(self, records: FleetRecords, clock: Callable[[], float], analysis_source: AnalysisSource | None,
                 on_event: Callable[[str, str], None]) -> None:  # fmt: skip
        self.records = records
        self.clock = clock
        self.analysis_source = analysis_source
        self.on_event = on_event

    # ----- specs handed to a running controller ------------------------------------------------

    def apply(self, loaded: list[LoadedDeployment]) -> list[str]:
        """Take new specs of deployments this controller runs (validated already, e.g. by
        `fleet.spec.load_deployments`). A changed serving hash starts a canary rollout (strategy
        canary) or replaces the revision; replicas, autoscaling and routing apply in place.
        Returns one line per deployment saying what happens; the caller persists.

        Raises UnknownDeployment (nothing applied) when a deployment is not run here, or its
        spec.model.name changed (a new deployment, not a new revision).
        """
        deployments = self.records.deployments
        for ld in loaded:
            name, model = ld.deployment.name, ld.deployment.spec.model.name
            if name not in deployments:
                raise UnknownDeployment(f"deployment {name!r} is not run by this fleet; "
                                        f"running: {', '.join(sorted(deployments)) or '(none)'}")  # fmt: skip
            if model != deployments[name].model:
                raise UnknownDeployment(f"{name}: spec.model.name cannot change on a running deployment "
                                        f"({deployments[name].model!r} -> {model!r}); use a new metadata.name")
        now = self.clock()
        lines = []
        for ld in loaded:
            ds = deployments[ld.deployment.name]
            before = ds.loaded.deployment
            events = self.declare(ds, ld, now)
            in_place = before.spec.model_copy(update={"model": ld.deployment.spec.model,
                                                      "engine": ld.deployment.spec.engine}) != ld.deployment.spec
            what = "; ".join(events) or ("updated in place" if in_place else "unchanged")
            lines.append(f"{ld.deployment.name}: {what}")
        return lines

    def declare(self, ds: DeploymentRecord, ld: LoadedDeployment, now: float) -> list[str]:
        """``ld`` is now the declared spec of ``ds``: the target is clamped to its bounds, its
        pool published again, and its revisions told (a rollout may start). Returns the events."""
        ds.loaded = ld
        ds.target.desired = ds.clamp(ds.target.desired)
        ds.last_pool = None           # routing settings may have changed: publish again
        events = ds.revs.declare(ld, now, ds.desired)
        for line in events:
            self._event(ld.deployment.name, line)
        return events

    def _event(self, deployment: str, line: str) -> None:
        revs = self.records.deployments[deployment].revs
        revs.events = (revs.events + [line])[-20:]
        log.info("deployment %s: %s", deployment, line)
        self.on_event(deployment, line)

    # ----- the tick --------------------------------------------------------------------------

    async def step(self) -> bool:
        """Advance every running rollout once (a failing canary is rolled back, an analysis run
        when due). True when a target changed (the caller persists before scaling)."""
        now = self.clock()
        records = self.records
        changed = False
        for name, ds in records.deployments.items():
            revs = ds.revs
            # A replica not yet started (PENDING, PLACED) still needs its spec to be placed and launched.
            revs.prune({r.spec_hash for r in records.of_deployment(name) if not r.status.terminal()})
            machine = revs.machine()
            state = revs.rollout
            if machine is None or state is None or records.stopping:
                continue
            canary = [r for r in records.of_deployment(name) if r.spec_hash == revs.canary]
            events: list[str] = []
            failed = sum(1 for r in canary if r.status.failed())
            if failed >= CANARY_START_FAILURES:
                events += machine.abort(state, now, f"{failed} canary replicas failed (last: "
                                        f"{max((r for r in canary if r.failure), key=lambda r: r.failure.at_s).failure.reason})")  # type: ignore[union-attr]  # fmt: skip
            ready = sum(1 for r in canary if r.status is ReplicaStatus.READY)
            events += machine.advance(state, now, canary_ready=ready, total=ds.desired)
            if machine.analysis_due(state, now):
                run = await self._analyse(ds, now)
                events += machine.record(state, run, now)
                events += machine.advance(state, now, canary_ready=ready, total=ds.desired)
            if state.phase.terminal():
                revs.conclude(now)
                ds.last_pool = None
            for line in events:
                self._event(name, line)
            changed = changed or bool(events)
        return changed

    async def _analyse(self, ds: DeploymentRecord, now: float) -> AnalysisRun:
        """One analysis run over the router's samples since the last one."""
        revs = ds.revs
        assert revs.rollout is not None and revs.canary is not None
        spec = revs.specs[revs.canary].deployment.spec.rollout.analysis
        window_s = now - revs.rollout.window_from_s
        eligible: dict[str, float] = {}   # endpoint -> samples no older than this count
        for r in self.records.of_deployment(ds.loaded.deployment.name):
            if r.warmup_passed_at_s is not None:
                eligible[r.id] = now - (r.warmup_passed_at_s + spec.exclude_after_ready_seconds)
        labels = {h: revision_label(revs.specs[h]) for h in (revs.stable, revs.canary)}
        if self.analysis_source is None:
            return analyse(spec, None, None, revs.rollout.window_from_s, now)
        try:
            samples = await self.analysis_source.revision_samples(ds.model, window_s)
        except Exception as err:  # noqa: BLE001 - an unreadable signal is an error run, never a failure
            log.warning("deployment %s: cannot read revision samples: %s", ds.loaded.deployment.name, err)
            return analyse(spec, None, None, revs.rollout.window_from_s, now)
        canary = side_samples(samples, labels[revs.canary], window_s, eligible)
        stable = side_samples(samples, labels[revs.stable], window_s, eligible)
        return analyse(spec, canary, stable, revs.rollout.window_from_s, now)

    # ----- fleet rollout ... -----------------------------------------------------------------

    def command(self, deployment: str, command: str) -> tuple[dict, bool]:
        """`fleet rollout COMMAND DEPLOYMENT`: pause, resume, promote or abort the running
        rollout, or just report. Returns (`status` plus ``message``, whether a target changed:
        the caller persists). Raises UnknownDeployment, or ValueError for an unknown command."""
        if command not in COMMANDS:
            raise ValueError(f"unknown rollout command {command!r}; one of {', '.join(COMMANDS)}")
        ds = self.records.deployments.get(deployment)
        if ds is None:
            raise UnknownDeployment(f"deployment {deployment!r} is not run by this fleet")
        revs, now = ds.revs, self.clock()
        machine, state = revs.machine(), revs.rollout
        events: list[str] = []
        changed = False
        if command != "status":
            if machine is None or state is None:
                return {**self.status(deployment), "message": "no rollout in progress"}, False
            action = {"pause": machine.pause, "resume": machine.resume, "promote": machine.promote,
                      "abort": machine.abort}[command]  # fmt: skip
            events = action(state, now)
            if state.phase.terminal():
                revs.conclude(now)
                ds.last_pool = None
            for line in events:
                self._event(deployment, line)
            changed = True
        message = "; ".join(events) or ("" if command == "status" else f"nothing to {command}")
        return {**self.status(deployment), "message": message}, changed

    def status(self, deployment: str) -> dict:
        """JSON-ready: revisions with labels, replicas and weights; the rollout; recent events."""
        ds = self.records.deployments[deployment]
        revs = ds.revs
        pool = {e.id: e for e in (ds.last_pool.endpoints if ds.last_pool else [])}
        revisions = []
        for h, ld in revs.specs.items():
            mine = [r for r in self.records.of_deployment(deployment) if r.spec_hash == h and not r.status.terminal()]
            role = "stable" if h == revs.stable else "canary" if h == revs.canary else "old"
            weight = sum(pool[r.id].weight for r in mine if r.id in pool and not pool[r.id].draining)
            revisions.append({"hash": h, "label": revision_label(ld), "role": role, "replicas": len(mine),
                              "ready": sum(1 for r in mine if r.status is ReplicaStatus.READY),
                              "weight": weight})  # fmt: skip
        total = sum(r["weight"] for r in revisions)
        for r in revisions:   # share of new requests, percent
            r["weight"] = round(100.0 * r["weight"] / total, 2) if total else 0.0
        return {"deployment": deployment, "revisions": revisions,
                "rollout": revs.rollout.to_dict() if revs.rollout else None,
                "rolled_back": sorted(revs.rolled_back), "events": revs.events[-10:]}  # fmt: skip
