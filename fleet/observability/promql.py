"""PromQL lint for Fleet's dashboard and rules: the two mistakes the anchors' dashboards ship.

Owns `lint`, which parses a query (with `promql-parser`, a maintained PromQL parser) and reports:

1. a counter or histogram series (a selector whose name ends in ``_total``, ``_bucket``,
   ``_count`` or ``_sum``) read other than through ``rate()``, ``irate()`` or ``increase()``:
   a raw counter is a lifetime total, and ``_sum / _count`` without ``rate()`` is a lifetime
   average (vLLM production-stack's latency panels);
2. a ``histogram_quantile`` whose histogram is not summed ``by (le, ...)``: without ``le`` in
   the aggregation the buckets of several series mix or the quantile has nothing to
   interpolate (llm-d's dashboard), and without an aggregation each series is its own
   histogram only by luck.

`grafana_to_promql` turns a Grafana query into plain PromQL first (``$__rate_interval`` and
template variables), so the dashboard's queries are linted and evaluated as Prometheus sees
them. Called by `fleet.observability.dashboard` and `.rules` tests and the integration test.
"""

from __future__ import annotations

import re

import promql_parser

COUNTER_SUFFIXES = ("_total", "_bucket", "_count", "_sum")
RATE_FUNCTIONS = ("rate", "irate", "increase")


class PromQLSyntaxError(ValueError):
    """The query does not parse; the message is the parser's."""


_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def _duration_s(duration: str) -> float:
    """Seconds of a one-unit Prometheus duration (``20s``, ``1m``). Raises ValueError otherwise."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", duration)
    if match is None:
        raise ValueError(f"{duration!r} is not a duration such as 20s or 1m")
    return float(match.group(1)) * _UNIT_S[match.group(2)]


def grafana_to_promql(expr: str, variables: dict[str, str] | None = None, rate_interval: str = "1m") -> str:
    """``expr`` with Grafana's ``$__rate_interval`` / ``$__interval`` / ``$__range`` replaced by
    ``rate_interval``, ``$__interval_ms`` / ``$__range_ms`` / ``$__range_s`` by its length in
    those units, and each ``$name`` / ``${name}`` by ``variables[name]`` (default ``.*``, what
    "All" means in a regex matcher)."""
    variables = variables or {}
    seconds = _duration_s(rate_interval)
    out = re.sub(r"\$__(interval|range)_ms\b", f"{seconds * 1000:g}", expr)
    out = re.sub(r"\$__range_s\b", f"{seconds:g}", out)
    out = re.sub(r"\$__(rate_interval|interval|range)\b", rate_interval, out)
    out = re.sub(r"\$\{(\w+)\}", lambda m: variables.get(m.group(1), ".*"), out)
    return re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), ".*"), out)


def lint(expr: str) -> list[str]:
    """Problems of PromQL ``expr`` (empty when none). Raises PromQLSyntaxError if it does not parse."""
    try:
        tree = promql_parser.parse(expr)
    except Exception as err:  # the parser raises a bare exception type with the position
        raise PromQLSyntaxError(f"{expr!r}: {err}") from None
    problems: list[str] = []
    _walk(tree, inside_rate=False, problems=problems)
    return problems


def _name(selector) -> str:
    return selector.name or ""


def _walk(node, inside_rate: bool, problems: list[str]) -> None:
    if isinstance(node, promql_parser.VectorSelector):
        name = _name(node)
        if name.endswith(COUNTER_SUFFIXES) and not inside_rate:
            problems.append(f"{name} is a counter: read it through rate() or increase(), not raw")
        return
    if isinstance(node, promql_parser.MatrixSelector):
        name = _name(node.vector_selector)
        if name.endswith(COUNTER_SUFFIXES) and not inside_rate:
            problems.append(f"{name}[...] is a counter range: only rate(), irate() or increase() may read it")
        return
    if isinstance(node, promql_parser.Call):
        fname = node.func.name
        if fname == "histogram_quantile":
            _check_quantile(node, problems)
        for arg in node.args:
            _walk(arg, inside_rate=fname in RATE_FUNCTIONS, problems=problems)
        return
    if isinstance(node, promql_parser.AggregateExpr):
        _walk(node.expr, False, problems)
        if node.param is not None:
            _walk(node.param, False, problems)
        return
    if isinstance(node, promql_parser.BinaryExpr):
        _walk(node.lhs, False, problems)
        _walk(node.rhs, False, problems)
        return
    if isinstance(node, (promql_parser.ParenExpr, promql_parser.UnaryExpr)):
        _walk(node.expr, inside_rate, problems)
        return
    if isinstance(node, promql_parser.SubqueryExpr):
        _walk(node.expr, False, problems)


def _unparen(node):
    while isinstance(node, promql_parser.ParenExpr):
        node = node.expr
    return node


def _check_quantile(call, problems: list[str]) -> None:
    inner = _unparen(call.args[1])
    if not isinstance(inner, promql_parser.AggregateExpr):
        problems.append(f"histogram_quantile over {inner}: aggregate the buckets with sum by (le, ...) first")
        return
    modifier = inner.modifier
    labels = list(modifier.labels) if modifier is not None else []
    by = modifier is not None and modifier.type == promql_parser.AggModifierType.By
    keeps_le = ("le" in labels) if by else (modifier is not None and "le" not in labels)
    if str(inner.op).lower() != "sum" or not keeps_le:
        problems.append(f"histogram_quantile over {inner.op} {'by' if by else 'without'} ({', '.join(labels)}): "
                        "the buckets must be summed by (le, ...)")
