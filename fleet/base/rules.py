"""Cross-field rules of the spec, each declared once for pydantic and for the CRD's CEL.

Owns `CrossFieldRule` (one rule: the CEL expression the Kubernetes API server evaluates, the
Python predicate `fleet validate` evaluates, the field the error names, the message both print,
examples that break it and that it admits), `cel_string` (a value as the API server's CEL
writes it), `walk_rules` (every rule of a model tree with the path of the node it sits on) and
`sections_in` (the models inside a field's type). Read by `fleet.base.spec.SpecModel`, by the
section models that declare rules (`fleet.spec`, `autoscaler.spec`, `warmup.plan`,
`fleet.rollout.spec`) and by the tests named below.

A spec section lists its rules in ``cross_field_rules`` (a ClassVar of `fleet.base.spec.SpecModel`);
the base model enforces them after the fields are validated and writes them into the section's
JSON Schema as ``x-kubernetes-validations``, which `fleet.k8s.crd` keeps in the CRD. So
``kubectl apply`` and `fleet validate` refuse the same mistakes with the same words:
``spec.replicas.min: must be <= spec.replicas.max (3 > 2)`` from `fleet validate`, and
``spec.replicas.min: Invalid value: must be <= spec.replicas.max (3 > 2)`` from the API server
(the message rendered there by a CEL ``messageExpression``; CEL's ``has()`` is false for a field
that is absent or null, as pydantic's None). Tests prove each rule's examples on both sides:
tests/unit/test_cross_field_rules.py (pydantic) and tests/integration/test_crd_real_apiserver.py
(the real apiextensions-apiserver).

CEL on CRDs: ``x-kubernetes-validations`` (Kubernetes >= 1.25, GA in 1.29), ``messageExpression``
and ``fieldPath`` (>= 1.28); kubernetes.io/docs/tasks/extend-kubernetes/custom-resources/
custom-resource-definitions/#validation-rules. Imports nothing of Fleet's.
"""

from __future__ import annotations

import math
import re
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from decimal import Decimal
from typing import Any

from pydantic import BaseModel
from pydantic.alias_generators import to_snake

_PLACEHOLDER = re.compile(r"\{([A-Za-z][A-Za-z0-9.]*)\}")


@dataclass(frozen=True)
class CrossFieldRule:
    """One rule over several fields of a spec section (the section is CEL's ``self``).

    ``cel``: the CEL expression, true when the section is valid; fields without a default are
    guarded with ``has()`` (the API server applies the schema's defaults before the rule runs,
    but only inside objects that are present). ``holds``: the same rule in Python, over the
    validated pydantic model. ``field``: the camelCase path, relative to the section, that the
    error names (``"min"``, ``"replicas.max"``); "" names the section itself. ``message``: the
    reason both sides print; ``{path}`` placeholders (camelCase, relative to the section) are
    replaced by the field's value as CEL writes it (`cel_string`), so a message only names
    fields that are set whenever the rule fails. ``breaks``: a change of ``spec``'s
    top-level sections (each section replaced whole) that breaks this rule and no other, whatever
    valid spec it is merged into; its breaking list item, if any, comes first. ``keeps``: at
    least one change like it at the rule's boundary (equal bounds, an absent field that pydantic
    defaults), which both sides admit. ``no_cel``: why a rule has no CEL (``cel`` None): only
    pydantic and the operator check it. Raises ValueError without ``keeps``, or without exactly
    one of ``cel`` and ``no_cel``.
    """

    cel: str | None
    holds: Callable[[Any], bool]
    field: str
    message: str
    breaks: dict[str, Any]
    keeps: tuple[dict[str, Any], ...]
    no_cel: str = ""
    placeholders: tuple[str, ...] = dataclass_field(init=False)

    def __post_init__(self) -> None:
        if (self.cel is None) != bool(self.no_cel):
            raise ValueError(f"rule on {self.field or 'its section'}: give cel, or no_cel saying why there is none")
        if not self.keeps:
            raise ValueError(f"rule on {self.field or 'its section'}: give keeps, a change at its boundary")
        object.__setattr__(self, "placeholders", tuple(_PLACEHOLDER.findall(self.message)))

    def reason(self, model: BaseModel) -> str:
        """The message with the model's values in it: what `fleet validate` prints after the path."""
        return _PLACEHOLDER.sub(lambda m: cel_string(_value(model, m.group(1))), self.message)

    def broken(self, model: BaseModel) -> str | None:
        """The reason the model breaks the rule (`reason`), or None when it holds."""
        return None if self.holds(model) else self.reason(model)

    def kubernetes(self, model: type[BaseModel]) -> dict[str, str]:
        """The rule as one item of ``x-kubernetes-validations`` on ``model``'s schema node:
        ``rule``, ``message``, ``fieldPath``, and for a message with values ``messageExpression``.

        ``message`` is the sentence with each value's field in angle brackets (``(<min> >
        <max>)``): what a server says that cannot render the expression. ``messageExpression`` is
        CEL's ``'... %s ...'.format([self.a, ...])`` (the strings library's ``format``, Kubernetes
        1.29 and later): its cost is bounded where ``'...' + string(self.a)`` is not (the API
        server estimates ``string()`` of a number as unbounded and refuses the CRD)."""
        if self.cel is None:
            raise ValueError(f"rule on {self.field or model.__name__} has no CEL: {self.no_cel}")
        out = {"rule": self.cel, "message": _PLACEHOLDER.sub(r"<\1>", self.message)}
        if self.placeholders:
            template = _PLACEHOLDER.sub("%s", self.message.replace("%", "%%"))
            values = ", ".join(_cel_value(model, path) for path in self.placeholders)
            out["messageExpression"] = f"{_cel_literal(template)}.format([{values}])"
        if self.field:
            out["fieldPath"] = "." + self.field
        return out


def cel_string(value: Any) -> str:
    """``value`` as CEL's ``string()`` and ``format``'s ``%s`` write it on the API server
    (cel-go): ints in decimal, doubles as Go's ``%g`` (cel-go ``Double.ConvertToType``: the
    shortest digits that round-trip, an exponent below 1e-4 and from 1e6 on: ``1e+06``; ``3.0``
    is ``3``), booleans ``true``/``false``, strings as they are."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return _go_g(value)
    return "null" if value is None else str(value)


def _go_g(x: float) -> str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if x == 0:
        return "-0" if math.copysign(1, x) < 0 else "0"
    sign, digits, exponent = Decimal(repr(x)).normalize().as_tuple()
    text = "".join(map(str, digits))
    exp = len(digits) + int(exponent) - 1   # the decimal exponent of the first digit
    if exp < -4 or exp >= 6:
        mantissa = text[0] + ("." + text[1:] if len(text) > 1 else "")
        out = f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    elif exp < 0:
        out = "0." + "0" * (-exp - 1) + text
    else:
        out = text[: exp + 1].ljust(exp + 1, "0") + ("." + text[exp + 1:] if len(text) > exp + 1 else "")
    return ("-" if sign else "") + out


def _value(model: BaseModel, path: str) -> Any:
    value: Any = model
    for part in path.split("."):
        value = getattr(value, to_snake(part))
    return value


def _cel_literal(value: Any) -> str:
    """A Python value as a CEL literal (a string single-quoted, a double with its point)."""
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else f"double('{cel_string(value)}')"
    return str(value)


def _cel_value(model: type[BaseModel], path: str) -> str:
    """``self.<path>``; an optional object on the way falls back to the value its pydantic
    default has (the API server defaults fields only inside objects that are there)."""
    parts = path.split(".")
    expr = f"self.{path}"
    for i in range(len(parts) - 1, 0, -1):
        default = _default_of(model, parts[:i])
        if default is not None:
            expr = f"(has(self.{'.'.join(parts[:i])}) ? {expr} : {_cel_literal(_value(default, '.'.join(parts[i:])))})"
    return expr


def _default_of(model: type[BaseModel], parts: list[str]) -> BaseModel | None:
    """The default object of ``model``'s field at ``parts``, or None where the field is required
    (always there when the rule runs). Raises ValueError for an optional field without one."""
    value: Any = None
    cls: Any = model
    for part in parts:
        info = cls.model_fields[to_snake(part)]
        if value is None and info.is_required():
            cls = _sections_of(info.annotation)
            continue
        value = info.get_default(call_default_factory=True) if value is None else getattr(value, to_snake(part))
        if not isinstance(value, BaseModel):
            raise ValueError(f"{model.__name__}.{'.'.join(parts)} has no default object to read a message value from")
        cls = type(value)
    return value


def _sections_of(annotation: Any) -> type[BaseModel]:
    return next(section for section, _ in sections_in(annotation))


def walk_rules(model: type[BaseModel], path: str) -> Iterator[tuple[str, type[BaseModel], CrossFieldRule]]:
    """Every rule of ``model`` and of the sections under it, with the path of the node it sits
    on (``spec.replicas``; a list's items as ``spec.rollout.steps[]``) and the model declaring it."""
    for rule in getattr(model, "cross_field_rules", ()):
        yield path, model, rule
    for name, info in model.model_fields.items():
        child = f"{path}.{info.alias or name}"
        for section, suffix in sections_in(info.annotation):
            yield from walk_rules(section, child + suffix)


def sections_in(annotation: Any) -> Iterator[tuple[type[BaseModel], str]]:
    """The pydantic models in a field's type (``X``, ``X | None``, ``list[X]``), each with "[]"
    when its values are a list's items."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield annotation, ""
        return
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    for arg in args:
        for section, suffix in sections_in(arg):
            yield section, ("[]" + suffix if origin is list else suffix)
