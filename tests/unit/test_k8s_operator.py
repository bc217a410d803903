"""The operator (fleet/k8s/operator.py) on the in-repo fake of the cluster wrapper: resources
become pods through the real controller, status and conditions and events are written back,
an invalid spec is refused in its status, spec edits take effect, a second operator waits on
the Lease and a restarted one adopts, a deleted resource drains before its finalizer goes."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import yaml

from fleet.controller.reconcile import ControllerSettings
from fleet.k8s.client import EVENTS, INFERENCE_DEPLOYMENTS, LEASES, NODES, PODS
from fleet.k8s.operator import FINALIZER, Operator, OperatorSettings
from fleet.k8s.pods import ANNOTATION_READY_AT
from tests.support.controller import ControllerHarness
from tests.support.fakes import FakePoolSink
from tests.support.fake_kube import FakeKube
from fleet.testing.k8s.kubelet import finish_deletions, run_pod
from fleet.testing.k8s.workloads import schedule
from fleet.testing.k8s.nodes import node
from tests.unit.test_k8s_backend import EndpointEngines

NS = "fleet"
CR = {
    "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
    "metadata": {"name": "chat"},
    "spec": {"model": {"name": "chat-model", "source": "sim://h100-llama-8b"}, "engine": {"kind": "sim"},
             "resources": {"accelerator": "cpu"}, "replicas": {"min": 1, "max": 4, "initial": 2},
             "warmup": {"requests": [{"kind": "completion", "prompt": "hi", "maxTokens": 2}]}},
}


class Env(ControllerHarness):
    """The operators on the fake cluster; `tick(op, n)` is one pass of ``op``: the Lease, then its tick."""

    settle_rounds = 20   # informers, watches and warm-ups

    def __init__(self, kube: FakeKube | None = None) -> None:
        self.kube = kube or FakeKube()
        self.store = self.kube.store
        if not self.store.list(NODES, None, None)[0]:
            self.store.create(NODES, None, node("cpu-a", cpu=8, images=["fleet:1"]))
        self.engines = EndpointEngines()
        self.pools = FakePoolSink()
        self.stop = asyncio.Event()
        self.next_ip = 10
        self.ops: list[Operator] = []

    def operator(self, identity: str) -> Operator:
        op = Operator(self.kube, OperatorSettings(engine_image="fleet:1", lease_duration_s=15), namespace=NS,
                      identity=identity, engine_api=self.engines, pool_sink=self.pools,
                      controller_settings=ControllerSettings(backoff_base_s=0.01, stop_grace_s=30))
        self.ops.append(op)
        return op

    async def start_informers(self, op: Operator) -> None:
        op._tasks = [asyncio.create_task(i.run(self.stop)) for i in op.informers()]
        for i in op.informers():
            await asyncio.wait_for(i.synced.wait(), 5)

    async def reconcile(self) -> None:
        op = self._ticking
        await self.settle()
        await op.elector.try_acquire_or_renew()
        if op.elector.is_leader:
            await op.tick()
            await op.drain_writes()

    async def tick(self, op: Operator, n: int = 1) -> None:   # type: ignore[override] - no clock: real time
        self._ticking = op
        await super().tick(n, seconds=0.0)

    def kubelet(self) -> None:
        schedule(self.store)   # the scheduler stand-in binds the pods first
        for pod in self.store.list(PODS, NS, None)[0]:
            if (pod.get("status") or {}).get("phase") in (None, "Pending"):
                ip = f"10.1.0.{self.next_ip}"
                self.next_ip += 1
                run_pod(self.store, NS, pod["metadata"]["name"], ip)
                self.engines.healthy.add(f"http://{ip}:8000")

    def pods(self) -> dict[str, dict]:
        return {p["metadata"]["name"]: p for p in self.store.list(PODS, NS, None)[0]}

    def cr(self, name="chat") -> dict:
        return self.store.get(INFERENCE_DEPLOYMENTS, NS, name)

    async def close(self) -> None:
        self.stop.set()
        for op in self.ops:
            for t in getattr(op, "_tasks", []):
                t.cancel()
            op._drop_controller()
        await asyncio.sleep(0)


async def _serving(env: Env, op: Operator) -> None:
    env.store.create(INFERENCE_DEPLOYMENTS, NS, copy.deepcopy(CR))
    await env.start_informers(op)
    await env.tick(op)
    env.kubelet()
    await env.tick(op, n=4)


async def test_a_resource_becomes_ready_pods_with_status_conditions_and_events():
    env = Env()
    op = env.operator("op-a")
    try:
        await _serving(env, op)
        pods = env.pods()
        assert sorted(pods) == ["chat-0", "chat-1"]
        assert all(ANNOTATION_READY_AT in p["metadata"]["annotations"] for p in pods.values())
        cr = env.cr()
        assert FINALIZER in cr["metadata"]["finalizers"]
        st = cr["status"]
        assert st["observedGeneration"] == cr["metadata"]["generation"]
        assert st["readyReplicas"] == 2 and st["desiredReplicas"] == 2 and st["replicas"] == {"READY": 2}
        assert st["revisions"] == {"v1": 2}
        cond = {c["type"]: c for c in st["conditions"]}
        assert (cond["Ready"]["status"], cond["Ready"]["reason"]) == ("True", "AllReplicasReady")
        assert (cond["Progressing"]["status"], cond["Degraded"]["status"]) == ("False", "False")
        reasons = [e["reason"] for e in env.store.list(EVENTS, NS, None)[0]]
        assert "SpecAccepted" in reasons and reasons.count("ReplicaReady") == 2
        assert sorted(e.id for e in env.pools.pools["chat-model"]) == ["chat-0", "chat-1"]
        # level-triggered and quiet: another tick with nothing new writes nothing (but the Lease renewal)
        def writes():
            return [(plural, obj["metadata"]["name"]) for _, plural, _, obj in env.store.events if plural != "leases"]

        before = writes()
        await env.tick(op, n=2)
        assert writes() == before
    finally:
        await env.close()


async def test_an_invalid_spec_is_refused_in_its_status():
    env = Env()
    op = env.operator("op-a")
    try:
        bad = copy.deepcopy(CR)
        bad["spec"]["replicas"] = {"min": 3, "max": 2}
        env.store.create(INFERENCE_DEPLOYMENTS, NS, bad)
        await env.start_informers(op)
        await env.tick(op, n=2)
        assert env.pods() == {}
        cond = {c["type"]: c for c in env.cr()["status"]["conditions"]}
        assert cond["Ready"]["reason"] == "InvalidSpec"
        assert cond["Ready"]["message"] == "spec.replicas.min: must be <= spec.replicas.max (3 > 2)"
        assert any(e["reason"] == "InvalidSpec" and e["type"] == "Warning" for e in env.store.list(EVENTS, NS, None)[0])
    finally:
        await env.close()


async def test_a_max_model_len_vllm_refuses_starts_no_pod_and_says_why_in_degraded(tmp_path):
    """The operator's path to the placement rule `fleet validate` applies
    (fleet/models/memory.py ``MemoryNeed.max_len_problem``): a Qwen2.5-7B resource asking for
    65,536 tokens (the model's maximum is 32,768) gets no pod, and its status says why."""
    model = tmp_path / "qwen"
    model.mkdir()
    configs = Path(__file__).resolve().parents[1] / "data" / "model_configs"
    (model / "config.json").write_text((configs / "qwen2.5-7b-instruct.json").read_text())
    kube = FakeKube()
    kube.store.create(NODES, None, node("gpu-a", cpu=16, gpus=2, images=["fleet:1"]))
    env = Env(kube)
    op = env.operator("op-a")
    try:
        cr = copy.deepcopy(CR)
        cr["spec"].update(model={"name": "chat-model", "source": str(model)},
                          engine={"kind": "vllm", "args": ["--max-model-len", "65536"]},
                          resources={"accelerator": "gpu", "tensorParallelSize": 1},
                          replicas={"min": 1, "max": 1, "initial": 1})
        env.store.create(INFERENCE_DEPLOYMENTS, NS, cr)
        await env.start_informers(op)
        await env.tick(op, n=3)
        assert env.pods() == {}
        cond = {c["type"]: c for c in env.cr()["status"]["conditions"]}
        assert (cond["Degraded"]["status"], cond["Degraded"]["reason"]) == ("True", "Unplaceable")
        assert "--max-model-len 65,536 is above the model's maximum 32,768" in cond["Degraded"]["message"]
        assert "vLLM refuses it at start" in cond["Degraded"]["message"]
    finally:
        await env.close()


async def test_scaling_the_resource_adds_pods():
    env = Env()
    op = env.operator("op-a")
    try:
        await _serving(env, op)
        env.store.patch(INFERENCE_DEPLOYMENTS, NS, "chat", {"spec": {"replicas": {"initial": 3}}})
        await env.tick(op, n=2)
        assert sorted(env.pods()) == ["chat-0", "chat-1", "chat-2"]
        env.kubelet()
        await env.tick(op, n=4)
        assert env.cr()["status"]["readyReplicas"] == 3
        assert sum(1 for e in env.engines.posts) == 3    # the survivors were not warmed again
    finally:
        await env.close()


async def test_one_leader_and_a_restarted_operator_adopts():
    env = Env()
    a = env.operator("op-a")
    b = env.operator("op-b")
    try:
        await _serving(env, a)
        await env.start_informers(b)
        await env.tick(b, n=2)
        assert not b.elector.is_leader and b.controller is None
        lease = env.store.get(LEASES, NS, "fleet-operator")
        assert lease["spec"]["holderIdentity"] == "op-a"
        # op-a dies without a word (kill -9): its Lease runs out, op-b takes over and adopts
        def pod_creates():
            return sum(1 for _, plural, type_, _ in env.store.events if plural == "pods" and type_ == "ADDED")

        creates, posts = pod_creates(), len(env.engines.posts)
        a._drop_controller()
        b.elector._observed_at_s -= 16
        await env.tick(b, n=3)
        assert b.elector.is_leader
        assert env.store.get(LEASES, NS, "fleet-operator")["spec"]["leaseTransitions"] == 1
        assert {r.id: r.status.value for r in b.controller.replicas.values()} == {"chat-0": "READY", "chat-1": "READY"}
        assert sorted(env.pods()) == ["chat-0", "chat-1"] and pod_creates() == creates
        assert not any(p["metadata"].get("deletionTimestamp") for p in env.pods().values())
        assert len(env.engines.posts) == posts            # adopted READY: no warm-up again
        assert sorted(e.id for e in env.pools.pools["chat-model"]) == ["chat-0", "chat-1"]
    finally:
        await env.close()


async def test_deleting_the_resource_drains_then_everything_goes():
    env = Env()
    op = env.operator("op-a")
    try:
        await _serving(env, op)
        env.store.delete(INFERENCE_DEPLOYMENTS, NS, "chat")   # finalizer: stays, with a deletionTimestamp
        await env.tick(op, n=2)
        assert env.cr()["metadata"].get("deletionTimestamp")
        assert all(p["metadata"].get("deletionTimestamp") for p in env.pods().values())
        finish_deletions(env.store, NS)
        await env.tick(op, n=3)
        with pytest.raises(Exception, match="not found"):
            env.cr()
        assert env.pods() == {}
        assert "chat-model" in env.pools.deleted
    finally:
        await env.close()


def test_example_resource_is_what_the_operator_accepts():
    from pathlib import Path

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/kubernetes/sim-chat.yaml").read_text())
    assert doc["kind"] == "InferenceDeployment" and doc["spec"]["engine"]["kind"] == "sim"


async def test_a_replicas_edit_made_while_no_operator_ran_takes_effect():
    env = Env()
    a = env.operator("op-a")
    try:
        await _serving(env, a)
        a._drop_controller()
        env.store.patch(INFERENCE_DEPLOYMENTS, NS, "chat", {"spec": {"replicas": {"initial": 3}}})
        b = env.operator("op-b")
        await env.start_informers(b)
        await env.tick(b)
        b.elector._observed_at_s -= 16     # op-a never renews again
        await env.tick(b, n=2)
        assert b.elector.is_leader
        assert sorted(env.pods()) == ["chat-0", "chat-1", "chat-2"]
        assert b.controller.deployments["chat"].desired_reason == "spec.replicas"
    finally:
        await env.close()


async def test_the_autoscaler_scales_a_resource_and_says_so():
    """`spec.autoscaling` runs in the operator as in `fleet up`: router statistics (merged over
    router pods) and engine /metrics in, a new target out, an Event for the decision."""
    from tests.support.fakes import FakeClock
    from tests.unit.test_autoscaler_wiring import AUTOSCALING, BUSY_METRICS, router_stats

    env = Env()
    clock = FakeClock(1_800_000_000.0)
    env.engines.metrics_text = BUSY_METRICS
    op = Operator(env.kube, OperatorSettings(engine_image="fleet:1"), namespace=NS, identity="op-a",
                  engine_api=env.engines, pool_sink=env.pools, clock=clock, monotonic=clock,
                  controller_settings=ControllerSettings(backoff_base_s=0.01))
    env.ops.append(op)
    try:
        cr = copy.deepcopy(CR)
        cr["spec"]["replicas"] = {"min": 1, "max": 4, "initial": 1}
        cr["spec"]["autoscaling"] = AUTOSCALING
        env.store.create(INFERENCE_DEPLOYMENTS, NS, cr)
        await env.start_informers(op)
        await env.tick(op)
        env.kubelet()
        for _ in range(4):
            clock.advance(1)
            await env.tick(op)
        assert env.cr()["status"]["readyReplicas"] == 1
        # 3.6 replicas' worth of load: queue time 3.6x its target on the one replica
        env.pools.stats_by_model["chat-model"] = router_stats(queue_s=1.8, ttft_s=7.2, in_flight=16, rate=14.4)
        for _ in range(6):
            clock.advance(1)
            await env.tick(op)
        assert sorted(env.pods()) == ["chat-0", "chat-1", "chat-2", "chat-3"]
        st = env.cr()["status"]
        assert st["desiredReplicas"] == 4 and st["desiredReason"] == "autoscaler: queue_time_above_target"
        up = [e for e in env.store.list(EVENTS, NS, None)[0] if e["reason"] == "ScaleUp"]
        assert len(up) == 1 and up[0]["message"].startswith("1 -> 4 replica(s): queue_time_above_target")
    finally:
        await env.close()


async def test_operator_metrics_serve_its_gauges_and_the_autoscalers():
    import socket

    import httpx

    from fleet.k8s.operator_process import serve_health

    env = Env()
    op = env.operator("op-a")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = await serve_health(op, port)
    try:
        op.plane.metrics.autoscaler.desired.labels("chat").set(3)
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{port}/metrics")).text
            health = (await c.get(f"http://127.0.0.1:{port}/healthz")).json()
        assert "fleet_operator_leader 0.0" in text
        assert "fleet_autoscaler_desired_replicas" not in text   # not leading: its last decisions may be stale
        assert health == {"ok": True, "leader": False, "identity": "op-a"}
        await _serving(env, op)
        op.plane.metrics.autoscaler.desired.labels("chat").set(3)
        async with httpx.AsyncClient() as c:
            text = (await c.get(f"http://127.0.0.1:{port}/metrics")).text
        assert "fleet_operator_leader 1.0" in text
        assert 'fleet_autoscaler_desired_replicas{deployment="chat"} 3.0' in text
    finally:
        await runner.cleanup()
        await env.close()


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}  # fmt: skip


async def test_controller_series_are_rendered_at_most_every_few_seconds():
    """At 1,000 deployments the controller's series take ~0.5 s to render: a scrape within
    CONTROLLER_METRICS_EVERY_S of the last rendering gets that one (the operator's own series are
    always fresh)."""
    import socket

    import httpx

    from fleet.k8s.operator_process import serve_health

    env = Env()
    op = env.operator("op-a")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runner = await serve_health(op, port, controller_metrics_every_s=3600)
    try:
        await _serving(env, op)
        renders = []
        original = op.controller.snapshot
        op.controller.snapshot = lambda: renders.append(1) or original()
        async with httpx.AsyncClient() as c:
            first = (await c.get(f"http://127.0.0.1:{port}/metrics")).text
            await env.tick(op)
            second = (await c.get(f"http://127.0.0.1:{port}/metrics")).text
        assert len(renders) == 1 and "fleet_replicas{" in first and "fleet_replicas{" in second
        ticks = [float(line.split()[-1]) for text in (first, second) for line in text.splitlines()
                 if line.startswith("fleet_operator_reconcile_ticks ")]
        assert ticks[1] > ticks[0]   # the operator's own series: fresh on every scrape
    finally:
        await runner.cleanup()
        await env.close()


async def test_operator_metrics_export_the_controller_series_fleet_up_exports():
    """The shipped dashboard and rules read `fleet_replicas{deployment,version,state}`,
    `fleet_deployment_*` and `fleet_replica_failures_total` on a cluster too: the leader exports
    them through the collector `fleet up` registers (fleet/observability/discovery.py), a standby
    none (summed over operators, replicas count once)."""
    import socket

    import httpx

    from fleet.k8s.operator_process import serve_health
    from fleet.testing.k8s.kubelet import terminate_pod

    env = Env()
    op, standby = env.operator("op-a"), env.operator("op-b")
    # one terminal replica kept in the snapshot: a failure must be counted on the tick it happens
    op.plane.settings = ControllerSettings(backoff_base_s=0.01, stop_grace_s=30, history_per_deployment=1)
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    runners = [await serve_health(op, ports[0], controller_metrics_every_s=0),
               await serve_health(standby, ports[1], controller_metrics_every_s=0)]
    try:
        await _serving(env, op)
        await env.start_informers(standby)
        await env.tick(standby)
        async with httpx.AsyncClient() as c:
            leader = _samples((await c.get(f"http://127.0.0.1:{ports[0]}/metrics")).text)
            waiting = (await c.get(f"http://127.0.0.1:{ports[1]}/metrics")).text
        def at(samples: dict, name: str, **labels: str) -> float:
            return samples[(name, tuple(sorted(labels.items())))]

        dv = {"deployment": "chat", "version": "v1"}
        assert at(leader, "fleet_replicas", **dv, state="READY") == 2
        assert at(leader, "fleet_replicas", **dv, state="FAILED_CRASHED") == 0   # every state, 0 included
        assert at(leader, "fleet_replica_failures_total", **dv) == 0
        assert at(leader, "fleet_deployment_desired_replicas", deployment="chat") == 2
        assert at(leader, "fleet_deployment_min_replicas", deployment="chat") == 1
        assert at(leader, "fleet_deployment_max_replicas", deployment="chat") == 4
        assert at(leader, "fleet_deployment_info", deployment="chat", model="chat-model") == 1
        assert "fleet_operator_leader 0.0" in waiting and "fleet_replicas" not in waiting

        # Both engines crash, one after the other, with no scrape between: the first is trimmed from
        # the snapshot by the time of the scrape, and still counted (the controller's own counter).
        terminate_pod(env.store, NS, "chat-0", exit_code=1)
        await env.tick(op, n=2)
        terminate_pod(env.store, NS, "chat-1", exit_code=1)
        await env.tick(op, n=2)
        assert "chat-0" not in {r["id"] for r in op.controller.snapshot()["replicas"]}
        async with httpx.AsyncClient() as c:
            for _ in range(2):   # a second scrape does not count them again
                after = _samples((await c.get(f"http://127.0.0.1:{ports[0]}/metrics")).text)
        assert at(after, "fleet_replica_failures_total", **dv) == 2
        assert at(after, "fleet_replicas", **dv, state="FAILED_CRASHED") == 1   # chat-1, still in the snapshot
    finally:
        for r in runners:
            await r.cleanup()
        await env.close()


async def test_spec_changes_go_to_the_running_controller_one_deployment_each():
    """A resource added, edited or deleted is handed to the running controller (add, apply,
    remove): no hand-over, so the other deployments' replicas are not touched (no warm-up again)."""
    env = Env()
    op = env.operator("op-a")
    try:
        await _serving(env, op)
        controller = op.controller
        posts = len(env.engines.posts)
        docs = copy.deepcopy(CR)
        docs["metadata"]["name"], docs["spec"]["model"]["name"] = "docs", "docs-model"
        env.store.create(INFERENCE_DEPLOYMENTS, NS, docs)
        await env.tick(op)
        env.kubelet()
        await env.tick(op, n=4)
        assert op.controller is controller
        assert sorted(env.pods()) == ["chat-0", "chat-1", "docs-0", "docs-1"]
        assert env.cr("docs")["status"]["readyReplicas"] == 2
        env.store.patch(INFERENCE_DEPLOYMENTS, NS, "chat", {"spec": {"replicas": {"initial": 3}}})
        await env.tick(op)
        env.kubelet()
        await env.tick(op, n=4)
        assert op.controller is controller
        assert sorted(env.pods()) == ["chat-0", "chat-1", "chat-2", "docs-0", "docs-1"]
        assert env.cr()["status"]["readyReplicas"] == 3
        assert env.cr()["status"]["observedGeneration"] == env.cr()["metadata"]["generation"]
        assert len(env.engines.posts) == posts + 3        # docs-0, docs-1, chat-2: nobody warmed again
        env.store.delete(INFERENCE_DEPLOYMENTS, NS, "docs")
        await env.tick(op, n=2)
        finish_deletions(env.store, NS)
        await env.tick(op, n=3)
        assert op.controller is controller
        assert sorted(env.pods()) == ["chat-0", "chat-1", "chat-2"]
        assert "docs-model" in env.pools.deleted and "docs" not in controller.deployments
        with pytest.raises(Exception, match="not found"):
            env.cr("docs")
        env.store.patch(INFERENCE_DEPLOYMENTS, NS, "chat", {"spec": {"model": {"name": "chat-2-model"}}})
        await env.tick(op)
        assert op.controller is not controller            # a new model name: the whole hand-over
        assert op.controller.deployments["chat"].model == "chat-2-model"
    finally:
        await env.close()


async def test_past_its_renew_deadline_an_operator_writes_nothing_and_drops_its_controller():
    """Renewals stopped (say, the API server was unreachable): from the renew deadline on
    (10 s of a 15 s lease) nothing the operator decides reaches the cluster or the routers, and
    its next pass drops the controller; a standby could take over only at 15 s."""
    from tests.support.fakes import FakeClock

    env = Env()
    clock = FakeClock(1000.0)
    op = Operator(env.kube, OperatorSettings(engine_image="fleet:1", lease_thread=False), namespace=NS,
                  identity="op-a", engine_api=env.engines, pool_sink=env.pools, monotonic=clock,
                  controller_settings=ControllerSettings(backoff_base_s=0.01))  # fmt: skip
    env.ops.append(op)
    try:
        env.store.create(INFERENCE_DEPLOYMENTS, NS, copy.deepcopy(CR))
        await env.start_informers(op)
        await op.elector.try_acquire_or_renew()
        await op.step()
        await op.backend.drain_creates()
        assert op.controller is not None and sorted(env.pods()) == ["chat-0", "chat-1"]
        clock.advance(9)
        assert op.elector.holds()
        clock.advance(2)
        env.store.patch(INFERENCE_DEPLOYMENTS, NS, "chat", {"spec": {"replicas": {"initial": 4}}})
        await env.settle()
        writes = {m: env.kube.calls[m] for m in ("create", "replace", "patch", "patch_status", "delete")}
        updates = env.pools.updates
        await op.tick()                     # a tick that was already running when the deadline passed
        await op.backend.drain_creates()
        assert {m: env.kube.calls[m] for m in writes} == writes and env.pools.updates == updates
        assert sorted(env.pods()) == ["chat-0", "chat-1"]
        await op.step()
        assert op.controller is None
        await op.elector.try_acquire_or_renew()   # renewed again (nobody took over): it acts again
        await op.step()
        await op.backend.drain_creates()
        assert op.controller is not None and len(env.pods()) == 4
    finally:
        await env.close()
