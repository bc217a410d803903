"""engine.kind: sim: spec validation, `fleet up` preflight and the controller's launch command."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from fleet.controller.reconcile import Controller
from fleet.engines.kinds import EngineLaunch, KvEventsBind, ModelUnavailable, SimEngine, get_engine
from fleet.inventory import Inventory, NodeInventory
from fleet.controller.lifecycle import ReplicaStatus as S
from fleet.spec import SpecError, load_deployments, parse_document
from fleet.local.preflight import PreflightError, preflight
from tests.support.fakes import FakeBackend, FakeClock, FakeEngineAPI, FakePoolSink

REPO = Path(__file__).resolve().parents[2]
CPU_NODE = NodeInventory(name="n", cpu_cores=(0, 1))
CPU = Inventory((CPU_NODE,))


def doc(source: str = "sim://h100-llama-8b", kind: str = "sim", args: list[str] | None = None) -> dict:
    return {
        "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "sim"},
        "spec": {"model": {"name": "m", "source": source}, "engine": {"kind": kind, "args": args or []},
                 "resources": {"accelerator": "cpu"}, "replicas": {"min": 2, "max": 2}},
    }  # fmt: skip


def write(tmp_path: Path, d: dict) -> Path:
    f = tmp_path / "dep.yaml"
    f.write_text(yaml.safe_dump(d))
    return f


def test_sim_is_a_registered_engine_kind():
    assert isinstance(get_engine("sim"), SimEngine)
    assert get_engine("sim").preflight() is None


def test_a_sim_source_needs_the_sim_engine():
    with pytest.raises(SpecError, match=r"spec\.model\.source: 'sim://h100-llama-8b' .* needs engine\.kind: sim"):
        parse_document(doc(kind="vllm"))
    assert parse_document(doc()).spec.engine.kind == "sim"


def test_model_argument_takes_profiles_and_paths_that_need_not_exist(tmp_path):
    sim = SimEngine()
    assert sim.model_argument(parse_document(doc()).engine_launch(tmp_path)) == "sim://h100-llama-8b"
    assert sim.model_argument(parse_document(doc(source="./nowhere")).engine_launch(tmp_path)) == str(tmp_path / "nowhere")
    with pytest.raises(ModelUnavailable, match="unknown simulator profile 'nope'; known: cpu-tiny-llama"):
        sim.model_argument(parse_document(doc(source="sim://nope")).engine_launch(tmp_path))
    with pytest.raises(ModelUnavailable, match="'bogus'"):
        sim.model_argument(parse_document(doc(source="./x", args=["--profile", "bogus"])).engine_launch(tmp_path))


def test_preflight_accepts_a_sim_fleet_with_no_weights_and_still_checks_vllm(tmp_path):
    preflight(load_deployments([write(tmp_path, doc(source="./no-such-dir"))]), CPU, {})
    with pytest.raises(PreflightError) as err:
        preflight(load_deployments([write(tmp_path, doc(source="./no-such-dir", kind="vllm"))]), CPU, {})
    assert any("is not a directory" in p for p in err.value.problems)
    with pytest.raises(PreflightError) as err:
        preflight(load_deployments([write(tmp_path, doc(source="sim://nope"))]), CPU, {})
    assert any("spec.model.source: unknown simulator profile 'nope'" in p for p in err.value.problems)


async def test_the_controller_launches_python_m_fleet_sim_with_vllms_flags(tmp_path):
    f = write(tmp_path, doc(args=["--seed", "3", "--enforce-eager"]))
    backend = FakeBackend(CPU_NODE)
    clock = FakeClock()
    c = Controller(load_deployments([f]), backend=backend, engine_api=FakeEngineAPI(), pool_sink=FakePoolSink(),
                   clock=clock, sleep=clock.sleep)  # fmt: skip
    await c.reconcile_once()
    assert Counter(r.status for r in c.replicas.values()) == {S.STARTING: 2}
    argv = backend.by_replica("sim-0").spec.argv
    assert argv[1:3] == ["-m", "fleet.enginesim"]
    assert argv[argv.index("--model") + 1] == "sim://h100-llama-8b"
    assert argv[argv.index("--served-model-name") + 1] == "m"
    assert argv[argv.index("--port") + 1] == str(backend.by_replica("sim-0").spec.port)
    assert argv[-3:] == ["--seed", "3", "--enforce-eager"]


def test_the_example_sim_fleet_is_valid():
    (ld,) = load_deployments([REPO / "examples" / "sim-fleet.yaml"])
    assert ld.deployment.spec.engine.kind == "sim"
    preflight([ld], CPU, {})


def test_fleet_configures_kv_events_unless_the_args_do_or_the_engine_is_data_parallel():
    from fleet.engines.kinds import data_parallel_size, fleet_kv_events, has_kv_events_flag

    for own in (["--kv-events-config", "{}"], ["--kv-events-config={}"], ["--kv_events_config", "{}"],
                ["--kv-events-config.buffer_steps", "50000"], ["--kv_events_config.topic=x"]):  # fmt: skip
        assert has_kv_events_flag(own) and not fleet_kv_events(own)
    assert not has_kv_events_flag(["--kv-events-configs", "{}"])   # another flag, not a spelling of it
    sizes = {(): 1, ("--data-parallel-size", "2"): 2, ("-dp", "4"): 4, ("--data_parallel_size=3",): 3,
             ("-dp",): 1, ("-dp", "two"): 1, ("--tensor-parallel-size", "2"): 1}  # fmt: skip
    for args, size in sizes.items():
        assert data_parallel_size(list(args)) == size
        assert fleet_kv_events(list(args)) is (size == 1)
    bind = KvEventsBind("tcp://*:5557", "tcp://*:5558")
    for args, flagged in ((("-dp", "2"), False), ((), True)):
        launch = EngineLaunch(served_model_name="m", source="/m", local_path=None, tensor_parallel_size=1, args=args)
        assert ("--kv-events-config" in get_engine("vllm").command(launch, "m", "0.0.0.0", 8000, bind)) is flagged
