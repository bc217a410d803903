"""Shared base for Fleet's YAML documents: camelCase fields, unknown fields rejected.

Owns `SpecModel` (the pydantic base every spec section derives from) and `FieldError`
(raised by cross-field validators to point the error at one sub-field). Used by `fleet.spec`
and by the section models that live beside the code that consumes them (`warmup.plan`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


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
