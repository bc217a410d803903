"""JSON documents parsed with a bound on their nesting depth.

Owns `loads_bounded` and `JsonTooDeep`. Python's `json.loads` recurses once per level of nesting
and raises `RecursionError` near the interpreter's recursion limit (about 1,000 levels): not a
`ValueError`, so a caller that catches decoding errors answers 500 to a 50,000-deep body. Here
the depth is measured before parsing, with C-speed bytes operations only (string literals
cut out, everything but brackets deleted, then innermost `[]` pairs peeled one level per pass
until a run of openers shows the limit passed or nothing is left), so a hostile document costs
a few linear passes and never reaches the parser. Called by `router.http.admin` for pool documents. No I/O.
"""

from __future__ import annotations

import json
from typing import Any

_OPENERS_TO_SQUARE = bytes.maketrans(b"{}", b"[]")
_NOT_MARKS = bytes(b for b in range(256) if b not in b'[]{}"')


class JsonTooDeep(ValueError):
    """A JSON document nested deeper than allowed (raised by `loads_bounded`)."""


def depth_exceeds(body: bytes, max_depth: int) -> bool:
    """Whether the arrays and objects of the JSON text `body` nest more than `max_depth` levels
    (`{"a": [1]}` is 2 levels). Brackets inside strings do not count. For malformed text the
    answer only says whether balanced brackets nest that deep (the parser rejects the rest)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    # Outside strings only. Escapes go first (backslash pairs, then escaped quotes), then all
    # but brackets and quotes; strings without brackets are then adjacent quote pairs, removed
    # at once (a left-to-right scan that leaves no quote paired them right); only if a string
    # holds brackets is the text cut at every quote.
    unescaped = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    marks = unescaped.translate(None, _NOT_MARKS)
    skeleton = marks.replace(b'""', b"")
    if b'"' in skeleton:
        skeleton = b"".join(marks.split(b'"')[0::2])
    skeleton = skeleton.translate(_OPENERS_TO_SQUARE)
    for peeled_levels in range(max_depth + 1):
        if b"[" * (max_depth - peeled_levels + 1) in skeleton:
            return True  # that many levels left after peeling `peeled_levels`
        peeled = skeleton.replace(b"[]", b"")  # removes exactly the innermost level
        if len(peeled) == len(skeleton):
            return False
        skeleton = peeled
    return False


def loads_bounded(body: bytes, max_depth: int) -> Any:
    """`json.loads(body)`, refusing a document nested deeper than `max_depth` levels.

    Raises `JsonTooDeep` (naming the limit) for a deeper one and `ValueError` (`JSONDecodeError`,
    `UnicodeDecodeError`) for text that is not JSON."""
    if depth_exceeds(body, max_depth):
        raise JsonTooDeep(f"JSON nested deeper than {max_depth} levels")
    return json.loads(body)
