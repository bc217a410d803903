"""The InferenceDeployment CRD is generated from the pydantic spec (fleet/k8s/crd.py): the
chart's copy must not drift, the schema must be structural, and every example resource must pass
both the CRD schema (what `kubectl apply` checks) and pydantic (what `fleet up` checks)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fleet.cli import app
from fleet.k8s.crd import CRD_NAME, crd_document, crd_yaml
from fleet.spec import SpecError, load_deployments, parse_document
from tests.support.schema import schema_errors, structural_problems

REPO = Path(__file__).resolve().parents[2]
CHART_CRD = REPO / "charts" / "fleet" / "files" / "crd-inferencedeployments.yaml"


def _example_resources() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceDeployment":
                docs.append((path, doc))
    return docs


def test_chart_crd_is_the_generated_one():
    assert CHART_CRD.read_text() == crd_yaml(), (
        "charts/fleet/files/crd-inferencedeployments.yaml drifted from fleet/spec.py: regenerate it with "
        "`fleet crd > charts/fleet/files/crd-inferencedeployments.yaml`"
    )


def test_fleet_crd_prints_it():
    result = CliRunner().invoke(app, ["crd"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output) == crd_document()
    assert yaml.safe_load(result.output)["metadata"]["name"] == CRD_NAME


def test_schema_is_structural():
    schema = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert structural_problems(schema) == []


def test_structural_check_catches_pydantic_leftovers():
    assert structural_problems({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}]}}}) == [
        ".a: has anyOf", ".a: no type"]


def test_every_spec_field_is_in_the_crd():
    """A field added to the pydantic spec shows up in the CRD (the generator walks all of it)."""
    spec = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    props = spec["properties"]
    assert set(props) == {"model", "engine", "resources", "replicas", "priority", "preemptible", "standby", "routing",
                          "warmup", "autoscaling", "rollout", "prePull"}
    assert props["priority"] == {"type": "integer", "default": 0, "minimum": -1_000_000_000, "maximum": 1_000_000_000,
                                 "description": props["priority"]["description"]}
    assert props["resources"]["properties"]["tensorParallelSize"] == {
        "default": 1, "description": "GPUs per replica (vLLM tensor parallelism).",
        "maximum": 64, "minimum": 1, "type": "integer"}
    assert props["engine"]["properties"]["kind"]["enum"] == ["sim", "vllm"]
    # `gt=0` -> OpenAPI v3.0's boolean exclusiveMinimum; `X | None` -> nullable
    timeout = props["routing"]["properties"]["queueTimeoutSeconds"]
    assert timeout["minimum"] == 0 and timeout["exclusiveMinimum"] is True
    assert props["autoscaling"]["nullable"] is True
    assert props["autoscaling"]["properties"]["kpa"]["type"] == "object"


def test_examples_exist():
    paths = {p.relative_to(REPO).as_posix() for p, _ in _example_resources()}
    assert {"examples/kubernetes/sim-chat.yaml", "examples/kubernetes/llama-8b-tp2.yaml",
            "examples/kubernetes/qwen-mig.yaml"} <= paths


@pytest.mark.parametrize("path,doc", _example_resources(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_example_passes_the_crd_schema_and_pydantic(path, doc):
    assert schema_errors(crd_document(), doc) == []
    parse_document(doc)   # raises SpecError when fleet up would refuse it


def test_kubernetes_examples_load_with_fleet_up_loader():
    crs = [p for p in sorted((REPO / "examples" / "kubernetes").glob("*.yaml")) if not p.name.startswith("values-")]
    loaded = load_deployments(crs)
    assert {ld.deployment.name for ld in loaded} == {"sim-chat", "llama-8b", "qwen-small"}


@pytest.mark.parametrize("mutate,where", [
    (lambda d: d["spec"]["resources"].update(tensorParallelSize=0), "spec.resources.tensorParallelSize"),
    (lambda d: d["spec"]["resources"].update(accelerator="tpu"), "spec.resources.accelerator"),
    (lambda d: d["spec"]["engine"].update(kind="tgi"), "spec.engine.kind"),
    (lambda d: d["spec"]["routing"].update(policy="random"), "spec.routing.policy"),
    (lambda d: d["spec"]["routing"].update(queueTimeoutSeconds=0), "spec.routing.queueTimeoutSeconds"),
    (lambda d: d["spec"]["resources"].update(migProfile="big"), "spec.resources.migProfile"),
    (lambda d: d["spec"]["model"].update(colour="red"), "spec.model"),
    (lambda d: d["spec"].pop("model"), "spec"),
])
def test_crd_and_pydantic_refuse_the_same_bad_field(mutate, where):
    doc = copy.deepcopy(yaml.safe_load((REPO / "examples" / "kubernetes" / "sim-chat.yaml").read_text()))
    mutate(doc)
    errors = schema_errors(crd_document(), doc)
    assert errors and errors[0].startswith(where), errors
    with pytest.raises(SpecError):
        parse_document(doc)


def test_nullable_fields_accept_null():
    doc = yaml.safe_load((REPO / "examples" / "kubernetes" / "sim-chat.yaml").read_text())
    doc["spec"]["engine"]["image"] = None
    doc["spec"]["autoscaling"] = None
    assert schema_errors(crd_document(), doc) == []


def test_fleet_operator_refuses_to_start_without_token_or_cluster(tmp_path, monkeypatch):
    monkeypatch.delenv("FLEET_ROUTER_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    result = CliRunner().invoke(app, ["operator", "--metrics-port", "0"])
    assert result.exit_code == 2
    monkeypatch.setenv("FLEET_ROUTER_ADMIN_TOKEN", "t")
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    result = CliRunner().invoke(app, ["operator", "--metrics-port", "0"])
    assert result.exit_code == 2
    result = CliRunner().invoke(app, ["operator", "--engine-pod-json", '{"migStrategy": "half"}'])
    assert result.exit_code == 2 and "migStrategy" in result.output
    monkeypatch.setenv("FLEET_PRICES_JSON", '{"gpuHourUsd": {"NVIDIA H100 80GB HBM3": 4.9}}')   # no source
    result = CliRunner().invoke(app, ["operator"])
    assert result.exit_code == 2 and "--prices-json: FLEET_PRICES_JSON: source: Field required" in result.output


def test_fleet_help_lists_the_kubernetes_commands():
    out = CliRunner().invoke(app, ["--help"]).output
    for command in ("crd", "operator", "router-pod"):
        assert command in out
