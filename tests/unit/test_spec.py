"""The deployment spec: examples round-trip; malformed documents fail naming field and reason."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from fleet.spec import SpecError, dump_deployment, load_deployments, parse_document

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))

VALID = {
    "apiVersion": "fleet.inference.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"name": "tiny", "source": "./models/tiny"},
        "resources": {"accelerator": "cpu"},
        "replicas": {"min": 1, "max": 2},
    },
}


def with_change(path: str, value):
    doc = copy.deepcopy(VALID)
    *parents, last = path.split(".")
    node = doc
    for p in parents:
        node = node.setdefault(p, {})
    if value is DELETE:
        del node[last]
    else:
        node[last] = value
    return doc


DELETE = object()


def test_examples_exist_and_round_trip():
    assert EXAMPLES, "examples/*.yaml missing"
    loaded = load_deployments(EXAMPLES)
    assert len(loaded) >= 3
    for ld in loaded:
        text = dump_deployment(ld.deployment)
        again = parse_document(yaml.safe_load(text))
        assert again == ld.deployment
        assert dump_deployment(again) == text


def test_defaults_are_filled():
    dep = parse_document(VALID)
    assert dep.spec.engine.kind == "vllm"
    assert dep.spec.routing.policy == "kv-aware"
    assert dep.spec.warmup.enabled and dep.spec.warmup.total_requests == 3
    assert dep.spec.replicas.desired_at_start == 1


@pytest.mark.parametrize(
    "path, value, expected",
    [
        ("spec.replicas", {"min": 3, "max": 2}, "spec.replicas.min: must be <= spec.replicas.max (3 > 2)"),
        ("spec.replicas", {"min": 1, "max": 2, "initial": 5}, "spec.replicas.initial: must be within"),
        ("spec.replicas", {"min": -1, "max": 2}, "spec.replicas.min: Input should be greater than or equal to 0"),
        ("spec.replicas", {"min": 1, "max": "two"}, "spec.replicas.max: Input should be a valid integer"),
        ("spec.replicaz", 3, "spec.replicaz: unknown field"),
        ("spec.model.name", DELETE, "spec.model.name: required field is missing"),
        ("spec.model.source", "ftp://x/y", "spec.model.source: unsupported scheme"),
        ("metadata.name", "Chat_1", "metadata.name: 'Chat_1' is not a DNS-1123 label"),
        ("apiVersion", "v1", "apiVersion: Input should be 'fleet.inference.dev/v1alpha1'"),
        ("kind", "Deployment", "kind: Input should be 'InferenceDeployment'"),
        ("spec.engine", {"kind": "tgi"}, "spec.engine.kind: unknown engine kind 'tgi'; known: sim, vllm"),
        ("spec.engine", {"args": ["--enforce-eager", "--port", "9"]}, "spec.engine.args[1]: '--port' is set by Fleet"),
        ("spec.engine", {"args": ["--model=/x"]}, "spec.engine.args[0]: '--model' comes from spec.model.source"),
        ("spec.engine", {"env": {"CUDA_VISIBLE_DEVICES": "0"}}, "spec.engine.env.CUDA_VISIBLE_DEVICES: is set by placement"),
        ("spec.engine", {"startupTimeoutSeconds": 0}, "spec.engine.startupTimeoutSeconds: Input should be greater than 0"),
        ("spec.engine", {"cudaVersion": "12"}, "spec.engine.cudaVersion: '12' is not a CUDA version"),
        ("spec.engine", {"cudaCompatibility": "forward"}, "spec.engine.cudaCompatibility: Input should be"),
        ("spec.resources", {"gpuProduct": []}, "spec.resources.gpuProduct: an empty list"),
        ("spec.resources", {"accelerator": "tpu"}, "spec.resources.accelerator: Input should be 'gpu' or 'cpu'"),
        ("spec.resources", {"accelerator": "cpu", "tensorParallelSize": 2}, "spec.resources.tensorParallelSize: must be 1 with accelerator: cpu"),
        ("spec.resources", {"accelerator": "cpu", "migProfile": "1g.10gb"}, "spec.resources.migProfile: is a GPU setting"),
        ("spec.resources", {"migProfile": "3g.40gb", "tensorParallelSize": 2}, "spec.resources.tensorParallelSize: must be 1 with migProfile 3g.40gb (got 2): MIG slices have no NVLink"),
        ("spec.resources", {"migProfile": "3g"}, "spec.resources.migProfile: '3g' is not a MIG profile name"),
        ("spec.routing", {"policy": "random-ish"}, "spec.routing.policy: unknown routing policy 'random-ish'; known:"),
        ("spec.warmup", {"requests": []}, "spec.warmup.requests: must list at least one request"),
        ("spec.warmup", {"requests": [{"kind": "embed"}]}, "spec.warmup.requests[0].kind: Input should be 'completion' or 'chat'"),
        ("spec.warmup", {"requests": [{"maxTokens": 0}]}, "spec.warmup.requests[0].maxTokens: Input should be greater than or equal to 1"),
    ],
)
def test_malformed_document_names_field_and_reason(path, value, expected):
    with pytest.raises(SpecError) as exc:
        parse_document(with_change(path, value))
    assert any(p.startswith(expected) for p in exc.value.problems), exc.value.problems


def test_every_problem_is_reported_at_once():
    doc = with_change("spec.replicas", {"min": 3, "max": 2})
    doc["spec"]["routing"] = {"policy": "nope"}
    with pytest.raises(SpecError) as exc:
        parse_document(doc)
    assert len(exc.value.problems) == 2


def test_files_name_document_index_and_reject_duplicates(tmp_path):
    f = tmp_path / "two.yaml"
    second = with_change("metadata.name", "other")
    f.write_text(yaml.safe_dump(VALID) + "---\n" + yaml.safe_dump(second))
    with pytest.raises(SpecError) as exc:
        load_deployments([f])
    assert exc.value.problems == [
        f"{f}[1] spec.model.name: 'tiny' is already served by deployment 'chat'; one deployment per model name"
    ]
    g = tmp_path / "dup.yaml"
    g.write_text(yaml.safe_dump(with_change("spec.model.name", "tiny2")))
    with pytest.raises(SpecError) as exc:
        load_deployments([tmp_path / "two.yaml", g])
    assert any("metadata.name: 'chat' is already used by" in p for p in exc.value.problems)


def test_yaml_syntax_error_names_line(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("apiVersion: x\nspec: [1, 2\n")
    with pytest.raises(SpecError) as exc:
        load_deployments([f])
    assert exc.value.problems[0].startswith(f"{f}: invalid YAML at line 3")


def test_a_misindented_line_is_shown_with_a_caret_and_named_as_indentation(tmp_path):
    f = tmp_path / "indent.yaml"
    f.write_text("kind: InferenceDeployment\nspec:\n  model: {name: chat}\n   replicas: {min: 1}\n")
    with pytest.raises(SpecError) as exc:
        load_deployments([f])
    head, line, caret = exc.value.problems[0].split("\n")
    assert head.startswith(f"{f}: invalid YAML at line 4, column 4: ") and "indentation" in head
    assert line.strip() == "replicas: {min: 1}" and caret.index("^") == line.index("r")


def test_an_unknown_field_close_to_a_known_one_says_which(tmp_path):
    doc = {"apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment", "metadata": {"name": "c"},
           "spec": {"model": {"name": "c", "source": "sim://tiny"}, "replcas": {"min": 1},
                    "resources": {"acelerator": "cpu"}, "rollout": {"steps": [{"wieght": 5}]}, "zzz": 1}}
    with pytest.raises(SpecError) as exc:
        parse_document(doc)
    said = set(exc.value.problems)
    assert "spec.replcas: unknown field; did you mean 'replicas'?" in said
    assert "spec.resources.acelerator: unknown field; did you mean 'accelerator'?" in said
    assert "spec.rollout.steps[0].wieght: unknown field; did you mean 'weight'?" in said
    assert "spec.zzz: unknown field" in said   # nothing close: no guess


def test_non_mapping_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(SpecError) as exc:
        load_deployments([empty, scalar, tmp_path / "missing.yaml"])
    problems = exc.value.problems
    assert problems[0] == f"{empty}: no documents"
    assert problems[1] == f"{scalar}[0] (document): must be a mapping, got int"
    assert problems[2].startswith(f"{tmp_path / 'missing.yaml'}: cannot read")


def test_relative_model_path_resolves_against_the_yaml_file(tmp_path):
    f = tmp_path / "sub" / "d.yaml"
    f.parent.mkdir()
    f.write_text(yaml.safe_dump(VALID))
    ld = load_deployments([f])[0]
    assert ld.deployment.spec.model.local_path(ld.base_dir) == (tmp_path / "sub" / "models" / "tiny").resolve()
    dep = parse_document(with_change("spec.model.source", "file:///opt/m"))
    assert str(dep.spec.model.local_path(tmp_path)) == "/opt/m"
    assert parse_document(with_change("spec.model.source", "hf://org/m")).spec.model.local_path(tmp_path) is None
