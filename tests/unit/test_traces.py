"""Trace loading: the shipped Azure traces, Fleet's JSONL form, and errors that name file, line
and field (fleet.tracesim.traces)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.tracesim.traces import Trace, TraceError, TraceRequest, load_trace, mooncake_to_fleet, write_jsonl

AZURE = Path(__file__).resolve().parents[2] / "loadtests" / "traces" / "azure-llm-2023"


def test_shipped_azure_traces_load_with_their_attribution() -> None:
    code = load_trace(AZURE / "code.csv")
    conv = load_trace(AZURE / "conv.csv")
    assert (len(code.requests), len(conv.requests)) == (8819, 19366)
    assert code.requests[0] == TraceRequest(0.0, 4808, 10)
    assert code.requests[1].arrival_s == pytest.approx(0.052, abs=1e-6)
    assert 3400 < code.duration_s < 3500 and 3400 < conv.duration_s < 3600
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(conv.requests, conv.requests[1:]))
    assert "Splitwise" in (AZURE / "README.md").read_text() and (AZURE / "LICENSE.txt").exists()


def test_window_and_compression() -> None:
    t = Trace("t", tuple(TraceRequest(float(s), 10, 5) for s in range(10)))
    w = t.window(2.0, 3.0)
    assert [r.arrival_s for r in w.requests] == [0.0, 1.0, 2.0]
    assert [r.arrival_s for r in t.compressed(2.0).requests][:3] == [0.0, 0.5, 1.0]
    assert t.mean_rate_per_s() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        t.compressed(0)


def test_jsonl_round_trip_keeps_sessions_and_prefix_blocks(tmp_path: Path) -> None:
    t = Trace("x", (TraceRequest(0.0, 40, 3, "s1", (4, 5)), TraceRequest(1.5, 7, 1)))
    write_jsonl(t, tmp_path / "x.jsonl")
    assert load_trace(tmp_path / "x.jsonl") == t


def test_jsonl_arrivals_are_rebased_to_the_first_request(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp_s": 100.0, "prompt_tokens": 5, "output_tokens": 2}\n\n'
                 '{"timestamp_s": 100.25, "prompt_tokens": 6, "output_tokens": 3}\n')
    assert [r.arrival_s for r in load_trace(f).requests] == [0.0, 0.25]


@pytest.mark.parametrize(("name", "text", "expected"), [
    ("h.csv", "time,in,out\n", "h.csv:1: header must be TIMESTAMP,ContextTokens,GeneratedTokens"),
    ("t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,5,5\n", "t.csv:2 TIMESTAMP: not a date and time"),
    ("c.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,5\n", "c.csv:2: expected 3 columns, got 2"),
    ("n.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:00,-5,5\n",
     "n.csv:2 ContextTokens: must be an integer >= 1, got '-5'"),
    ("o.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:00:01,5,5\n2023-11-16 18:00:00,5,5\n",
     "o.csv:3 TIMESTAMP: arrivals must not go back in time"),
    ("j.jsonl", "[1, 2]\n", "j.jsonl:1: must be a JSON object, got list"),
    ("s.jsonl", "{bad\n", "s.jsonl:1: not JSON"),
    ("u.jsonl", '{"timestamp_s": 0, "prompt_tokens": 5, "output_tokens": 1, "colour": "red"}\n',
     "u.jsonl:1 colour: unknown field"),
    ("m.jsonl", '{"timestamp_s": 0, "output_tokens": 1}\n', "m.jsonl:1 prompt_tokens: required field is missing"),
    ("f.jsonl", '{"timestamp_s": 0, "prompt_tokens": 2.5, "output_tokens": 1}\n',
     "f.jsonl:1 prompt_tokens: must be an integer >= 1, got 2.5"),
    ("b.jsonl", '{"timestamp_s": 0, "prompt_tokens": 5, "output_tokens": 1, "prefix_blocks": [1, -2]}\n',
     "b.jsonl:1 prefix_blocks: must be a list of non-negative integers"),
    ("p.jsonl", '{"timestamp_s": 0, "prompt_tokens": 20, "output_tokens": 1, "prefix_blocks": [1, 2, 3]}\n',
     "p.jsonl:1 prefix_blocks: 3 blocks of 16 tokens do not fit prompt_tokens (20)"),
    ("w.jsonl", '{"timestamp_s": 0, "prompt_tokens": 20, "output_tokens": 1, "prefix_block_tokens": 24}\n',
     "w.jsonl:1 prefix_block_tokens: must be a multiple of 16, got 24"),
    ("m.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2, 3]}\n',
     "m.jsonl:1 hash_ids: 3 blocks of 512 tokens do not fit input_length (600)"),
    ("n.jsonl", '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1], "x": 1}\n',
     "n.jsonl:1 x: unknown field"),
    ("o.jsonl", '{"timestamp": 0, "input_length": 0, "output_length": 2, "hash_ids": [1]}\n',
     "o.jsonl:1 input_length: must be an integer >= 1"),
    ("i.jsonl", '{"timestamp_s": "soon", "prompt_tokens": 5, "output_tokens": 1}\n',
     "i.jsonl:1 timestamp_s: must be a finite number of seconds"),
    ("e.jsonl", "\n", "e.jsonl: no requests"),
    ("x.txt", "anything", "x.txt: unknown trace format '.txt'"),
])
def test_malformed_traces_name_file_line_and_field(tmp_path: Path, name: str, text: str, expected: str) -> None:
    f = tmp_path / name
    f.write_text(text)
    with pytest.raises(TraceError) as err:
        load_trace(f)
    assert expected in str(err.value)
    assert str(err.value).startswith(str(tmp_path))


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_mooncake_rows_load_and_convert_to_fleet_jsonl(tmp_path: Path) -> None:
    src = tmp_path / "mooncake.jsonl"
    src.write_text(
        '{"timestamp": 1000, "input_length": 1100, "output_length": 7, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 1500, "input_length": 1600, "output_length": 3, "hash_ids": [0, 1, 2, 9]}\n'
    )
    trace = load_trace(src)
    assert trace.requests == (
        TraceRequest(0.0, 1100, 7, None, (0, 1, 2), 512),
        TraceRequest(0.5, 1600, 3, None, (0, 1, 2, 9), 512),
    )
    dst = tmp_path / "fleet.jsonl"
    assert mooncake_to_fleet(src, dst) == trace
    assert '"prefix_block_tokens": 512' in dst.read_text().splitlines()[0]
    assert load_trace(dst).requests == trace.requests


def test_the_shipped_mooncake_trace_loads_with_its_prefix_sharing() -> None:
    trace = load_trace(Path(__file__).resolve().parents[2] / "loadtests/traces/mooncake-fast25/synthetic_trace.jsonl")
    assert len(trace.requests) == 3993 and round(trace.duration_s) == 1022
    seen: set[int] = set()
    shared = total = 0
    for r in trace.requests:
        total += len(r.prefix_blocks)
        shared += sum(1 for b in r.prefix_blocks if b in seen)
        seen.update(r.prefix_blocks)
    assert 0.6 < shared / total < 0.7      # the README beside it: 64% of blocks repeat an earlier one
