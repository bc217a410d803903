"""Shared base for Fleet's YAML documents: camelCase fields, unknown fields rejected.

Owns `SpecModel` (the pydantic base every spec section derives from: it enforces the section's
cross-field rules, `fleet.base.rules.CrossFieldRule`, and writes them into its JSON Schema as
``x-kubernetes-validations`` for the CRD) and `FieldError` (raised by a failing rule to point
the error at one sub-field). Used by `fleet.spec` and by the section models that live beside
the code that consumes them (`warmup.plan`, `autoscaler.spec`, `fleet.rollout.spec`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, GetJsonSchemaHandler, model_validator
from pydantic.alias_generators import to_camel
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from fleet.base.rules import CrossFieldRule


class SpecModel(BaseModel):
    """Base for spec sections: YAML keys are camelCase, Python attributes snake_case.

    Unknown keys are rejected (``extra="forbid"``) so a misspelt field is an error, never a
    silently ignored setting.
    """

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        validate_default=True,
    )

    cross_field_rules: ClassVar[tuple[CrossFieldRule, ...]] = ()
    """The section's rules over several fields, checked in order after its fields (the first
    that fails is the error) and emitted as the CRD's CEL rules (`fleet.base.rules`)."""

    @model_validator(mode="after")
    def _cross_field_rules(self) -> SpecModel:
        for rule in type(self).cross_field_rules:
            reason = rule.broken(self)
            if reason is not None:
                raise FieldError(rule.field, reason) if rule.field else ValueError(reason)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        schema = handler(core_schema)
        rules = [rule.kubernetes(cls) for rule in cls.cross_field_rules if rule.cel is not None]
        if rules:
            node: dict[str, Any] = handler.resolve_ref_schema(schema)
            node["x-kubernetes-validations"] = rules
        return schema

    def to_document(self) -> dict:
        """The section as it is written in YAML (camelCase keys, defaults included)."""
        return self.model_dump(mode="json", by_alias=True)


class FieldError(ValueError):
    """A cross-field validation failure that belongs to one sub-field.

    Raised inside a ``model_validator``; `fleet.spec.format_errors` appends ``field`` to the
    error's location so the message reads ``spec.replicas.min: must be <= ...``.
    """

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(reason)
        self.field = field
        self.reason = reason
