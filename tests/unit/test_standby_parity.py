"""The trace simulator's standby lifecycle is `fleet up`'s: the same scaling decisions replayed
through the controller (its real reconcile step, fake backend and engines on fake time) and
through the trace simulator (`fleet.tracesim.engine.Simulation`, its policy replaced by the same
script) give every replica the same life (starting, READY, asleep, woken, stopped) and the same
counts of replicas created and woken. And the pure standby decisions both call
(`fleet.controller.standby`) on hand-checked cases."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from autoscaler.policy import ReplicaBounds, ScalingContext, ScalingDecision
from autoscaler.spec import AutoscalingSpec
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.controller.scale import ScaleStep
from fleet.controller.standby import shape_step, standby_target, trim_and_refill
from fleet.inventory import NodeInventory
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.workload import Workload
from tests.support.controller import Harness, write_deployment
from tests.unit.test_simulate import TINY, trace_of

STARTUP_S = 10.0
"""A new replica's start-up in both: the simulator's warm start-up; the controller's engines are
made healthy this long after their creation."""

SCRIPT: list[tuple[float, int, int | None]] = [
    (0.0, 2, None),    # two serving, the pool (maxReplicas 2) fills with two refills
    (30.0, 3, None),   # wake the oldest sleeper, refill one
    (33.0, 5, None),   # the refill of 30 s still starting: wake the other sleeper, start one, the refill stays a refill
    (60.0, 2, None),   # scale down with the pool full: the READY victims drain
    (90.0, 2, 1),      # the policy wants one sleeper: the newest one stops
    (120.0, 1, 1),     # scale down, pool full: drained
    (150.0, 1, 2),     # the pool short again: a refill starts, sleeps once READY
]
"""(at seconds, desired replicas, standby replicas the policy wants; None: the spec's maximum)."""

END_S = 190.0


def wanted_at(t_s: float) -> tuple[int, int | None]:
    return next((d, w) for at, d, w in reversed(SCRIPT) if at <= t_s + 1e-9)


def coarse(status: S) -> str | None:
    """The controller's statuses as the simulator has them (it passes PENDING..WARMING in no
    time); DRAINING is left out (the simulator stops a replica with nothing in flight at once)."""
    if status in (S.PENDING, S.PLACED, S.PULLING, S.CACHING, S.STARTING, S.WARMING):
        return "STARTING"
    return None if status is S.DRAINING else status.value


def lives(samples: list[list[S]]) -> list[list[str]]:
    """Per replica (creation order), its coarse statuses in order, repeats collapsed."""
    out: list[list[str]] = []
    for sample in samples:
        for i, status in enumerate(sample):
            if i == len(out):
                out.append([])
            c = coarse(status)
            if c is not None and (not out[i] or out[i][-1] != c):
                out[i].append(c)
    return out


@dataclass
class Scripted:
    """A scaling policy that answers `SCRIPT` and samples the simulation's replicas every tick."""

    sim: Simulation | None = None
    interval_s: float = 1.0
    name: str = "scripted"

    def __post_init__(self) -> None:
        self.samples: list[list[S]] = []

    def decide(self, ctx: ScalingContext) -> ScalingDecision:
        assert self.sim is not None
        self.samples.append([r.status for r in self.sim.replicas])
        desired, standby = wanted_at(ctx.now_s)
        return ScalingDecision(ctx.now_s, ctx.desired, desired, "scripted", "", standby=standby)

    def take_background(self) -> None:
        return None


def run_simulator() -> tuple[list[list[str]], int, int]:
    """(lives, replicas created, wakes) of the script through the trace simulator."""
    cfg = SimConfig(TINY, AutoscalingSpec(), ReplicaBounds(0, 8, 2), warm_startup_s=STARTUP_S,
                    cold_startup_s=STARTUP_S, standby_max=2, wake_s=1.5)  # fmt: skip
    sim = Simulation(cfg, Workload.from_trace(trace_of((END_S, 0.5)), TINY))
    policy = Scripted(sim)
    sim.policy = policy  # type: ignore[assignment]
    result = sim.run()
    return lives(policy.samples), len(sim.replicas), len(result.wakes)


async def run_controller(tmp_path: Path) -> tuple[list[list[str]], int, int]:
    """(lives, replicas created, wakes) of the script through `fleet up`'s controller."""
    node = NodeInventory(name="n", cpu_cores=tuple(range(16)))
    f = write_deployment(tmp_path, replicas=2, engine={"kind": "sim"}, standby={"maxReplicas": 2})
    h = Harness(tmp_path, [f], node=node)
    start_s = h.clock()
    ds = h.c.deployments["chat"]
    samples: list[list[S]] = []
    woken: set[tuple[str, float]] = set()
    for second in range(int(END_S)):
        now_s = h.clock() - start_s
        desired, standby = wanted_at(now_s)
        h.c.set_desired("chat", desired)
        ds.standby_wanted = standby
        await h.tick()
        for r in h.c.replicas.values():
            initial = r.id in ("chat-0", "chat-1")   # the simulator's first replicas serve at 0 s
            if (r.engine_alive and r.drain_requested_at_s is None and r.healthy_at_s is None
                    and (initial or h.clock() - r.created_at_s >= STARTUP_S)):  # fmt: skip
                h.make_healthy(r.id)
            if r.woke_at_s is not None:
                woken.add((r.id, r.woke_at_s))
        samples.append([r.status for r in h.c.replicas.values()])
    out = lives(samples)
    for life in out[:2]:   # the first replicas: READY at 0 s in the simulator, a tick later here
        if life[:1] == ["STARTING"]:
            life.pop(0)
    return out, len(h.c.replicas), len(woken)


async def test_the_simulator_and_the_controller_live_the_same_standby_lifecycle(tmp_path: Path) -> None:
    sim_lives, sim_created, sim_wakes = run_simulator()
    ctl_lives, ctl_created, ctl_wakes = await run_controller(tmp_path)
    assert sim_created == ctl_created and sim_wakes == ctl_wakes == 2
    assert sim_lives == ctl_lives
    # The refill started at 30 s (the fifth replica) sleeps once READY, though a scale-up came while
    # it started: it is not turned into a serving replica.
    assert sim_lives[4] == ["STARTING", "STANDBY"]


# ----- the pure decisions, by hand -------------------------------------------------------------


@dataclass(frozen=True)
class R:
    name: str
    status: S


def test_a_scale_up_wakes_the_oldest_sleepers_before_it_creates() -> None:
    asleep = [R("a", S.STANDBY), R("b", S.STANDBY)]
    left, wake, sleep = shape_step(ScaleStep(create=3), asleep, target=2)
    assert [r.name for r in wake] == ["a", "b"] and left.create == 1 and not sleep


def test_a_scale_down_sleeps_ready_victims_while_the_pool_is_short_and_drains_the_rest() -> None:
    victims = [R("starting", S.STARTING), R("r1", S.READY), R("r2", S.READY)]
    left, wake, sleep = shape_step(ScaleStep(drain=victims), [R("z", S.STANDBY)], target=2)
    assert [r.name for r in sleep] == ["r1"]                    # room for one; a starting replica never sleeps
    assert [r.name for r in left.drain] == ["starting", "r2"] and not wake
    full, _, none = shape_step(ScaleStep(drain=victims), [R("y", S.STANDBY), R("z", S.STANDBY)], target=2)
    assert not none and full.drain == victims


def test_the_pool_is_trimmed_sleepers_first_then_refills_newest_first_and_refilled_when_short() -> None:
    asleep = [R("s1", S.STANDBY), R("s2", S.STANDBY), R("s3", S.STANDBY)]
    refills = [R("f1", S.STARTING), R("f2", S.STARTING)]
    drain, create = trim_and_refill(asleep, refills, target=2)
    assert [r.name for r in drain] == ["s3", "f2", "f1"] and create == 0
    drain, create = trim_and_refill(asleep[:1], refills[:1], target=3)
    assert drain == [] and create == 1


@pytest.mark.parametrize(("most", "wanted", "kept"), [(2, None, 2), (2, 1, 1), (2, 5, 2), (2, -1, 0), (0, 3, 0)])
def test_the_standby_target_is_the_policys_within_the_allowance(most: int, wanted: int | None, kept: int) -> None:
    assert standby_target(most, wanted) == kept
