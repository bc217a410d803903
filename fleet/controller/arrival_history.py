"""The autoscaler's arrival history, kept across restarts of `fleet up` and of the operator.

A `standby` policy with ``spec.autoscaling.forecast`` needs two seasons (two days by default) of
arrival rates before its Holt-Winters forecast is fitted (`autoscaler.forecast`); kept only in
memory, every restart of the controller, and every ``fleet apply`` that replaced the policy,
started that wait again. `fleet.controller.autoscaling.AutoscalerLoop` therefore saves each
policy's binned rates (`ScalingPolicy.history`) every `HISTORY_SAVE_S` and on shutdown, and
primes a new policy with them (`ScalingPolicy.prime`).

Owns `ArrivalHistoryStore` (the protocol), the document's codec (`encode`, `decode`) and
`FileHistoryStore` (`fleet up`: a JSON file in the state directory);
`fleet.k8s.arrival_history.ConfigMapHistoryStore` keeps the same document in a ConfigMap. Times
in the document are wall-clock Unix seconds (the controller's own clock is monotonic and
restarts with the process); rates are requests/s.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("fleet.autoscaling")

HISTORY_SAVE_S = 300.0
"""Seconds between saves: a crash loses at most this much of a forecast's history (a bin is 30
minutes by default, `autoscaler.spec.ForecastSpec`)."""
DOCUMENT_VERSION = 1
ARRIVAL_HISTORY_FILE = "arrival-history.json"
"""The file `fleet up` keeps it in, in its state directory."""

History = dict[str, list[tuple[float, float]]]
"""Deployment name -> [(bin start, wall-clock Unix seconds; arrival rate, requests/s)], oldest first."""


class HistoryError(ValueError):
    """A saved history that cannot be used; the message names the field and why."""


class ArrivalHistoryStore(Protocol):
    """Where the autoscaler keeps the arrival history (`History`)."""

    async def load(self) -> History:
        """The saved history; {} when none was saved. Raises HistoryError (unusable document) or
        OSError / an API error (not readable now)."""
        ...

    async def save(self, history: History) -> None:
        """Replace the saved history. Raises OSError / an API error."""
        ...


def encode(history: History) -> str:
    """The JSON document of ``history``."""
    return json.dumps({"version": DOCUMENT_VERSION,
                       "deployments": {name: [[round(t, 3), round(r, 6)] for t, r in rows]
                                       for name, rows in sorted(history.items())}},
                      separators=(",", ":"))  # fmt: skip


def decode(text: str, where: str) -> History:
    """`History` from its JSON document. Raises HistoryError naming ``where`` and the field."""
    try:
        doc: Any = json.loads(text)
    except ValueError as err:
        raise HistoryError(f"{where}: not JSON: {err}") from None
    if not isinstance(doc, dict) or doc.get("version") != DOCUMENT_VERSION:
        raise HistoryError(f"{where}: version: expected {DOCUMENT_VERSION}")
    deployments = doc.get("deployments")
    if not isinstance(deployments, dict):
        raise HistoryError(f"{where}: deployments: expected an object")
    out: History = {}
    for name, rows in deployments.items():
        if not isinstance(rows, list):
            raise HistoryError(f"{where}: deployments.{name}: expected a list of [time, rate]")
        parsed = []
        for i, row in enumerate(rows):
            ok = isinstance(row, list) and len(row) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in row)
            if not ok or row[1] < 0:
                raise HistoryError(f"{where}: deployments.{name}[{i}]: expected [time, rate >= 0], got {row!r}")
            parsed.append((float(row[0]), float(row[1])))
        out[name] = parsed
    return out


class FileHistoryStore:
    """`ArrivalHistoryStore` in one JSON file (``path``), replaced atomically (`os.replace` of a
    sibling temporary file), so a crash mid-write leaves the previous history."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def load(self) -> History:
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except FileNotFoundError:
            return {}
        return decode(text, str(self.path))

    async def save(self, history: History) -> None:
        await asyncio.to_thread(self._write, encode(history))

    def _write(self, text: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.path)
