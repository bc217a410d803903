"""Object metadata checks that the real API server makes and the API-server stand-in
(fleet/testing/k8s/apiserver.py) makes the same way, so a value a real cluster refuses is
refused in the tests too. A TEST STAND-IN's part, with the rules and the words of Kubernetes:
apimachinery ``pkg/util/validation/validation.go`` (`IsQualifiedName`, `IsValidLabelValue`,
`IsDNS1123Subdomain`), ``pkg/apis/meta/v1/validation`` (`ValidateLabels`) and
``pkg/api/errors`` (`NewInvalid`: 422 ``Invalid``, the message
``<Kind>[.<group>] "<name>" is invalid: metadata.labels: Invalid value: "<v>": <why>``).

Owns `label_errors` (pure: a label map -> the field errors, as the real server words them) and
`check_labels` (raises `Invalid`). Called by `APIServerStandIn` on create, update and merge patch;
tests/unit/test_k8s_standin_labels.py checks the words against the real server's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from fleet.k8s.client import ApiError

_QNAME = "[A-Za-z0-9]"
_QNAME_EXT = "[-A-Za-z0-9_.]"
QUALIFIED_NAME_FMT = f"({_QNAME}{_QNAME_EXT}*)?{_QNAME}"
LABEL_VALUE_FMT = f"({QUALIFIED_NAME_FMT})?"
_DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN_FMT = _DNS1123_LABEL + "(\\." + _DNS1123_LABEL + ")*"
LABEL_VALUE_MAX_CHARS = 63
QUALIFIED_NAME_MAX_CHARS = 63
DNS1123_SUBDOMAIN_MAX_CHARS = 253
_QUALIFIED_NAME_MSG = ("must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
                       "alphanumeric character")  # fmt: skip
_LABEL_VALUE_MSG = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                    "and must start and end with an alphanumeric character")  # fmt: skip
_DNS1123_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                          "'.', and must start and end with an alphanumeric character")  # fmt: skip


def _regex_error(msg: str, fmt: str, *examples: str) -> str:
    """apimachinery's `RegexError`, word for word."""
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    return f"{msg} (e.g. " + " or ".join(f"'{e}', " for e in examples) + f"regex used for validation is '{fmt}')"


def _max_len(n: int) -> str:
    return f"must be no more than {n} characters"


def dns1123_subdomain_errors(value: str) -> list[str]:
    """`IsDNS1123Subdomain`: at most 253 characters, lower-case RFC 1123 labels joined by dots."""
    errs = [_max_len(DNS1123_SUBDOMAIN_MAX_CHARS)] if len(value) > DNS1123_SUBDOMAIN_MAX_CHARS else []
    if not re.fullmatch(DNS1123_SUBDOMAIN_FMT, value):
        errs.append(_regex_error(_DNS1123_SUBDOMAIN_MSG, DNS1123_SUBDOMAIN_FMT, "example.com"))
    return errs


def qualified_name_errors(value: str) -> list[str]:
    """`IsQualifiedName` (a label key): an optional DNS-subdomain prefix and ``/``, then a name
    of at most 63 characters."""
    parts = value.split("/")
    errs: list[str] = []
    if len(parts) > 2:
        return ["a qualified name " + _regex_error(_QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name",
                                                   "123-abc")
                + " with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')"]  # fmt: skip
    name = parts[-1]
    if len(parts) == 2:
        prefix = parts[0]
        if not prefix:
            errs.append("prefix part must be non-empty")
        else:
            errs += [f"prefix part {m}" for m in dns1123_subdomain_errors(prefix)]
    if not name:
        errs.append("name part must be non-empty")
    elif len(name) > QUALIFIED_NAME_MAX_CHARS:
        errs.append("name part " + _max_len(QUALIFIED_NAME_MAX_CHARS))
    if not re.fullmatch(QUALIFIED_NAME_FMT, name):
        errs.append("name part " + _regex_error(_QUALIFIED_NAME_MSG, QUALIFIED_NAME_FMT, "MyName", "my.name",
                                                "123-abc"))
    return errs


def label_value_errors(value: str) -> list[str]:
    """`IsValidLabelValue`: empty, or at most 63 alphanumerics, ``-``, ``_``, ``.``, starting
    and ending alphanumeric."""
    errs = [_max_len(LABEL_VALUE_MAX_CHARS)] if len(value) > LABEL_VALUE_MAX_CHARS else []
    if not re.fullmatch(LABEL_VALUE_FMT, value):
        errs.append(_regex_error(_LABEL_VALUE_MSG, LABEL_VALUE_FMT, "MyValue", "my_value", "12345"))
    return errs


def _quote(value: str) -> str:
    """Go's ``%q`` of a string, as the real server prints a bad value (json's escaping: close enough)."""
    return json.dumps(value, ensure_ascii=False)


def label_errors(labels: Mapping[str, str], field: str = "metadata.labels") -> list[dict[str, str]]:
    """`ValidateLabels`: one cause per problem, ``{"reason": "FieldValueInvalid", "message":
    'Invalid value: "<v>": <why>', "field": field}``, keys in sorted order (the real server's map
    order is random). Pure."""
    causes: list[dict[str, str]] = []
    for key in sorted(labels):
        found = [(key, why) for why in qualified_name_errors(key)]
        found += [(labels[key], why) for why in label_value_errors(labels[key])]
        causes += [{"reason": "FieldValueInvalid", "message": f"Invalid value: {_quote(bad)}: {why}", "field": field}
                   for bad, why in found]  # fmt: skip
    return causes


class Invalid(ApiError):
    """422 Invalid with the field causes of a ``Status``'s ``details``."""

    def __init__(self, kind: str, group: str, name: str, causes: list[dict[str, str]]) -> None:
        errors = list(dict.fromkeys(f"{c['field']}: {c['message']}" for c in causes))   # ToAggregate drops repeats
        text = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
        qualified = f"{kind}.{group}" if group else kind
        super().__init__(422, "Invalid", f"{qualified} {_quote(name)} is invalid: {text}")
        self.details = {"name": name, "group": group, "kind": kind, "causes": causes}


def check_labels(kind: str, group: str, name: str, labels: Any) -> None:
    """Raise `Invalid` naming ``metadata.labels`` when a key or value of ``labels`` is one the
    real API server refuses; `ApiError` 400 when ``labels`` is no map of strings (the real
    server's decoder refuses it); nothing for None or an empty map."""
    if labels is None:
        return
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise ApiError(400, "BadRequest", f"metadata.labels of {kind} {_quote(name)}: a map of strings is expected")
    causes = label_errors(labels)
    if causes:
        raise Invalid(kind, group, name, causes)
