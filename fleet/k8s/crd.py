"""The `InferenceDeployment` CustomResourceDefinition, generated from the pydantic spec.

Owns `crd_document` (the CRD as a dict), `spec_schema` (the ``openAPIV3Schema`` of one
resource) and `crd_yaml` (what `fleet crd` prints and what the chart ships in
``charts/fleet/files/crd-inferencedeployments.yaml``; tests/unit/test_k8s_crd.py fails when the
two drift). The same YAML file `fleet up` takes is what `kubectl apply` takes: the schema is
`fleet.spec.InferenceDeployment`'s JSON Schema made *structural* (Kubernetes
"Specifying a structural schema", apiextensions.k8s.io/v1): ``$ref`` inlined, ``anyOf`` with
``null`` turned into ``nullable: true``, ``const`` into a one-value ``enum``, a string-or-list-of-strings (``gpuProduct``) into a node
that keeps any value (``x-kubernetes-preserve-unknown-fields``; the operator checks it), JSON Schema 2020's
numeric ``exclusiveMinimum``/``exclusiveMaximum`` into OpenAPI v3.0's ``minimum`` +
``exclusiveMinimum: true``, and ``additionalProperties: false`` dropped (Kubernetes prunes
unknown fields, and ``kubectl apply`` rejects them with server-side field validation).

Cross-field rules (min <= max, MIG needs TP 1, ...) are CEL ``x-kubernetes-validations`` on the
node of the section that declares them, written by `fleet.base.spec.SpecModel` from the same
`fleet.base.rules.CrossFieldRule` records pydantic enforces: ``kubectl apply`` refuses each with
the words `fleet validate` prints (Kubernetes 1.25 and later evaluate the rules, 1.29 and later
render the messages with values, `MESSAGE_EXPRESSIONS_SINCE`; an older server ignores them). The operator still validates every
resource with `fleet.spec.parse_document` and reports a failure in the resource's status
(condition Ready=False, reason InvalidSpec), for what CEL cannot say (a model source that does
not parse, a reserved engine flag) and for servers that skip the rules.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from fleet.spec import API_VERSION, KIND, InferenceDeployment

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "inferencedeployments"
SINGULAR = "inferencedeployment"
SHORT_NAMES = ["infd"]
CRD_NAME = f"{PLURAL}.{GROUP}"

# Keys of JSON Schema that a Kubernetes structural schema accepts (JSONSchemaProps).
_KEEP = {
    "type", "description", "properties", "items", "additionalProperties", "required", "enum", "default",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern",
    "minItems", "maxItems", "format", "nullable", "x-kubernetes-validations",
}  # fmt: skip

_STATUS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "What the operator observed; written by the operator only (status subresource).",
    "properties": {
        "observedGeneration": {"type": "integer", "description": "metadata.generation this status describes."},
        "desiredReplicas": {"type": "integer", "description": "Target replica count and why (desiredReason)."},
        "desiredReason": {"type": "string"},
        "readyReplicas": {"type": "integer", "description": "Replicas in the router's pool."},
        "standbyReplicas": {"type": "integer", "description": "Replicas asleep out of the pool, woken on a scale-up "
                            "(spec.standby)."},
        "standbyUnsupported": {"type": "string", "description": "Why spec.standby is off for this deployment "
                               "(its engine cannot sleep here); absent when it is not."},
        "replicas": {"type": "object", "additionalProperties": {"type": "integer"},
                     "description": "Replica count by state (PENDING, STARTING, WARMING, READY, STANDBY, DRAINING, "
                                    "FAILED_*)."},
        "revisions": {"type": "object", "additionalProperties": {"type": "integer"},
                      "description": "Live replicas by spec.model.revision."},
        "servingHash": {"type": "string", "description": "What the current replicas serve (fleet.spec.LoadedDeployment.serving_hash)."},
        "nextIndex": {"type": "integer", "description": "Index of the next replica id (<name>-<index>)."},
        "preemptions": {
            "type": "array",
            "description": "The latest preemptions this deployment took part in, as victim or as the deployment "
                           "replicas were preempted for (spec.priority; docs/placement.md).",
            "items": {
                "type": "object",
                "properties": {
                    "replica": {"type": "string", "description": "The replica drained."},
                    "deployment": {"type": "string", "description": "Its deployment (the victim)."},
                    "for": {"type": "string", "description": "The higher-priority deployment it was drained for."},
                    "reason": {"type": "string"},
                    "time": {"type": "string", "format": "date-time"},
                },
            },
        },
        "conditions": {
            "type": "array",
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
            "items": {
                "type": "object",
                "required": ["type", "status"],
                "properties": {
                    "type": {"type": "string", "enum": ["Ready", "Progressing", "Degraded"]},
                    "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                    "reason": {"type": "string"},
                    "message": {"type": "string"},
                    "observedGeneration": {"type": "integer"},
                    "lastTransitionTime": {"type": "string", "format": "date-time"},
                },
            },
        },
    },
}  # fmt: skip


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    """One JSON Schema node -> its structural OpenAPI v3.0 form (recursively)."""
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        ref = node.pop("$ref").split("/")[-1]
        node = {**copy.deepcopy(defs[ref]), **node}
    nullable = False
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o != {"type": "null"}]
        nullable = True   # pydantic writes X | None as anyOf [X, null]
        if options == [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]:
            # A name or a list of names (gpuProduct): a structural schema has no string-or-array
            # type, so the node keeps any value and the operator's pydantic check decides.
            return {"description": node.get("description", ""), "x-kubernetes-preserve-unknown-fields": True,
                    "nullable": True}
        if len(options) != 1:
            raise ValueError(f"cannot make a structural schema of anyOf {options!r}")
        option = options[0]
        if "$ref" in option:
            option = {**copy.deepcopy(defs[option["$ref"].split("/")[-1]])}
        node = {**option, **node}
    if "const" in node:
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string")
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key not in _KEEP:
            continue
        if key == "properties":
            out[key] = {name: _structural(v, defs) for name, v in value.items()}
        elif key in ("items", "additionalProperties"):
            if value is False:
                continue   # extra="forbid": Kubernetes prunes unknown fields instead
            out[key] = _structural(value, defs) if isinstance(value, dict) else value
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out[key.replace("exclusiveM", "m")] = value
            out[key] = True
        elif key == "default" and value is None:
            continue
        else:
            out[key] = value
    if nullable:
        out["nullable"] = True
    return out


def _registry_enums(spec: dict[str, Any]) -> None:
    """Names the pydantic validators check against registries become enums (strict on
    ``kubectl apply``); the MIG profile gets its pattern."""
    from autoscaler.policy import policy_names as autoscaling_policies
    from fleet.engines.kinds import engine_kinds
    from fleet.base.names import MIG_PROFILE
    from router.pools.policies import policy_names as routing_policies

    props = spec["properties"]
    props["engine"]["properties"]["kind"]["enum"] = engine_kinds()
    props["routing"]["properties"]["policy"]["enum"] = sorted(routing_policies())
    props["autoscaling"]["properties"]["policy"]["enum"] = sorted(autoscaling_policies())
    props["resources"]["properties"]["migProfile"]["pattern"] = MIG_PROFILE.pattern


def spec_schema() -> dict[str, Any]:
    """The ``openAPIV3Schema`` of one InferenceDeployment resource: apiVersion, kind, metadata
    (left to Kubernetes), ``spec`` from `fleet.spec.DeploymentSpec` and the operator's ``status``."""
    full = InferenceDeployment.model_json_schema(by_alias=True)
    defs = full.get("$defs", {})
    spec = _structural(full["properties"]["spec"], defs)
    _registry_enums(spec)
    spec["description"] = ("The deployment: the same `spec` `fleet up` reads (fleet/spec.py). Cross-field "
                           "rules are checked at admission (x-kubernetes-validations) and by the operator; see "
                           "status.conditions.")
    return {
        "type": "object",
        "description": "A model served by homogeneous replicas behind Fleet's router.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": copy.deepcopy(_STATUS_SCHEMA),
        },
    }


MESSAGE_EXPRESSIONS_SINCE = (1, 29)
"""The first Kubernetes whose CEL has the strings library's ``format``, which the rules' message
expressions use (k8s.io/apiserver/pkg/cel/environment/base.go: strings library version 2 from
1.29, version 0 before); 1.27 and 1.28 refuse a CRD whose messageExpression calls it."""

VALIDATION_RULES_SINCE = (1, 25)
"""The first Kubernetes that knows ``x-kubernetes-validations`` (beta, on by default, in 1.25).
An older API server drops the rules from a CRD it stores (checked on 1.20.2:
tests/integration/test_real_control_plane.py), and a client that validates against its OpenAPI
(``helm install`` on those versions) refuses the unknown field: that copy carries none."""

CHART_FILES = {None: "crd-inferencedeployments.yaml", (1, 28): "crd-inferencedeployments-before-1.29.yaml",
               (1, 24): "crd-inferencedeployments-before-1.25.yaml"}
"""The chart's copies of the CRD under charts/fleet/files/, by the newest Kubernetes each is for
(None: every version from `MESSAGE_EXPRESSIONS_SINCE` on); charts/fleet/templates/crd.yaml picks
one by ``.Capabilities.KubeVersion``."""


def crd_document(kube_version: tuple[int, int] | None = None) -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) as a dict: namespaced, one served
    and stored version, status subresource, and the scale subresource on
    ``spec.replicas.initial`` (``kubectl scale`` sets the starting size; the autoscaler owns the rest).

    ``kube_version`` (major, minor): the Kubernetes it is for; None for the newest. Before
    `MESSAGE_EXPRESSIONS_SINCE` the CEL rules keep their static ``message`` only (the sentence
    with the values' fields in angle brackets); before `VALIDATION_RULES_SINCE` there are none (the
    operator still refuses such a spec, in the resource's status)."""
    schema = spec_schema()
    if kube_version is not None and kube_version < VALIDATION_RULES_SINCE:
        _drop_validation_rules(schema)
    elif kube_version is not None and kube_version < MESSAGE_EXPRESSIONS_SINCE:
        _drop_message_expressions(schema)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "fleet"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": SINGULAR,
                      "shortNames": list(SHORT_NAMES), "categories": ["fleet"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": schema},
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Model", "type": "string", "jsonPath": ".spec.model.name"},
                    {"name": "Desired", "type": "integer", "jsonPath": ".status.desiredReplicas"},
                    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
                    {"name": "Standby", "type": "integer", "jsonPath": ".status.standbyReplicas"},
                    {"name": "Status", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Ready\")].reason"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
            }],
        },
    }  # fmt: skip


def _drop_validation_rules(node: Any) -> None:
    if isinstance(node, dict):
        node.pop("x-kubernetes-validations", None)
        for child in node.values():
            _drop_validation_rules(child)
    elif isinstance(node, list):
        for child in node:
            _drop_validation_rules(child)


def _drop_message_expressions(node: Any) -> None:
    if isinstance(node, dict):
        for rule in node.get("x-kubernetes-validations", []):
            rule.pop("messageExpression", None)
        for child in node.values():
            _drop_message_expressions(child)


def crd_yaml(kube_version: tuple[int, int] | None = None) -> str:
    """The CRD as YAML text (`fleet crd [--kube-version X.Y]`; the chart's `CHART_FILES`)."""
    command = "fleet crd" + (f" --kube-version {kube_version[0]}.{kube_version[1]}" if kube_version else "")
    test = "tests/unit/test_k8s_crd.py" if kube_version is None else "tests/unit/test_cross_field_rules.py"
    header = f"# Generated by `{command}` from fleet/spec.py: do not edit ({test} checks it).\n"
    return header + yaml.safe_dump(crd_document(kube_version), sort_keys=False, width=120)
