"""Pins of engine pods that left the node are released by the agent (fleet/agent/pins.py):
pods the kubelet's PodResources API lists with GPUs keep theirs; one seen and then gone loses its
pin at once, one never seen only after ``orphan_after_s``; no answer from the kubelet (or a pod
whose uid is unknown) releases nothing;
holders that are no pod UID (a `fleet up` replica id) are never touched."""

from __future__ import annotations

from fleet.agent.pins import DepartedPodPins
from tests.support.fakes import FakeClock
from tests.support.weights import hub, make_cache  # noqa: F401 - the hub fixture

GPU_POD = "0f4c9a2e-1111-4a2b-9c3d-000000000001"
LEFT_EARLY = "0f4c9a2e-2222-4a2b-9c3d-000000000002"
CPU_POD = "0f4c9a2e-3333-4a2b-9c3d-000000000003"


def test_departed_pods_lose_their_pins(hub, tmp_path):  # noqa: F811
    clock = FakeClock()
    cache = make_cache(tmp_path, clock=clock)
    key = cache.ensure("hf://org/tiny").name
    for holder in (GPU_POD, LEFT_EARLY, CPU_POD, "replica-a"):
        cache.pin(key, holder)
    pins = DepartedPodPins(clock, orphan_after_s=3600)

    assert pins.step(cache, None) == []                          # no answer from the kubelet: nothing
    assert pins.step(cache, {GPU_POD: ("GPU-0",)}) == []          # LEFT_EARLY/CPU_POD: pinned just now
    assert set(cache.pinned_by(key)) == {GPU_POD, LEFT_EARLY, CPU_POD, "replica-a"}
    assert pins.step(cache, {}) == [(key, GPU_POD)]               # seen, then gone: released at once
    clock.advance(3600)
    released = {h for _k, h in pins.step(cache, {})}
    assert released == {LEFT_EARLY, CPU_POD}                      # never seen: after orphan_after_s
    assert cache.pinned_by(key) == ("replica-a",)                 # not a pod: never touched
