"""Request traces: what arrives when, with how many prompt and output tokens.

Owns `TraceRequest`, `Trace` and their loaders for the forms Fleet reads:

* **Azure LLM inference traces** (CSV, `TIMESTAMP,ContextTokens,GeneratedTokens`; Patel et al.,
  "Splitwise", ISCA 2024; AzurePublicDataset, CC-BY 4.0). Copies ship in
  `loadtests/traces/azure-llm-2023/` with their attribution.
* **Fleet's JSONL form**, one request per line::

      {"timestamp_s": 0.125, "prompt_tokens": 812, "output_tokens": 64,
       "session_id": "user-17", "prefix_blocks": [3, 9]}

  `timestamp_s` (seconds, any origin, non-decreasing), `prompt_tokens` (>= 1) and
  `output_tokens` (>= 1) are required; `session_id` (string), `prefix_blocks` (list of
  non-negative ints: ids of shared prompt blocks, in prompt order, so two requests that list
  the same leading ids share that prompt prefix) and `prefix_block_tokens` (tokens per block
  id: a positive multiple of 16, default 16) are optional. Unknown keys are rejected.
* **Mooncake traces** (JSONL, `{"timestamp": ms, "input_length", "output_length",
  "hash_ids": [...]}`: ids of 512-token prompt blocks; Qin et al., "Mooncake", USENIX FAST
  2025; Apache-2.0). A copy ships in `loadtests/traces/mooncake-fast25/` with its
  attribution. `load_trace` recognizes the form by its first row; `mooncake_to_fleet` and
  `write_jsonl` convert it to Fleet's JSONL form (block ids kept, `prefix_block_tokens` 512:
  one Mooncake id is 32 of vLLM's 16-token blocks, and an id shared by two requests is a
  shared 512-token prefix block in both).

Arrival times are made relative to the first request (the first arrives at 0 s). Every loader
error names the file, the line and the field. Called by the trace replayer
(`loadtests/replay.py`) and the trace simulator.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

PREFIX_BLOCK_TOKENS = 16
"""Tokens per prefix block id in the JSONL form: vLLM's default KV-cache block size, so one
shared block id is exactly one cacheable block."""

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per `hash_ids` entry in Mooncake's traces (FAST'25 release README)."""

_JSONL_FIELDS = {"timestamp_s", "prompt_tokens", "output_tokens", "session_id", "prefix_blocks",
                 "prefix_block_tokens"}
_MOONCAKE_FIELDS = {"timestamp", "input_length", "output_length", "hash_ids"}


class TraceError(ValueError):
    """A trace file cannot be read; the message names file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request: arrives `arrival_s` seconds after the trace's first request. Its prompt
    begins with the shared blocks `prefix_blocks`, of `prefix_block_tokens` tokens each."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    session_id: str | None = None
    prefix_blocks: tuple[int, ...] = ()
    prefix_block_tokens: int = PREFIX_BLOCK_TOKENS


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order, and where they came from."""

    name: str
    requests: tuple[TraceRequest, ...]

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s if self.requests else 0.0

    def window(self, start_s: float = 0.0, duration_s: float | None = None) -> Trace:
        """The requests arriving in ``[start_s, start_s + duration_s)``, re-based to start at 0 s."""
        end_s = float("inf") if duration_s is None else start_s + duration_s
        picked = [r for r in self.requests if start_s <= r.arrival_s < end_s]
        base = picked[0].arrival_s if picked else 0.0
        return Trace(self.name, tuple(_rebase(r, base) for r in picked))

    def compressed(self, speedup: float) -> Trace:
        """Arrivals ``speedup`` times closer together (2.0: twice the arrival rate)."""
        if speedup <= 0:
            raise ValueError(f"speedup must be > 0, got {speedup}")
        return Trace(self.name, tuple(replace(r, arrival_s=r.arrival_s / speedup) for r in self.requests))

    def mean_rate_per_s(self) -> float:
        """Requests per second over the trace's span (0 for fewer than two requests)."""
        return (len(self.requests) - 1) / self.duration_s if self.duration_s > 0 else 0.0


def _rebase(r: TraceRequest, base_s: float) -> TraceRequest:
    return replace(r, arrival_s=r.arrival_s - base_s)


def load_trace(path: Path | str) -> Trace:
    """Load an Azure CSV (`.csv`), a Fleet JSONL or a Mooncake JSONL (`.jsonl`) trace.

    Raises:
        TraceError: unreadable file, unknown extension, or a bad row (naming line and field).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise TraceError(f"{path}: cannot read: {err.strerror or err}") from None
    if path.suffix == ".csv":
        requests = _parse_azure_csv(path, text)
    elif path.suffix == ".jsonl":
        requests = _parse_mooncake(path, text) if _is_mooncake(text) else _parse_jsonl(path, text)
    else:
        raise TraceError(f"{path}: unknown trace format {path.suffix!r}; use .csv (Azure) or .jsonl (Fleet)")
    if not requests:
        raise TraceError(f"{path}: no requests")
    base = requests[0].arrival_s
    return Trace(path.stem, tuple(_rebase(r, base) for r in requests))


def _positive_int(value: object, where: str, field: str) -> int:
    if isinstance(value, bool):
        raise TraceError(f"{where} {field}: must be an integer >= 1, got {value!r}")
    try:
        n = int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceError(f"{where} {field}: must be an integer >= 1, got {value!r}") from None
    if n < 1 or (isinstance(value, float) and value != n):
        raise TraceError(f"{where} {field}: must be an integer >= 1, got {value!r}")
    return n


def _check_order(where: str, field: str, arrival_s: float, previous_s: float | None) -> None:
    if previous_s is not None and arrival_s < previous_s:
        raise TraceError(f"{where} {field}: arrivals must not go back in time ({arrival_s} after {previous_s})")


def _parse_azure_csv(path: Path, text: str) -> list[TraceRequest]:
    reader = csv.reader(text.splitlines())
    header = next(reader, None)
    expected = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    if header is None or [h.strip() for h in header] != expected:
        raise TraceError(f"{path}:1: header must be {','.join(expected)}, got {','.join(header or [])!r}")
    requests: list[TraceRequest] = []
    previous: float | None = None
    for line_no, row in enumerate(reader, start=2):
        if not row:
            continue
        where = f"{path}:{line_no}"
        if len(row) != 3:
            raise TraceError(f"{where}: expected 3 columns, got {len(row)}")
        try:
            arrival_s = datetime.fromisoformat(row[0].strip()).timestamp()
        except ValueError:
            raise TraceError(f"{where} TIMESTAMP: not a date and time: {row[0]!r}") from None
        _check_order(where, "TIMESTAMP", arrival_s, previous)
        previous = arrival_s
        requests.append(TraceRequest(
            arrival_s, _positive_int(row[1].strip(), where, "ContextTokens"),
            # Azure rows with 0 generated tokens do not occur in the 2023 traces; one token is
            # the least a completion can produce, so 0 is an error, not a silent fix.
            _positive_int(row[2].strip(), where, "GeneratedTokens"),
        ))
    return requests


def _json_rows(path: Path, text: str, known: frozenset[str] | set[str],
               required: Iterable[str]) -> Iterator[tuple[str, dict]]:  # fmt: skip
    """``(where, row)`` for each non-empty line of a JSONL text: a JSON object with only ``known``
    fields and every ``required`` one. Raises TraceError naming the file, line and field."""
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            doc = json.loads(line)
        except ValueError as err:
            raise TraceError(f"{where}: not JSON: {err}") from None
        if not isinstance(doc, dict):
            raise TraceError(f"{where}: must be a JSON object, got {type(doc).__name__}")
        unknown = sorted(set(doc) - set(known))
        if unknown:
            raise TraceError(f"{where} {unknown[0]}: unknown field (known: {', '.join(sorted(known))})")
        for field in required:
            if field not in doc:
                raise TraceError(f"{where} {field}: required field is missing")
        yield where, doc


def _parse_jsonl(path: Path, text: str) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    previous: float | None = None
    for where, doc in _json_rows(path, text, _JSONL_FIELDS, ("timestamp_s", "prompt_tokens", "output_tokens")):
        ts = doc["timestamp_s"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts or ts in (float("inf"), float("-inf")):
            raise TraceError(f"{where} timestamp_s: must be a finite number of seconds, got {ts!r}")
        _check_order(where, "timestamp_s", float(ts), previous)
        previous = float(ts)
        session = doc.get("session_id")
        if session is not None and not isinstance(session, str):
            raise TraceError(f"{where} session_id: must be a string, got {session!r}")
        blocks = doc.get("prefix_blocks", [])
        if not isinstance(blocks, list) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks):
            raise TraceError(f"{where} prefix_blocks: must be a list of non-negative integers, got {blocks!r}")
        prompt = _positive_int(doc["prompt_tokens"], where, "prompt_tokens")
        block_tokens = _positive_int(doc.get("prefix_block_tokens", PREFIX_BLOCK_TOKENS), where, "prefix_block_tokens")
        if block_tokens % PREFIX_BLOCK_TOKENS:
            raise TraceError(f"{where} prefix_block_tokens: must be a multiple of {PREFIX_BLOCK_TOKENS}, "
                             f"got {block_tokens}")  # fmt: skip
        if (len(blocks) - 1) * block_tokens >= prompt:
            raise TraceError(
                f"{where} prefix_blocks: {len(blocks)} blocks of {block_tokens} tokens do not fit "
                f"prompt_tokens ({prompt}): only the last block may be partial"
            )
        requests.append(TraceRequest(
            float(ts), prompt, _positive_int(doc["output_tokens"], where, "output_tokens"), session, tuple(blocks),
            block_tokens,
        ))
    return requests


def write_jsonl(trace: Trace, path: Path | str) -> None:
    """Write ``trace`` in Fleet's JSONL form (loads back equal)."""
    with open(path, "w") as f:
        for r in trace.requests:
            doc: dict = {"timestamp_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
            if r.session_id is not None:
                doc["session_id"] = r.session_id
            if r.prefix_blocks:
                doc["prefix_blocks"] = list(r.prefix_blocks)
                if r.prefix_block_tokens != PREFIX_BLOCK_TOKENS:
                    doc["prefix_block_tokens"] = r.prefix_block_tokens
            f.write(json.dumps(doc) + "\n")


def _is_mooncake(text: str) -> bool:
    """Whether the first non-empty line of a JSONL text is a Mooncake row (has `hash_ids`)."""
    for line in text.splitlines():
        if line.strip():
            try:
                doc = json.loads(line)
            except ValueError:
                return False
            return isinstance(doc, dict) and "hash_ids" in doc
    return False


def _parse_mooncake(path: Path, text: str) -> list[TraceRequest]:
    """Mooncake rows -> requests whose `prefix_blocks` are the `hash_ids` (512-token blocks)."""
    requests: list[TraceRequest] = []
    previous: float | None = None
    for where, doc in _json_rows(path, text, _MOONCAKE_FIELDS, sorted(_MOONCAKE_FIELDS)):
        ts = doc["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or ts != ts or ts in (float("inf"), float("-inf")):
            raise TraceError(f"{where} timestamp: must be a finite number of milliseconds, got {ts!r}")
        arrival_s = float(ts) / 1000.0
        _check_order(where, "timestamp", arrival_s, previous)
        previous = arrival_s
        blocks = doc["hash_ids"]
        if not isinstance(blocks, list) or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks):
            raise TraceError(f"{where} hash_ids: must be a list of non-negative integers, got {blocks!r}")
        prompt = _positive_int(doc["input_length"], where, "input_length")
        if (len(blocks) - 1) * MOONCAKE_BLOCK_TOKENS >= prompt:
            raise TraceError(f"{where} hash_ids: {len(blocks)} blocks of {MOONCAKE_BLOCK_TOKENS} tokens do not fit "
                             f"input_length ({prompt})")  # fmt: skip
        requests.append(TraceRequest(arrival_s, prompt, _positive_int(doc["output_length"], where, "output_length"),
                                     None, tuple(blocks), MOONCAKE_BLOCK_TOKENS))  # fmt: skip
    return requests


def mooncake_to_fleet(src: Path | str, dst: Path | str) -> Trace:
    """Convert a Mooncake trace file to Fleet's JSONL form at `dst`; return the trace.

    Each row keeps its arrival (milliseconds -> seconds from the first request), token counts
    and block ids, with `prefix_block_tokens` 512. Raises `TraceError` for a bad row."""
    trace = load_trace(src)
    write_jsonl(trace, dst)
    return trace
