"""Every cross-field rule of the spec (fleet/base/rules.py) is declared once and reaches both
sides: pydantic refuses each rule's example with the rule's words at the rule's field and admits
its boundary, and the CRD carries the rule's CEL at the section's node. The real API server's
side of the same examples: tests/integration/test_crd_real_apiserver.py."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from fleet.base.rules import CrossFieldRule, cel_string, sections_in, walk_rules
from fleet.base.spec import SpecModel
from fleet.k8s.crd import CHART_FILES, MESSAGE_EXPRESSIONS_SINCE, crd_document, crd_yaml
from fleet.spec import DeploymentSpec, SpecError, parse_document

BASE = {
    "apiVersion": "fleet.inference.dev/v1alpha1", "kind": "InferenceDeployment",
    "metadata": {"name": "sim-chat"},
    "spec": {"model": {"name": "llama-8b-sim", "source": "sim://h100-llama-8b"},
             "engine": {"kind": "sim", "args": ["--seed", "1"], "startupTimeoutSeconds": 60},
             "resources": {"accelerator": "cpu", "cpuCores": 1}, "replicas": {"min": 1, "max": 4, "initial": 2},
             "warmup": {"requests": [{"kind": "completion", "prompt": "Hello", "maxTokens": 4}]}},
}  # fmt: skip

RULES = list(walk_rules(DeploymentSpec, "spec"))
CHART = Path(__file__).resolve().parents[2] / "charts" / "fleet" / "files"


def rule_id(case: tuple[str, type, CrossFieldRule]) -> str:
    path, _model, rule = case
    return f"{path}.{rule.field}" if rule.field else path


def with_change(change: dict) -> dict:
    doc = copy.deepcopy(BASE)
    doc["spec"].update(copy.deepcopy(change))
    return doc


def error_path(node_path: str, rule: CrossFieldRule) -> str:
    """Where the error is: the node (a list's first item) and the rule's field."""
    path = node_path.replace("[]", "[0]")
    return f"{path}.{rule.field}" if rule.field else path


def template_pattern(rule: CrossFieldRule) -> str:
    parts = re.split(r"\{[A-Za-z][A-Za-z0-9.]*\}", rule.message)
    return "(.+)".join(re.escape(p) for p in parts)


def test_the_spec_has_its_cross_field_rules():
    sections = {path for path, _model, _rule in RULES}
    assert {"spec", "spec.resources", "spec.replicas", "spec.autoscaling", "spec.warmup", "spec.rollout",
            "spec.rollout.steps[]", "spec.rollout.stickiness", "spec.rollout.analysis.metrics[]"} <= sections
    assert len(RULES) >= 23
    cels = [(path, rule.cel) for path, _model, rule in RULES if rule.cel is not None]
    assert len(set(cels)) == len(cels), "two rules of one section with the same CEL"


def test_only_the_rules_cel_cannot_read_are_left_out_of_the_crd():
    """gpuProduct is a name or a list of names: the structural schema keeps it untyped
    (x-kubernetes-preserve-unknown-fields), and the API server leaves such a field out of CEL's
    view (``undefined field 'gpuProduct'`` when the CRD is created)."""
    assert [rule_id(c) for c in RULES if c[2].cel is None] == ["spec.resources.gpuProduct"]
    with pytest.raises(ValueError, match="give cel, or no_cel"):
        CrossFieldRule(cel=None, holds=bool, field="x", message="m", breaks={}, keeps=({},))


@pytest.mark.parametrize("case", RULES, ids=rule_id)
def test_pydantic_refuses_each_rules_example_with_its_words(case):
    path, _model, rule = case
    with pytest.raises(SpecError) as refused:
        parse_document(with_change(rule.breaks))
    assert len(refused.value.problems) == 1, refused.value.problems
    line = refused.value.problems[0]
    where, _, reason = line.partition(": ")
    assert where == error_path(path, rule), line
    assert re.fullmatch(template_pattern(rule), reason), (line, rule.message)


@pytest.mark.parametrize("case", RULES, ids=rule_id)
def test_pydantic_admits_each_rules_boundary(case):
    for keeps in case[2].keeps:
        parse_document(with_change(keeps))


def test_a_rule_without_a_boundary_is_refused_where_it_is_declared():
    with pytest.raises(ValueError, match="give keeps"):
        CrossFieldRule(cel="true", holds=bool, field="x", message="m", breaks={}, keeps=())


def test_the_crd_carries_each_rule_at_its_sections_node():
    schema = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    for path, model, rule in (c for c in RULES if c[2].cel is not None):
        assert rule.kubernetes(model) in _node(schema, path).get("x-kubernetes-validations", []), (path, rule.cel)


def _node(schema: dict, path: str) -> dict:
    node = schema["properties"]["spec"]
    for part in path.split(".")[1:]:
        node = node["properties"][part.removesuffix("[]")]
        if part.endswith("[]"):
            node = node["items"]
    return node


def test_the_crd_has_no_rule_the_spec_does_not_declare():
    schema = crd_document()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    declared = {(path, rule.cel) for path, _model, rule in RULES if rule.cel is not None}
    found = set()

    def walk(node: dict, path: str) -> None:
        found.update((path, v["rule"]) for v in node.get("x-kubernetes-validations", []))
        for key, child in (node.get("properties") or {}).items():
            walk(child, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema["properties"]["spec"], "spec")
    assert found == declared


# Model validators that are not cross-field rules: each checks one field's value against a
# fixed set, which the CRD cannot say with a CEL rule over the section. A new cross-field check
# belongs in `cross_field_rules`, where the CRD gets it too.
SINGLE_FIELD_VALIDATORS = {"EngineSpec._reserved"}


def _models(model: type[SpecModel], seen: set[type]) -> set[type]:
    if model in seen:
        return seen
    seen.add(model)
    for info in model.model_fields.values():
        for section, _ in sections_in(info.annotation):
            _models(section, seen)
    return seen


def test_no_section_checks_several_fields_outside_its_rules():
    found = set()
    for model in _models(DeploymentSpec, set()):
        for name in model.__pydantic_decorators__.model_validators:
            if name != "_cross_field_rules":
                found.add(f"{model.__name__}.{name}")
    assert found == SINGLE_FIELD_VALIDATORS


@pytest.mark.parametrize(("value", "text"), [
    (3, "3"), (3.0, "3"), (0.5, "0.5"), (2.25, "2.25"), (1e6, "1e+06"), (1234567.0, "1.234567e+06"),
    (123456.7, "123456.7"), (0.0001, "0.0001"), (1e-5, "1e-05"), (-2.5, "-2.5"), (True, "true"), ("3g.40gb", "3g.40gb"),
])  # fmt: skip
def test_values_read_as_cels_format_writes_them(value, text):
    """cel-go's string(double) and format's %s are Go's %g: what the API server's
    messageExpression prints (seen on the real apiextensions-apiserver 0.36 for each value here)."""
    assert cel_string(value) == text


def test_a_message_value_under_an_absent_section_is_its_default():
    rule = next(r for path, _m, r in RULES if path == "spec" and r.field == "replicas.max")
    expression = rule.kubernetes(DeploymentSpec)["messageExpression"]
    assert expression == ("'must be > spec.replicas.min to autoscale (both %s); raise it, or remove spec.autoscaling'"
                          ".format([(has(self.replicas) ? self.replicas.max : 1)])")


def _validations(node: object) -> list[dict]:
    if isinstance(node, list):
        return [v for child in node for v in _validations(child)]
    if not isinstance(node, dict):
        return []
    found = list(node.get("x-kubernetes-validations", []))
    for key, child in node.items():
        if key != "x-kubernetes-validations":
            found += _validations(child)
    return found


@pytest.mark.parametrize("kube_version", list(CHART_FILES))
def test_the_charts_copies_are_the_generated_ones(kube_version):
    flag = f" --kube-version {kube_version[0]}.{kube_version[1]}" if kube_version else ""
    assert (CHART / CHART_FILES[kube_version]).read_text() == crd_yaml(kube_version), (
        f"charts/fleet/files/{CHART_FILES[kube_version]} drifted from the spec: regenerate it with "
        f"`fleet crd{flag} > charts/fleet/files/{CHART_FILES[kube_version]}`")


def test_before_1_29_the_rules_keep_static_messages_naming_the_fields():
    """1.27 and 1.28 know messageExpression but not CEL's format(), and refuse a CRD calling it."""
    assert max(v for v in CHART_FILES if v is not None) < MESSAGE_EXPRESSIONS_SINCE
    old = _validations(crd_document((1, 28)))
    new = _validations(crd_document())
    assert len(old) == len(new) >= 22
    assert not any("messageExpression" in v for v in old)
    assert sum("messageExpression" in v for v in new) >= 10
    assert {"rule": "self.min <= self.max", "message": "must be <= spec.replicas.max (<min> > <max>)",
            "fieldPath": ".min"} in old
    # A rule whose words have no values says them in full on every version.
    words = {r.message for _p, _m, r in RULES if not r.placeholders and r.cel is not None}
    assert words <= {v["message"] for v in old} and words <= {v["message"] for v in new}


def test_before_1_25_the_crd_carries_no_rules_the_server_would_not_know():
    """1.20-1.24 know no x-kubernetes-validations: the API server drops them, and a client that
    validates against its OpenAPI (``helm install``) refuses the field. Those versions get none;
    1.25-1.28 get every rule."""
    assert _validations(crd_document((1, 24))) == []
    assert len(_validations(crd_document((1, 25)))) == len(_validations(crd_document()))
