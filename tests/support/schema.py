"""Check documents against a CRD's ``openAPIV3Schema`` with `jsonschema`, offline.

What an API server would do on ``kubectl apply`` for the schema part (no API server runs on the
test machines: docs/kubernetes.md). OpenAPI v3.0's ``nullable: true`` has no JSON Schema
draft-4 keyword: it becomes ``type: [T, "null"]``; the ``x-kubernetes-*`` extensions are ignored.
Draft 4 is used because its ``exclusiveMinimum`` is the boolean form OpenAPI v3.0 (and so
Kubernetes) uses.
"""

from __future__ import annotations

from typing import Any

import jsonschema


def to_json_schema(node: Any) -> Any:
    """A structural OpenAPI v3.0 schema -> JSON Schema draft 4 (recursively)."""
    if isinstance(node, list):
        return [to_json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: to_json_schema(v) if k in ("properties", "items", "additionalProperties") or isinstance(v, dict)
           else v for k, v in node.items() if not k.startswith("x-kubernetes-")}  # fmt: skip
    if "properties" in out:
        out["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        out["additionalProperties"] = False    # what kubectl's strict field validation rejects
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


def validator_for(crd: dict) -> jsonschema.Draft4Validator:
    """A validator of resources of ``crd``'s (only) version."""
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    js = to_json_schema(schema)
    js["properties"]["metadata"] = {"type": "object"}   # left to the API server
    return jsonschema.Draft4Validator(js)


def schema_errors(crd: dict, doc: dict) -> list[str]:
    """Every schema violation of ``doc``, as ``path: message`` lines ([] when valid)."""
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(document)'}: {e.message}"
            for e in validator_for(crd).iter_errors(doc)]  # fmt: skip


def structural_problems(schema: Any, path: str = "") -> list[str]:
    """Why ``schema`` is not a Kubernetes structural schema ([] when it is): every node has a
    ``type``; no ``$ref``, ``anyOf``/``oneOf``/``allOf``/``not`` or ``const``; ``properties`` and
    ``additionalProperties`` not together; ``additionalProperties`` never false."""
    problems = []
    if not isinstance(schema, dict):
        return [f"{path or '/'}: not a mapping"]
    for key in ("$ref", "anyOf", "oneOf", "allOf", "not", "const", "$defs", "title"):
        if key in schema:
            problems.append(f"{path or '/'}: has {key}")
    if "type" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path or '/'}: no type")
    if "properties" in schema and "additionalProperties" in schema:
        problems.append(f"{path or '/'}: properties and additionalProperties together")
    if schema.get("additionalProperties") is False:
        problems.append(f"{path or '/'}: additionalProperties: false")
    for name, sub in (schema.get("properties") or {}).items():
        problems += structural_problems(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            problems += structural_problems(schema[key], f"{path}.{key}")
    return problems
