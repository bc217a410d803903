"""The controller on fake time: `ControllerHarness` (the one `tick`), and `Harness`, the
controller with the fake backend, engines and router admin API of tests/support/fakes.py that
most controller tests use, with `write_deployment`.

A harness subclass builds its world (``self.clock``, ``self.c``: the `Controller`) and, where its
world does more per tick, overrides `reconcile` (one pass of the loop under test) or
`after_tick` (a kubelet, engines turning healthy)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import yaml

from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.controller.reconcile import Controller, ControllerSettings
from fleet.inventory import NodeInventory
from fleet.spec import load_deployments
from tests.support.fakes import FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink

CPU_NODE = NodeInventory(name="n", cpu_cores=(0, 1))


class ControllerHarness:
    """Fake clock + `tick(n, seconds)`: each tick advances the clock by ``seconds``, runs one pass
    of the loop under test (`reconcile`), lets the tasks it started run for ``settle_rounds`` turns
    of the event loop (warm-ups, informers), then `after_tick`. No wall-clock time passes."""

    settle_rounds = 5
    clock: FakeClock | None = None
    c: Controller

    async def reconcile(self) -> None:
        """One pass of the loop under test (by default the controller's `reconcile_once`)."""
        await self.c.reconcile_once()

    async def after_tick(self) -> None:
        """What the harness's world does after each tick; nothing by default."""

    async def settle(self, rounds: int | None = None) -> None:
        """Let ready tasks run: ``rounds`` turns of the event loop (``settle_rounds`` by default)."""
        for _ in range(self.settle_rounds if rounds is None else rounds):
            await asyncio.sleep(0)

    async def tick(self, n: int = 1, seconds: float = 1.0) -> None:
        for _ in range(n):
            if self.clock is not None:
                self.clock.advance(seconds)
            await self.reconcile()
            await self.settle()
            await self.after_tick()


def write_deployment(tmp_path: Path, name="chat", replicas=2, **spec_extra) -> Path:
    """An InferenceDeployment file of ``replicas`` CPU replicas of a local model directory."""
    (tmp_path / "models" / "m").mkdir(parents=True, exist_ok=True)
    spec = {
        "model": {"name": f"{name}-model", "source": "./models/m"},
        "resources": {"accelerator": "cpu"},
        "replicas": {"min": 0, "max": 8, "initial": replicas},
        **spec_extra,
    }
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
           "metadata": {"name": name}, "spec": spec}
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


class Harness(ControllerHarness):
    """The controller with the fake backend, engines and router admin API, on fake time."""

    def __init__(self, tmp_path: Path, files: list[Path], node=CPU_NODE, **settings):
        self.clock = FakeClock()
        self.backend = FakeBackend(node)
        self.engines = FakeEngineAPI()
        self.pools = FakePoolSink()
        self.events = []
        self.c = Controller(
            load_deployments(files), backend=self.backend, engine_api=self.engines, pool_sink=self.pools,
            clock=self.clock, sleep=self.clock.sleep, settings=ControllerSettings(**settings),
            on_event=self.events.append,
        )

    def status(self) -> dict[str, S]:
        return {rid: r.status for rid, r in self.c.replicas.items()}

    def make_healthy(self, *rids: str) -> None:
        for rid in rids:
            self.engines.healthy.add(self.port(rid))

    def port(self, rid: str) -> int:
        return self.backend.by_replica(rid).spec.port

    def pool_ids(self, model="chat-model") -> list[str]:
        return [e.id for e in self.pools.pools.get(model, []) if not e.draining]

    async def all_ready(self, *rids: str) -> None:
        await self.tick()
        self.make_healthy(*rids)
        await self.tick(n=2)
        assert all(self.c.replicas[r].status is S.READY for r in rids), self.status()
