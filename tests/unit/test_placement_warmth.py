"""Warm vs cold from what nodes hold: a node whose `cached` set holds the engine image and the
model source (in canonical form) is warm for placement, the controller says whether the next
replica would start warm (`Controller.next_replica_warm`), and the autoscaler's start-up
estimate follows it (fleet.placement.shapes, fleet.controller.reconcile, fleet.controller.autoscaling)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.controller.autoscaling import AutoscalerLoop
from fleet.inventory import NodeInventory
from fleet.placement.shapes import PlacementRequest, ReplicaShape, canonical_source
from tests.unit.test_autoscaler_wiring import AUTOSCALING
from tests.support.controller import Harness, write_deployment



@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


HUB = "hf://org/chat"             # the spec names no revision: the cache reports it at @main
HUB_HELD = "hf://org/chat@main"


def test_sources_compare_in_canonical_form() -> None:
    assert canonical_source(HUB) == canonical_source(HUB_HELD) == HUB_HELD
    assert canonical_source("http://h/m/") == "http://h/m/fleet-manifest.json"
    assert canonical_source("/abs/m") == canonical_source("file:///abs/m") == "file:///abs/m"
    assert canonical_source("./rel") == "./rel"            # no node can report a relative path
    assert canonical_source("sim://tiny") == "sim://tiny"
    shape = ReplicaShape(accelerator="cpu")
    request = PlacementRequest(shape, model_source=HUB, image="vllm/vllm-openai:v1")
    assert request.is_warm(NodeInventory(name="a", cpu_cores=(0,), cached=frozenset({HUB_HELD, "vllm/vllm-openai:v1"})))
    # The weights without the image, or another revision of the weights: cold.
    assert not request.is_warm(NodeInventory(name="b", cpu_cores=(0,), cached=frozenset({HUB_HELD})))
    assert not request.is_warm(NodeInventory(name="c", cpu_cores=(0,),
                                             cached=frozenset({"hf://org/chat@v2", "vllm/vllm-openai:v1"})))


class TwoNodes(Harness):
    """Nodes a and b of two cores each; the deployment's source is an absolute path, which b
    reports (when ``held_on_b``) in its canonical ``file://`` form."""

    def __init__(self, tmp_path: Path, held_on_b: bool, replicas: int, **spec: object) -> None:
        f = write_deployment(tmp_path, replicas=replicas, **spec)
        models = tmp_path / "models" / "m"
        f.write_text(f.read_text().replace("source: ./models/m", f"source: {models}"))
        super().__init__(tmp_path, [f])
        held = frozenset({f"file://{models}"} if held_on_b else ())
        self.backend.nodes = (NodeInventory(name="a", cpu_cores=(0, 1)),
                              NodeInventory(name="b", cpu_cores=(2, 3), cached=held))


async def test_the_next_replica_is_warm_where_a_node_holds_the_weights_and_cold_when_those_are_full(tmp_path) -> None:
    h = TwoNodes(tmp_path, held_on_b=True, replicas=0)
    await h.tick()
    assert h.c.next_replica_warm("chat")                     # b holds the weights and has room
    h.c.set_desired("chat", 2)
    await h.tick()
    assert {h.c.replicas[r].node for r in ("chat-0", "chat-1")} == {"b"}   # placement went warm first
    assert not h.c.next_replica_warm("chat")                 # b is full: the next one lands on a, cold


async def test_a_node_running_the_spec_with_its_weights_present_counts_as_warm(tmp_path) -> None:
    h = TwoNodes(tmp_path, held_on_b=False, replicas=0)
    await h.tick()
    assert not h.c.next_replica_warm("chat")                 # nothing holds the weights yet
    h.c.set_desired("chat", 1)
    await h.tick()
    await h.all_ready("chat-0")
    assert h.c.replicas["chat-0"].weights_ready_at_s is not None
    assert h.c.next_replica_warm("chat")                     # its node has a free core and the weights


async def test_the_autoscaler_estimates_start_up_with_the_cold_figure_until_a_node_holds_the_weights(tmp_path) -> None:
    spec = {**AUTOSCALING, "warmStartupSeconds": 20, "coldStartupSeconds": 300}
    h = TwoNodes(tmp_path, held_on_b=False, replicas=0, autoscaling=spec)
    seen = []
    loop = AutoscalerLoop(h.c, router=h.pools, engine_api=h.engines, clock=h.clock)
    for d in loop.scaled.values():
        decide = d.policy.decide
        d.policy.decide = lambda ctx, decide=decide: (seen.append(ctx.startup), decide(ctx))[1]
    await h.tick()
    await loop.step()
    assert seen[-1].next_warm is False and seen[-1].lead_time_s == 300   # no node holds the weights
    h.c.set_desired("chat", 1)
    await h.all_ready("chat-0")
    await h.tick(seconds=10)
    await loop.step()
    # a's free core is warm now: the warm figure, as observed (chat-0 had its weights at once).
    assert seen[-1].next_warm is True and seen[-1].lead_time_s == seen[-1].warm_s == 2.0
