"""The trace simulator's preemption scenario: deployments of different priorities competing for the
GPUs of an inventory, in virtual time, through the very objects the controller uses.

Owns `SimDeployment` (one deployment: priority, preemptibility, shape, its minimum and desired
replica counts over time, how many of its starts crash), `PreemptionSimConfig`,
`PreemptionSimulation` (one tick event on the shared loop, `fleet.tracesim.events`) and
`PreemptionOutcome` (what happened), and
`demo_config` (the scenario of docs/placement.md: a chat deployment's minimum rises on a full
8-GPU node held by a batch and a scratch deployment, and its first replicas crash on start).

What runs for real, as in the controller (`fleet.controller.reconcile`, `fleet.controller.preemption`):
the scale step (`fleet.controller.scale.scale_step`), placement (`fleet.placement.get_strategy`:
`place_replicas` over a real `fleet.inventory.Inventory`, devices held off added to ``in_use``),
the preemption policy (`fleet.placement.preemption.PreemptionPolicy.decide`) and the hold-offs
(`fleet.placement.preemption.HoldOffs`); each replica is the controller's own record
(`fleet.controller.lifecycle.Replica`), its status derived from the facts recorded in it.
Modelled: a placed replica is READY ``startup_s`` later (the replicas placed at 0 s are READY
at once), unless it is one of the deployment's first ``crash_starts`` starts (it fails ``crash_after_s``
after placement, and the next replica is created ``backoff_s`` later); a READY replica asked to
go drains for ``drain_s`` (its in-flight requests), one not yet READY stops at once. Not
modelled: requests and the router (the request-level simulator is `fleet.tracesim.engine`).
No I/O, no clock: one tick is ``tick_s`` virtual seconds; the same config gives the same outcome.
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fleet.controller.lifecycle import Replica, ReplicaStatus
from fleet.controller.scale import scale_step
from fleet.tracesim.events import FIRST_OWN_KIND, EventLoop
from fleet.inventory import Gpu, Inventory, NodeInventory
from fleet.placement import PlacementRequest, ReplicaPlacement, ReplicaShape, get_strategy
from fleet.placement.preemption import DEFAULT_HOLD_OFF_S, Holder, HoldOffs, PreemptionPolicy, Standing

_PROGRESS = {s: i for i, s in enumerate(ReplicaStatus)}
_HOLDING = (ReplicaStatus.STARTING, ReplicaStatus.READY, ReplicaStatus.DRAINING)
_TICK = FIRST_OWN_KIND


@dataclass(frozen=True)
class SimDeployment:
    """One deployment. ``minimum`` and ``desired``: ``(from_s, count)`` steps (the count holds
    from ``from_s`` on; before the first step, 0); the target at a time is the larger of the two,
    as the controller clamps ``desired`` to ``spec.replicas.min``."""

    name: str
    priority: int = 0
    preemptible: bool = False
    gpu_product: str | None = None
    tensor_parallel_size: int = 1
    minimum: tuple[tuple[float, int], ...] = ()
    desired: tuple[tuple[float, int], ...] = ()
    crash_starts: int = 0

    def minimum_at(self, t_s: float) -> int:
        return _step_value(self.minimum, t_s)

    def want_at(self, t_s: float) -> int:
        return max(self.minimum_at(t_s), _step_value(self.desired, t_s))


def _step_value(steps: tuple[tuple[float, int], ...], t_s: float) -> int:
    i = bisect.bisect_right([s for s, _ in steps], t_s)
    return steps[i - 1][1] if i else 0


@dataclass(frozen=True)
class PreemptionSimConfig:
    """The scenario: ``deployments`` in declaration order (creation order at a tie), the nodes,
    and the modelled times (seconds)."""

    deployments: tuple[SimDeployment, ...]
    inventory: Inventory
    duration_s: float = 1200.0
    tick_s: float = 1.0
    startup_s: float = 60.0
    drain_s: float = 20.0
    crash_after_s: float = 30.0
    backoff_s: float = 10.0
    hold_off_s: float = DEFAULT_HOLD_OFF_S
    flap_window_s: float = 600.0      # a lower priority placed on a device freed for a higher one within this: a flap
    strategy: str = "fleet"


@dataclass
class _Replica:
    """One replica of the scenario: ``record``, the controller's record of what happened to it
    (its `status` derives from the facts recorded there), and the scenario's plan for it:
    ``index`` (creation order over all deployments), ``placement`` (its devices), when it is
    due READY, when it crashes on start, when its drain ends (virtual seconds)."""

    record: Replica
    index: int
    placement: ReplicaPlacement | None = None
    ready_at_s: float | None = None
    crash_at_s: float | None = None
    drain_until_s: float | None = None

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def deployment(self) -> str:
        return self.record.deployment

    @property
    def status(self) -> ReplicaStatus:
        return self.record.status

    def place(self, placement: ReplicaPlacement, t_s: float) -> None:
        """Placed on ``placement`` and launched; image and weights are on the node at once."""
        r = self.record
        self.placement = placement
        r.placed_at_s = r.launched_at_s = r.image_ready_at_s = r.weights_ready_at_s = t_s

    def ready(self, t_s: float) -> None:
        """Healthy and warmed up: READY."""
        self.record.healthy_at_s = self.record.warmup_passed_at_s = t_s

    def stop(self, t_s: float) -> None:
        """Asked to stop and gone: TERMINATED."""
        self.record.stop_requested_at_s = self.record.exited_at_s = t_s


@dataclass
class _State:
    spec: SimDeployment
    replicas: list[_Replica] = field(default_factory=list)
    next_index: int = 0
    next_create_s: float = 0.0
    crashes_left: int = 0


@dataclass
class PreemptionOutcome:
    """What happened. Per deployment: ``below_minimum_s`` (virtual seconds with fewer READY
    replicas than its minimum), ``ready_replica_s`` (READY replica-seconds), ``preempted``
    (its replicas drained for another), ``preempted_for`` (replicas drained for it), ``flaps``
    (its replicas placed, within ``flap_window_s``, on a device a preemption freed for a
    deployment of higher priority: capacity taken back from the one it was given up to),
    ``time_to_minimum_s`` (from its minimum's last rise to READY at that minimum; None if never).
    ``events``: ``(t_s, line)`` for every preemption, crash and flap."""

    deployments: dict[str, dict[str, Any]]
    preemptions: int
    flaps: int
    events: list[tuple[float, str]]

    def to_dict(self) -> dict[str, Any]:
        return {"deployments": self.deployments, "preemptions": self.preemptions, "flaps": self.flaps,
                "events": [list(e) for e in self.events]}  # fmt: skip


class PreemptionSimulation:
    """Runs a `PreemptionSimConfig` (the module docstring says what is real and what modelled)."""

    def __init__(self, config: PreemptionSimConfig) -> None:
        self.config = config
        self.placer = get_strategy(config.strategy)
        self.policy = PreemptionPolicy(self.placer)
        self.holds = HoldOffs(config.hold_off_s)
        self.states = {d.name: _State(d, crashes_left=d.crash_starts) for d in config.deployments}
        self.order = 0
        self.events: list[tuple[float, str]] = []
        self.stats = {d.name: {"below_minimum_s": 0.0, "ready_replica_s": 0.0, "preempted": 0, "preempted_for": 0,
                               "flaps": 0, "time_to_minimum_s": None} for d in config.deployments}  # fmt: skip
        self._rose_at: dict[str, float] = {}
        self._freed: dict[str, tuple[float, int, str]] = {}   # device -> (when, priority, deployment) it was freed for
        self.loop = EventLoop()
        self.loop.on(_TICK, self._tick)

    def run(self) -> PreemptionOutcome:
        """Run the scenario from 0 s to ``duration_s``, one tick every ``tick_s``."""
        self.loop.push(0.0, _TICK)
        self.loop.run(lambda: False)
        stats = {name: dict(s) for name, s in self.stats.items()}
        return PreemptionOutcome(stats, sum(s["preempted"] for s in stats.values()),
                                 sum(s["flaps"] for s in stats.values()), list(self.events))  # fmt: skip

    # ----- one tick -----------------------------------------------------------------------------

    def _tick(self, _: object, t: float) -> None:
        """The controller's steps at ``t``, in its order; the next tick follows ``tick_s`` later."""
        self._advance(t)
        self._scale(t)
        self._place(t)
        self._measure(t)
        if t + self.config.tick_s <= self.config.duration_s:
            self.loop.push(t + self.config.tick_s, _TICK)

    def _advance(self, t: float) -> None:
        for st in self.states.values():
            for r in st.replicas:
                if r.status is ReplicaStatus.STARTING and r.crash_at_s is not None and t >= r.crash_at_s:
                    r.record.fail(ReplicaStatus.FAILED_START, "crashed on start", t)
                    st.next_create_s = t + self.config.backoff_s
                    self.events.append((t, f"{r.id} crashed on start ({', '.join(r.placement.devices)} free)"))
                elif r.status is ReplicaStatus.STARTING and r.ready_at_s is not None and t >= r.ready_at_s:
                    r.ready(t)
                elif r.status is ReplicaStatus.DRAINING and t >= r.drain_until_s:  # type: ignore[operator]
                    r.stop(t)

    def _scale(self, t: float) -> None:
        for name, st in self.states.items():
            active = [r for r in st.replicas if r.status.counts_toward_desired()]
            step = scale_step(active, st.spec.want_at(t), lambda r: r.index)   # the controller's scale step
            if step.create and t >= st.next_create_s:
                for _ in range(step.create):
                    st.replicas.append(_Replica(Replica(f"{name}-{st.next_index}", name, "sim", t), self._next()))
                    st.next_index += 1
            for r in step.drain:
                self._drain(r, t)

    def _drain(self, r: _Replica, t: float, preempted_for: str | None = None) -> None:
        r.record.preempted_for = preempted_for
        if r.status is ReplicaStatus.READY:
            r.record.drain_requested_at_s, r.drain_until_s = t, t + self.config.drain_s
        else:
            r.stop(t)   # never served: stops at once, frees its devices now

    def _holding(self) -> dict[str, _Replica]:
        return {r.id: r for st in self.states.values() for r in st.replicas if r.status in _HOLDING}

    def _place(self, t: float) -> None:
        c = self.config
        holding = self._holding()
        in_use: Counter[str] = Counter(d for r in holding.values() for d in r.placement.devices)
        pending = {name: [r for r in st.replicas if r.status is ReplicaStatus.PENDING]
                   for name, st in self.states.items()}  # fmt: skip
        for name in sorted((n for n, rs in pending.items() if rs), key=lambda n: pending[n][0].index):
            st, waiting = self.states[name], pending[name]
            spec = st.spec
            shape = ReplicaShape(gpu_product=spec.gpu_product, tensor_parallel_size=spec.tensor_parallel_size)
            existing = tuple(r.placement for r in st.replicas if r.status in _HOLDING)
            request = PlacementRequest(shape, len(waiting), name, existing)
            blocked = self.holds.blocked(name, spec.priority, t)
            plan = self.placer.place_replicas(request, c.inventory, in_use + blocked)
            for r, p in zip(waiting, plan.placements):
                r.place(p, t)
                r.ready_at_s = t + c.startup_s
                if t == 0:
                    r.ready(t)      # the fleet as it runs when the scenario starts
                if st.crashes_left > 0:
                    st.crashes_left -= 1
                    r.crash_at_s = t + c.crash_after_s
                in_use.update(p.devices)
                holding[r.id] = r
                back = [d for d in p.devices if (f := self._freed.get(d)) is not None
                        and t - f[0] <= c.flap_window_s and f[1] > spec.priority and f[2] != name]  # fmt: skip
                if back:
                    self.stats[name]["flaps"] += 1
                    self.events.append((t, f"FLAP {r.id} placed on {', '.join(back)}, freed for "
                                           f"{self._freed[back[0]][2]} at {self._freed[back[0]][0]:.0f} s"))
            unplaced = len(waiting) - len(plan.placements)
            if unplaced:
                self._preempt(name, PlacementRequest(shape, unplaced, name, existing), in_use + blocked, holding, t)
        self.holds.expire(t)

    def _preempt(self, name: str, request: PlacementRequest, in_use: Counter[str], holding: dict[str, _Replica],
                 t: float) -> None:  # fmt: skip
        standings = {}
        for n, st in self.states.items():
            active = sum(1 for r in st.replicas if r.id in holding and r.status.counts_toward_desired())
            standings[n] = Standing(n, st.spec.priority, st.spec.preemptible, st.spec.minimum_at(t), active)
        if standings[name].lacking == 0:
            return
        holders = [Holder(r.id, r.deployment, r.placement, _PROGRESS[r.status], r.index)
                   for r in holding.values() if r.status.counts_toward_desired()]  # fmt: skip
        freeing = [d for r in holding.values() if r.record.preempted_for == name and r.status is ReplicaStatus.DRAINING
                   for d in r.placement.devices]  # fmt: skip
        decision = self.policy.decide(request, standings[name], self.config.inventory, in_use, holders, standings,
                                      freeing)  # fmt: skip
        for v in decision.victims:
            r = holding[v.replica_id]
            self._drain(r, t, preempted_for=name)
            self.holds.add(r.placement.devices, name, standings[name].priority, t)
            for d in r.placement.devices:
                self._freed[d] = (t, standings[name].priority, name)
            self.stats[r.deployment]["preempted"] += 1
            self.stats[name]["preempted_for"] += 1
            self.events.append((t, f"{r.id} {v.reason}"))

    def _measure(self, t: float) -> None:
        tick = self.config.tick_s
        for name, st in self.states.items():
            ready = sum(1 for r in st.replicas if r.status is ReplicaStatus.READY)
            minimum = st.spec.minimum_at(t)
            s = self.stats[name]
            s["ready_replica_s"] += ready * tick
            if ready < minimum:
                s["below_minimum_s"] += tick
            if minimum > st.spec.minimum_at(t - tick) and t > 0:
                self._rose_at[name] = t
                s["time_to_minimum_s"] = None
            if name in self._rose_at and s["time_to_minimum_s"] is None and ready >= minimum:
                s["time_to_minimum_s"] = t - self._rose_at[name]

    def _next(self) -> int:
        self.order += 1
        return self.order


H100 = "NVIDIA H100 80GB HBM3"


def demo_config(hold_off_s: float = DEFAULT_HOLD_OFF_S) -> PreemptionSimConfig:
    """The scenario of docs/placement.md ("Priorities and preemption"): one node of 8 H100s in one
    NVLink domain. ``batch`` (priority 0, minimum 2, wants 6) and ``scratch`` (priority -10,
    preemptible, minimum 1, wants 2) fill it. At 120 s ``chat`` (priority 100) needs a minimum of 4
    (a traffic peak), and its first two starts crash (a bad node driver, say); at 900 s its minimum
    falls back to 1."""
    node = NodeInventory("gpu-a", gpus=tuple(Gpu(i, f"GPU-{i}", H100, 81559) for i in range(8)), cpu_cores=(0, 1),
                         nvlink_domains=(tuple(range(8)),))  # fmt: skip
    return PreemptionSimConfig(
        deployments=(
            SimDeployment("batch", priority=0, gpu_product=H100, minimum=((0, 2),), desired=((0, 6),)),
            SimDeployment("scratch", priority=-10, preemptible=True, gpu_product=H100, minimum=((0, 1),),
                          desired=((0, 2),)),
            SimDeployment("chat", priority=100, gpu_product=H100, minimum=((0, 0), (120, 4), (900, 1)),
                          crash_starts=2),
        ),
        inventory=Inventory((node,)), duration_s=1500.0, hold_off_s=hold_off_s,
    )  # fmt: skip


def main() -> None:
    """Print the demo scenario's outcome with and without the hold-off (docs/placement.md)."""
    for hold_off_s in (DEFAULT_HOLD_OFF_S, 0.0):
        out = PreemptionSimulation(demo_config(hold_off_s)).run()
        print(f"hold-off {hold_off_s:.0f} s: {out.preemptions} preemption(s), {out.flaps} flap(s)")
        for name, s in out.deployments.items():
            print(f"  {name:<8} below its minimum {s['below_minimum_s']:.0f} s, {s['ready_replica_s']:.0f} READY "
                  f"replica-s, preempted {s['preempted']}, preempted for it {s['preempted_for']}, time to its "
                  f"minimum {s['time_to_minimum_s']} s")


if __name__ == "__main__":
    main()
