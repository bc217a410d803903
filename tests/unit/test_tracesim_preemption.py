"""The trace simulator's preemption scenario (fleet/tracesim/preemption.py): the controller's scale step,
placement, preemption policy and hold-offs in virtual time. The demo scenario's figures are the ones
docs/placement.md quotes."""

from __future__ import annotations

from fleet.inventory import Gpu, Inventory, NodeInventory
from fleet.tracesim.preemption import H100, PreemptionSimConfig, PreemptionSimulation, SimDeployment, demo_config


def test_chat_takes_its_minimum_from_the_lowest_priorities_without_flapping_under_the_hold_off():
    out = PreemptionSimulation(demo_config()).run()
    batch, scratch, chat = (out.deployments[n] for n in ("batch", "scratch", "chat"))
    assert (out.preemptions, out.flaps) == (4, 0)
    assert (scratch["preempted"], batch["preempted"], chat["preempted_for"]) == (2, 2, 4)   # preemptible scratch first
    assert batch["below_minimum_s"] == 0                       # never below its own minimum of 2
    # 60 s start-up, 2 crashes 30 s in, 10 s backoff, 60 s again: READY at its minimum 120 s after the rise.
    assert chat["time_to_minimum_s"] == 120.0 and chat["below_minimum_s"] == 120.0
    # scratch (preemptible) is taken to zero and comes back when chat's minimum falls at 900 s (drain 20 s + 60 s).
    assert scratch["below_minimum_s"] == 860.0
    lines = [line for _, line in out.events]
    assert lines[0] == "scratch-1 preempted for chat (priority 100 > -10), 0/4 of its minimum replicas placed, 4 more needed"


def test_without_a_hold_off_the_victims_take_the_freed_gpus_back_and_are_preempted_again():
    out = PreemptionSimulation(demo_config(hold_off_s=0.0)).run()
    assert (out.preemptions, out.flaps) == (8, 4)
    assert any(line.startswith("FLAP batch-6 placed on GPU-4, freed for chat at 120 s") for _, line in out.events)


def test_equal_priorities_never_preempt_and_the_late_one_waits():
    node = NodeInventory("a", gpus=tuple(Gpu(i, f"GPU-{i}", H100, 81559) for i in range(2)), cpu_cores=(0,),
                         nvlink_domains=((0, 1),))  # fmt: skip
    config = PreemptionSimConfig((SimDeployment("a", 5, minimum=((0, 2),)),
                                  SimDeployment("b", 5, minimum=((0, 0), (10, 1)))),
                                 Inventory((node,)), duration_s=200.0)  # fmt: skip
    out = PreemptionSimulation(config).run()
    assert out.preemptions == 0 and out.deployments["b"]["below_minimum_s"] == 191.0
