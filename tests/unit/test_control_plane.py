"""The one assembly of the control plane (fleet/control_plane.py): the controller, the autoscaler
loop and the metrics are built from the inputs a runtime hands over, on the fakes of
tests/support/fakes.py; `fleet up` and the operator build them nowhere else."""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client import generate_latest

from fleet.control_plane import ControlPlane, ControlPlaneMetrics
from fleet.controller.reconcile import ControllerSettings
from fleet.spec import load_deployments
from tests.support.controller import CPU_NODE, write_deployment
from tests.support.fakes import FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink

REPO = Path(__file__).resolve().parents[2]
AUTOSCALING = {
    "policy": "fleet", "queueTimeTargetSeconds": 0.5, "ttftP99TargetSeconds": 2.0, "windowSeconds": 30,
    "intervalSeconds": 5, "scaleDownStabilizationSeconds": 60, "warmStartupSeconds": 20,
}  # fmt: skip


def plane(**inputs) -> ControlPlane:
    pools = FakePoolSink()
    return ControlPlane(backend=FakeBackend(CPU_NODE), engine_api=FakeEngineAPI(), pool_sink=pools,
                        clock=FakeClock(), **{"stats_source": pools, **inputs})  # fmt: skip


def test_the_controller_is_built_over_the_inputs_with_its_collaborators(tmp_path: Path) -> None:
    events, settings = [], ControllerSettings(drain_timeout_s=7.0)
    p = plane(settings=settings, on_event=events.append)
    c = p.controller(load_deployments([write_deployment(tmp_path, replicas=1)]))
    assert (c.backend, c.engine_api, c.pool_sink, c.clock) == (p.backend, p.engine_api, p.pool_sink, p.clock)
    assert c.settings is settings and c.on_event == events.append and list(c.deployments) == ["chat"]
    assert c.standby is not None and c.rollouts is not None and c.standby.drain_timeout_s == 7.0


def test_an_autoscaler_only_where_a_deployment_autoscales_and_the_router_has_statistics(tmp_path: Path) -> None:
    fixed = load_deployments([write_deployment(tmp_path, name="fixed", replicas=1)])
    scaled = load_deployments([write_deployment(tmp_path, name="scaled", replicas=1, autoscaling=AUTOSCALING)])
    p = plane()
    assert p.autoscaler(p.controller(fixed)) is None
    assert plane(stats_source=None).autoscaler(plane().controller(scaled)) is None
    loop = p.autoscaler(p.controller(fixed + scaled))
    assert loop is not None and list(loop.scaled) == ["scaled"]
    assert loop.metrics is p.metrics.autoscaler and loop.router is p.stats_source


def test_a_replacing_autoscaler_keeps_what_the_old_one_learnt_of_unchanged_deployments(tmp_path: Path) -> None:
    loaded = load_deployments([write_deployment(tmp_path, name=n, replicas=1, autoscaling=AUTOSCALING)
                               for n in ("a", "b")])  # fmt: skip
    p = plane()
    c = p.controller(loaded)
    old = p.autoscaler(c)
    assert old is not None
    old.scaled["b"].primed = True
    new = p.autoscaler(c, replacing=old, changed={"b"})
    assert new is not None and new.scaled["a"] is old.scaled["a"]        # unchanged: its whole state
    assert new.scaled["b"] is not old.scaled["b"] and new.scaled["b"].primed   # changed: its history alone


def test_the_metrics_are_one_registry_of_decisions_and_replica_states(tmp_path: Path) -> None:
    p = plane(metrics=ControlPlaneMetrics({"NVIDIA H100 80GB HBM3": 4.5}))
    c = p.controller(load_deployments([write_deployment(tmp_path, replicas=1)]))
    p.metrics.autoscaler.desired.labels("chat").set(3)
    p.metrics.update(c.snapshot())
    text = generate_latest(p.metrics.registry).decode()
    assert 'fleet_autoscaler_desired_replicas{deployment="chat"} 3.0' in text
    assert 'fleet_deployment_desired_replicas{deployment="chat"}' in text
    assert 'fleet_gpu_price_usd_per_hour{product="NVIDIA H100 80GB HBM3"} 4.5' in text


def test_no_runtime_builds_a_controller_or_an_autoscaler_of_its_own() -> None:
    """`fleet up`, `fleet down` and the operator go through the assembly: no other product module
    calls `Controller(...)` or `AutoscalerLoop(...)`."""
    builders = []
    for path in sorted((REPO / "fleet").rglob("*.py")):
        if path.name == "control_plane.py" or "testing" in path.relative_to(REPO).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("Controller", "AutoscalerLoop"):
                builders.append(f"{path.relative_to(REPO)}:{node.lineno} {node.func.id}")
    assert builders == []
    uses = {p: (REPO / p).read_text().count("ControlPlane(") for p in ("fleet/local/up.py", "fleet/k8s/operator.py")}
    assert all(uses.values()), uses
