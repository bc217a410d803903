"""The spec reference is generated from the pydantic models (fleet/cli/explain.py, `fleet explain`):
docs/spec-reference.md must be today's generation, every field must carry a description, the
reference must list exactly the fields the CRD has, and a path lookup must give a field's subtree
or exit 2 naming the path and the fields that exist where it stopped matching."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field
from typer.testing import CliRunner

from fleet.cli import app
from fleet.cli.explain import HEADER, UnknownField, lookup, reference_markdown, spec_fields, undocumented
from fleet.k8s.crd import spec_schema
from fleet.base.spec import SpecModel

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "spec-reference.md"
runner = CliRunner()


def test_the_committed_reference_is_the_generated_one():
    assert REFERENCE.read_text() == reference_markdown(), (
        "docs/spec-reference.md differs from the spec models' reference: regenerate it with "
        "`fleet explain > docs/spec-reference.md` (from the repository root) and commit it"
    )


def test_fleet_explain_prints_the_whole_reference():
    result = runner.invoke(app, ["explain"])
    assert result.exit_code == 0, result.output
    assert result.output == reference_markdown()
    assert result.output.splitlines()[0] == HEADER


def test_every_field_has_a_description():
    missing = undocumented()
    assert missing == [], (
        "these spec fields have no Field(description=...): " + ", ".join(missing)
        + " (add one in the model that declares the field; then regenerate docs/spec-reference.md and the CRD)"
    )


def _crd_paths(node: dict, prefix: str) -> set[str]:
    paths = set()
    for name, child in (node.get("properties") or {}).items():
        path = f"{prefix}.{name}"
        paths.add(path)
        paths |= _crd_paths(child, path)
    if isinstance(node.get("items"), dict):
        paths |= _crd_paths(node["items"], prefix + "[]")
    return paths


def test_the_reference_lists_exactly_the_fields_of_the_crd():
    """Both are generated from the same models; a field in one and not the other is a generator bug."""
    crd = _crd_paths(spec_schema()["properties"]["spec"], "spec")
    ours = {f.path for f in spec_fields() if f.path.startswith("spec.")}
    assert ours == crd


def test_yaml_names_types_defaults_and_constraints():
    by_path = {f.path: f for f in spec_fields()}
    f = by_path["spec.autoscaling.queueTimeTargetSeconds"]
    assert (f.type, f.default, f.constraints, f.required) == ("number", "0.5", ("> 0", "<= 3600"), False)
    assert by_path["spec.autoscaling"].type == "object" and by_path["spec.autoscaling"].default == "unset"
    assert by_path["spec.model.source"].required
    assert by_path["spec.engine.env"].type == "map of string to string"
    assert by_path["spec.engine.args"].type == "list of string"
    assert by_path["spec.resources.accelerator"].constraints == ("one of: `gpu`, `cpu`",)
    assert any(c.startswith("pattern `^[1-7]g") for c in by_path["spec.resources.migProfile"].constraints)
    assert "`kv-aware`" in by_path["spec.routing.policy"].constraints[0]     # the routing registry
    assert by_path["spec.rollout.analysis.metrics"].constraints == ("at least 1 item",)
    assert by_path["spec.rollout.steps[].weight"].segments == ("spec", "rollout", "steps", "weight")
    assert "prePull" in by_path["spec.prePull"].path   # camelCase alias, not pre_pull


def test_explain_a_path_prints_that_subtree():
    result = runner.invoke(app, ["explain", "spec.autoscaling"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("### `spec.autoscaling`\n")
    block = "### `spec.autoscaling.queueTimeTargetSeconds`\n\n**number** · default `0.5` · > 0; <= 3600\n\nTarget"
    assert block in result.output
    assert "### `spec.autoscaling.kpa.stableWindowSeconds`" in result.output
    assert "spec.routing" not in result.output and HEADER not in result.output


@pytest.mark.parametrize("path", ["spec.rollout.steps.weight", "spec.rollout.steps[].weight",
                                  "spec.rollout.steps[0].weight"])  # fmt: skip
def test_list_indexes_are_optional_in_a_path(path):
    result = runner.invoke(app, ["explain", path])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("### `spec.rollout.steps[].weight`\n\n**number** · unset by default · > 0; < 100")
    assert result.output.count("### ") == 1


def test_an_unknown_field_exits_2_naming_it_and_the_fields_there():
    result = runner.invoke(app, ["explain", "spec.autoscaling.queueTarget"])
    assert result.exit_code == 2
    assert "spec.autoscaling.queueTarget: spec.autoscaling has no field 'queueTarget'" in result.output
    assert "queueTimeTargetSeconds, ttftP99TargetSeconds" in result.output


def test_unknown_fields_at_the_root_and_under_a_scalar():
    with pytest.raises(UnknownField) as err:
        lookup("specs.model")
    assert err.value.valid == "" and err.value.choices == ["apiVersion", "kind", "metadata", "spec"]
    assert "the document has no field 'specs'" in str(err.value)
    with pytest.raises(UnknownField) as err:
        lookup("spec.replicas.min.value")
    assert str(err.value) == ("spec.replicas.min.value: spec.replicas.min is an integer and has no fields; "
                              "fields of spec.replicas: min, max, initial")  # fmt: skip


class _Inner(SpecModel):
    x: int = Field(1, ge=0, description="An integer.")


class _Outer(SpecModel):
    by_name: dict[str, _Inner] = Field(default_factory=dict, description="Objects by name.")
    either: int | str = Field(0, description="A number or a name.")
    items: list[_Inner] | None = Field(None, min_length=1, description="Objects in order.")


def test_maps_unions_and_optional_lists_of_objects():
    fields = {f.path: f for f in spec_fields(_Outer)}
    assert list(fields) == ["byName", "byName.*.x", "either", "items", "items[].x"]
    assert fields["byName"].type == "map of string to object" and fields["byName"].has_fields
    assert fields["byName.*.x"].segments == ("byName", "*", "x") and fields["byName.*.x"].constraints == (">= 0",)
    assert (fields["either"].type, fields["either"].default) == ("integer or string", "0")
    assert (fields["items"].type, fields["items"].default, fields["items"].constraints) == (
        "list of object", "unset", ("at least 1 item",))
    assert [f.path for f in lookup("items.x", list(fields.values()))] == ["items[].x"]


def test_an_annotation_it_cannot_describe_is_named():
    class Odd(SpecModel):
        z: complex = Field(0j, description="Not a YAML type.")

    with pytest.raises(TypeError, match="cannot describe the annotation <class 'complex'>"):
        spec_fields(Odd)
