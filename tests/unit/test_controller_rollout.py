"""Canary rollouts in the controller, on fake time with the fake backend, engines and router:
a changed spec handed to the running controller starts a canary revision whose replicas are
READY before they get traffic, weights step through with the split following them, analysis over
the router's per-revision samples promotes a good canary and rolls back a slow one (remembered,
not retried), the deployment never has fewer READY replicas than it wants, a restarted controller
carries on, and `fleet rollout` commands act."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import yaml

from fleet.controller.reconcile import Controller, ControllerSettings
from fleet.inventory import NodeInventory
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.rollout.revisions import RequestSample
from fleet.spec import load_deployments
from fleet.rollout.machine import RolloutPhase
from tests.support.controller import ControllerHarness
from tests.support.fakes import FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink

NODE = NodeInventory(name="n", cpu_cores=tuple(range(16)))
MODEL = "chat-model"

CANARY = {
    "strategy": "canary",
    "steps": [{"weight": 25}, {"analysis": {}}, {"weight": 50}, {"analysis": {}}],
    "analysis": {"intervalSeconds": 60, "minSamplesPerSide": 20, "excludeAfterReadySeconds": 10,
                 "failureLimit": 0},
}


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


def write(tmp_path: Path, revision: str = "v1", rollout: dict | None = None, replicas: int = 4,
          args: list[str] | None = None) -> Path:  # fmt: skip
    (tmp_path / "models" / "m").mkdir(parents=True, exist_ok=True)
    spec = {"model": {"name": MODEL, "source": "./models/m", "revision": revision},
            "engine": {"args": args or []}, "resources": {"accelerator": "cpu"},
            "replicas": {"min": 1, "max": 8, "initial": replicas},
            "rollout": copy.deepcopy(rollout if rollout is not None else CANARY)}  # fmt: skip
    f = tmp_path / "chat.yaml"
    f.write_text(yaml.safe_dump({"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
                                 "metadata": {"name": "chat"}, "spec": spec}))  # fmt: skip
    return f


class FakeRouterSamples:
    """The router's per-revision samples: each non-draining endpoint of the published pool
    with a weight serves `per_endpoint_s` requests a second; requests of a revision whose label
    starts with a key of `ttft_factor` take that much longer; `errors` the same for failures."""

    def __init__(self, pools: FakePoolSink) -> None:
        self.pools = pools
        self.ttft_factor: dict[str, float] = {}
        self.error_share: dict[str, float] = {}
        self.per_endpoint_s = 1.0
        self.fail = False
        self.windows: list[float] = []
        self.rng = random.Random(7)

    async def revision_samples(self, model: str, window_s: float) -> list[RequestSample]:
        self.windows.append(window_s)
        if self.fail:
            raise RuntimeError("router unreachable")
        out = []
        for e in self.pools.pools.get(model, []):
            if e.draining or e.weight <= 0:
                continue
            factor = next((f for k, f in self.ttft_factor.items() if e.version.startswith(k)), 1.0)
            err = next((f for k, f in self.error_share.items() if e.version.startswith(k)), 0.0)
            for i in range(int(window_s * self.per_endpoint_s)):
                ttft = 0.2 * factor * (1 + self.rng.random() * 0.05)
                failed = self.rng.random() < err
                out.append(RequestSample(e.version, e.id, float(i) / self.per_endpoint_s, None if failed else ttft,
                                         0.02, ttft + 1.0, 0.0, failed))  # fmt: skip
        return out


class Fleet(ControllerHarness):
    def __init__(self, tmp_path: Path, file: Path) -> None:
        self.tmp_path, self.file = tmp_path, file
        self.clock = FakeClock()
        self.backend = FakeBackend(NODE)
        self.engines = FakeEngineAPI()
        self.pools = FakePoolSink()
        self.router = FakeRouterSamples(self.pools)
        self.saved: dict | None = None
        self.lines: list[str] = []
        self.min_ready = 10**9
        self.c = self.controller()

    def controller(self) -> Controller:
        fleet = self

        class Sink:
            def save(self, snapshot: dict) -> None:
                fleet.saved = copy.deepcopy(snapshot)

        return Controller(load_deployments([self.file]), backend=self.backend, engine_api=self.engines,
                          pool_sink=self.pools, clock=self.clock, sleep=self.clock.sleep, state_sink=Sink(),
                          settings=ControllerSettings(drain_timeout_s=30), analysis_source=self.router,
                          on_rollout_event=lambda d, line: self.lines.append(line))  # fmt: skip

    async def after_tick(self) -> None:
        for p in self.backend.procs.values():
            if "--bogus-flag" not in p.spec.argv:               # an engine that cannot start never answers
                self.engines.healthy.add(p.spec.port)
        self.min_ready = min(self.min_ready, len(self.serving()))

    def serving(self) -> list:
        return [e for e in self.pools.pools.get(MODEL, []) if not e.draining]

    def versions(self) -> dict[str, float]:
        """label -> share of new requests (percent) in the published pool."""
        out: dict[str, float] = {}
        for e in self.serving():
            out[e.version.split("@")[0]] = out.get(e.version.split("@")[0], 0.0) + e.weight
        total = sum(out.values())
        return {k: round(100 * v / total, 1) for k, v in out.items() if v > 0}

    def replicas(self, status: S = S.READY) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.c.replicas.values():
            if r.status is status:
                out[r.revision] = out.get(r.revision, 0) + 1
        return out

    async def up(self) -> None:
        await self.tick(4)
        assert self.replicas() == {"v1": 4}
        self.min_ready = 4

    def apply(self, **kwargs) -> list[str]:
        return self.c.apply(load_deployments([write(self.tmp_path, **kwargs)]))

    @property
    def rollout(self):
        return self.c.deployments["chat"].revs.rollout


async def test_a_good_canary_warms_before_traffic_steps_through_the_weights_and_is_promoted(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    assert f.apply(revision="v2") == ["chat: canary rollout of v2@" + f.c.deployments["chat"].revs.canary[:8]
                                      + " over v1@" + f.c.deployments["chat"].revs.stable[:8]
                                      + "; note: the analysis needs at least 1.3 streamed req/s to this deployment, "
                                      "steadily (at weight 25 %: minSamplesPerSide 20 / (intervalSeconds 60 x 25 %)); "
                                      "with less, runs are inconclusive"]
    assert f.saved["deployments"]["chat"]["revisions"]["canary"] is not None      # persisted before acting
    await f.tick()
    assert f.replicas(S.READY) == {"v1": 4} and f.versions() == {"v1": 100.0}   # the canary is not READY yet
    await f.tick(3)
    assert f.replicas() == {"v1": 3, "v2": 1} and f.versions() == {"v1": 75.0, "v2": 25.0}
    assert f.pools.settings[MODEL].endpoints[0].version.startswith("v1@")
    await f.tick(60)                                                         # one analysis run: pass
    assert f.rollout.passes == 1 and f.rollout.runs[-1]["verdict"] == "pass"
    await f.tick(4)
    assert f.versions() == {"v1": 50.0, "v2": 50.0} and f.replicas() == {"v1": 2, "v2": 2}
    await f.tick(60)
    assert f.rollout.phase is RolloutPhase.PROMOTED
    await f.tick(40)
    assert f.replicas() == {"v2": 4} and f.versions() == {"v2": 100.0}
    assert not [r for r in f.c.replicas.values() if r.revision == "v1" and r.engine_alive]
    assert f.min_ready >= 4                                   # never fewer READY replicas than wanted
    assert any(line.startswith("promoted: every step passed") for line in f.lines)
    revs = f.c.deployments["chat"].revs
    assert revs.canary is None and set(revs.specs) == {revs.stable}


async def test_a_slow_canary_is_rolled_back_drained_remembered_and_not_retried(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    f.router.ttft_factor["v2"] = 1.5
    f.apply(revision="v2")
    await f.tick(4)
    assert f.versions() == {"v1": 75.0, "v2": 25.0}
    await f.tick(60)
    assert f.rollout.phase is RolloutPhase.ROLLED_BACK
    assert "ttftP99: canary" in f.rollout.reason and "> limit" in f.rollout.reason
    run = f.rollout.runs[-1]
    check = next(c for c in run["checks"] if c["metric"] == "ttftP99")
    assert check["verdict"] == "fail" and check["canary_samples"] >= 20 and check["limit"] == pytest.approx(
        check["stable"] * 1.2)
    assert f.versions() == {"v1": 100.0}                      # weight 0 at once
    canary = [r for r in f.c.replicas.values() if r.revision == "v2"]
    assert all(r.status in (S.DRAINING, S.TERMINATED) for r in canary)
    f.pools.in_flight_by_id = {}
    await f.tick(10)
    assert f.replicas() == {"v1": 4} and all(r.status is S.TERMINATED for r in canary)
    assert f.min_ready >= 3
    lines = f.apply(revision="v2")                            # the same spec again: not retried
    assert lines == [f"chat: revision v2@{canary[0].spec_hash[:8]} was rolled back; not retried until the spec "
                     "changes again"]
    await f.tick(5)
    assert f.replicas() == {"v1": 4}
    f.apply(revision="v3")                                    # a new spec: a new rollout
    await f.tick(4)
    assert f.replicas() == {"v1": 3, "v3": 1}


async def test_an_unreadable_signal_is_an_error_and_too_little_traffic_never_promotes(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    f.apply(revision="v2")
    await f.tick(4)
    f.router.fail = True
    await f.tick(60)
    assert f.rollout.runs[-1]["verdict"] == "error" and f.rollout.phase is RolloutPhase.PROGRESSING
    f.router.fail = False
    f.router.per_endpoint_s = 0.1                             # 6 canary requests a minute: too few
    await f.tick(180)
    assert {r["verdict"] for r in f.rollout.runs[-3:]} == {"inconclusive"}
    assert f.rollout.phase is RolloutPhase.PROGRESSING and f.versions() == {"v1": 75.0, "v2": 25.0}


async def test_requests_of_a_replica_just_ready_are_left_out_of_the_analysis(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    f.router.ttft_factor["v2"] = 3.0
    f.apply(revision="v2")
    await f.tick(4)
    # Only the first 10 s after the canary replica's READY are slow: its cache was cold.
    canary = next(r for r in f.c.replicas.values() if r.revision == "v2")
    ready_s = canary.warmup_passed_at_s
    slow = FakeRouterSamples.revision_samples

    async def cold_start_only(self, model, window_s):
        out = await slow(self, model, window_s)
        now = f.clock()
        return [s if s.version.startswith("v1") or now - s.age_s < ready_s + 10 else
                RequestSample(s.version, s.endpoint, s.age_s, 0.2, s.tpot_s, s.e2e_s, 0.0, False) for s in out]

    f.router.revision_samples = cold_start_only.__get__(f.router)
    await f.tick(60)
    assert f.rollout.runs[-1]["verdict"] == "pass", f.rollout.runs[-1]


async def test_a_restarted_controller_carries_on_the_rollout_and_adopts_both_revisions(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    f.apply(revision="v2")
    await f.tick(4)
    pids = {p.spec.replica_id for p in f.backend.procs.values() if p.exit_code is None}
    f.c = f.controller()                                      # kill -9; files now say v2 (fleet apply wrote it)
    await f.c.start(f.saved)
    assert f.rollout.weight == 25 and f.rollout.step_index == 1
    await f.tick(2)
    assert {p.spec.replica_id for p in f.backend.procs.values() if p.exit_code is None} >= pids - {
        r for r in pids if f.c.replicas[r].status is S.DRAINING}
    assert f.versions() == {"v1": 75.0, "v2": 25.0}
    await f.tick(130)
    assert f.rollout.phase is RolloutPhase.PROMOTED
    write(tmp_path, revision="v1")                            # and back: a restart on the old file
    f.c = f.controller()
    await f.c.start(f.saved)
    revs = f.c.deployments["chat"].revs
    assert revs.canary is not None and f.c.deployments["chat"].revs.rollout.phase is RolloutPhase.PROGRESSING


async def test_a_restart_on_the_stable_file_aborts_the_canary(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    f.apply(revision="v2")
    await f.tick(4)
    write(tmp_path, revision="v1")
    f.c = f.controller()
    await f.c.start(f.saved)
    assert f.rollout.phase is RolloutPhase.ROLLED_BACK and "returned to the stable revision" in f.rollout.reason
    await f.tick(10)
    assert f.replicas() == {"v1": 4}


async def test_rollout_commands_pause_resume_promote_abort_and_status(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    assert f.c.rollout_command("chat", "pause")["message"] == "no rollout in progress"
    f.apply(revision="v2")
    await f.tick(4)
    out = f.c.rollout_command("chat", "pause")
    assert out["message"] == "paused" and out["rollout"]["phase"] == "Paused"
    await f.tick(130)                                         # analysis passes, steps wait
    assert f.versions() == {"v1": 75.0, "v2": 25.0} and f.rollout.passes >= 2
    f.c.rollout_command("chat", "resume")
    await f.tick(3)
    assert f.versions() == {"v1": 50.0, "v2": 50.0}
    status = f.c.rollout_command("chat", "status")
    roles = {r["role"]: r for r in status["revisions"]}
    assert roles["canary"]["weight"] == 50.0 and roles["stable"]["ready"] == 2 and status["message"] == ""
    assert f.c.rollout_command("chat", "promote")["message"] == "promoted: promoted by hand"
    await f.tick(10)
    assert f.replicas() == {"v2": 4}
    f.apply(revision="v3")
    await f.tick(4)
    assert f.c.rollout_command("chat", "abort")["message"] == "rolled back: aborted by hand"
    await f.tick(5)
    assert f.replicas() == {"v2": 4}
    with pytest.raises(ValueError, match="unknown rollout command"):
        f.c.rollout_command("chat", "restart")
    with pytest.raises(KeyError, match="not run by this fleet"):
        f.c.rollout_command("other", "status")


async def test_replace_applied_at_runtime_keeps_old_replicas_until_new_ones_are_ready(tmp_path):
    f = Fleet(tmp_path, write(tmp_path, rollout={"strategy": "replace"}))
    await f.up()
    assert f.apply(revision="v2", rollout={"strategy": "replace"})[0].startswith("chat: replacing with v2@")
    await f.tick()
    assert f.replicas() == {"v1": 4}
    await f.tick(8)
    assert f.replicas() == {"v2": 4} and f.min_ready >= 4


async def test_in_place_changes_make_no_revision_and_bad_applies_change_nothing(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    assert f.apply() == ["chat: unchanged"]
    other = copy.deepcopy(CANARY)
    other["analysis"]["failureLimit"] = 2
    assert f.apply(rollout=other) == ["chat: updated in place"]
    assert f.c.deployments["chat"].revs.canary is None
    doc = yaml.safe_load(write(tmp_path).read_text())
    doc["spec"]["model"]["name"] = "renamed"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(KeyError, match="spec.model.name cannot change"):
        f.c.apply(load_deployments([tmp_path / "bad.yaml"]))
    doc["metadata"]["name"] = "stranger"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(doc))
    with pytest.raises(KeyError, match="'stranger' is not run by this fleet"):
        f.c.apply(load_deployments([tmp_path / "bad.yaml"]))


async def test_a_canary_that_cannot_start_is_rolled_back(tmp_path):
    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    f.apply(args=["--bogus-flag"])                            # an engine change: a new revision
    for _ in range(6):
        if f.rollout.phase is RolloutPhase.ROLLED_BACK:
            break
        await f.tick()
        for r in f.c.replicas.values():
            if r.spec_hash == f.c.deployments["chat"].revs.canary and r.engine_alive:
                f.backend.exit(r.id, 2, "error: unrecognized arguments: --bogus-flag")
        await f.tick(n=1, seconds=400)                        # past the replacement back-off
    assert f.rollout.phase is RolloutPhase.ROLLED_BACK and "canary replicas failed" in f.rollout.reason
    assert f.replicas() == {"v1": 4}


async def test_rollout_metrics_show_weights_phase_verdicts_and_the_last_checks(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from fleet.rollout.metrics import RolloutCollector

    f = Fleet(tmp_path, write(tmp_path))
    await f.up()
    registry = CollectorRegistry()
    registry.register(RolloutCollector(f.c))
    text = generate_latest(registry).decode()
    assert 'fleet_rollout_weight_percent{deployment="chat",revision="v1@' in text and "fleet_rollout_phase{" not in text
    f.apply(revision="v2")
    await f.tick(4)
    await f.tick(60)
    lines = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in generate_latest(registry).decode().splitlines()
             if ln.startswith("fleet_rollout")}  # fmt: skip
    canary = next(k for k in lines if k.startswith("fleet_rollout_weight_percent") and 'role="canary"' in k)
    assert lines[canary] == 25.0
    assert lines['fleet_rollout_phase{deployment="chat",phase="Progressing"}'] == 1.0
    assert lines['fleet_rollout_analysis_runs_total{deployment="chat",verdict="pass"}'] == 1.0
    assert lines['fleet_rollout_check_passed{deployment="chat",kind="relative",metric="ttftP99"}'] == 1.0
    assert lines['fleet_rollout_check_samples{deployment="chat",kind="relative",metric="ttftP99",side="canary"}'] >= 20
    assert 0.2 <= lines['fleet_rollout_check_value{deployment="chat",kind="relative",metric="ttftP99",side="stable"}'] < 0.3


async def test_without_surge_a_full_machine_makes_room_for_the_canary(tmp_path):
    from fleet.inventory import NodeInventory as Node

    rollout = {**copy.deepcopy(CANARY), "surge": False}
    f = Fleet(tmp_path, write(tmp_path, rollout=rollout, replicas=2))
    f.backend.nodes = (Node(name="n", cpu_cores=(0, 1)),)      # room for two replicas, no more
    await f.tick(4)
    assert f.replicas() == {"v1": 2}
    f.apply(revision="v2", rollout=rollout, replicas=2)
    f.min_ready = 10**9
    await f.tick(6)
    assert f.replicas() == {"v1": 1, "v2": 1} and f.versions() == {"v1": 75.0, "v2": 25.0}
    await f.tick(130)
    assert f.rollout.phase is RolloutPhase.PROMOTED
    await f.tick(10)
    assert f.replicas() == {"v2": 2}
    assert f.min_ready >= 1                                   # one replica kept serving throughout
