"""`fleet top` (fleet/observability/top.py): rows from state.json and the router's statistics,
the rendered frame, 5xx rates from counter deltas, and one frame through the CLI entry point
with a fake router reader."""

from __future__ import annotations

import json
import time
from pathlib import Path

from rich.console import Console

from fleet.observability.top import ErrorRates, build_rows, render, run_top, server_errors

STATE = {
    "phase": "running", "router_url": "http://127.0.0.1:8080", "clock_s": 100.0, "updated_at_unix": 1000.0,
    "deployments": {
        "chat": {"model": "llama", "desired": 3, "desired_at_s": 70.0, "desired_reason": "autoscaler: queue_time_above_target",
                 "last_scaling": {"direction": "hold", "previous": 3, "desired": 3, "reason": "at_max_replicas"},
                 "rollout": {"phase": "canary", "step": 2, "canary_weight": 25}},
        "embed": {"model": "e5", "desired": 1},
    },
    "replicas": [
        {"id": "chat-0", "deployment": "chat", "revision": "v1", "status": "READY"},
        {"id": "chat-1", "deployment": "chat", "revision": "v1", "status": "READY"},
        {"id": "chat-2", "deployment": "chat", "revision": "v2", "status": "WARMING"},
        {"id": "chat-3", "deployment": "chat", "revision": "v1", "status": "FAILED_CRASHED"},
        {"id": "chat-4", "deployment": "chat", "revision": "v0", "status": "TERMINATED"},
    ],
}  # fmt: skip
STATS = {"llama": {
    "arrival_rate_per_s": 12.5, "in_flight": 4, "queued": 2,
    "ttft_s": {"p50": 0.120, "p99": 1.5}, "queue_time_s": {"p50": 0.0, "p99": 0.250},
    "tpot_s": {"p99": 0.031},
}}


def test_one_row_per_deployment_and_version_with_the_model_figures() -> None:
    rows = build_rows(STATE, STATS, {"llama": 0.5}, now_unix=1005.0)
    assert [(r.deployment, r.version) for r in rows] == [("chat", "v1"), ("chat", "v2"), ("embed", "-")]
    v1, v2, embed = rows
    assert v1.replicas == {"READY": 2, "FAILED": 1} and v2.replicas == {"WARMING": 1}
    assert (v1.rate_per_s, v1.ttft_p50_s, v1.ttft_p99_s, v1.tpot_p99_s, v1.queue_p99_s) == (12.5, 0.12, 1.5, 0.031, 0.25)
    assert v1.errors_per_s == 0.5 and v1.in_flight == 4 and v1.queued == 2
    assert v1.last_scaling == "=3 35 s ago: queue_time_above_target"  # 100 - 70 + 5 s since the state was written
    assert v1.rollout == "canary step 2 canary 25 %"
    assert embed.replicas == {} and embed.rate_per_s is None and embed.last_scaling == "-"


def test_a_scale_up_decision_shows_its_direction() -> None:
    state = json.loads(json.dumps(STATE))
    state["deployments"]["chat"]["last_scaling"] = {"direction": "up", "previous": 1, "desired": 3,
                                                    "reason": "ttft_p99_above_target"}  # fmt: skip
    assert build_rows(state, {})[0].last_scaling == "up 1->3 ttft_p99_above_target"


def test_the_frame_shows_every_column() -> None:
    console = Console(record=True, width=220)
    console.print(render(build_rows(STATE, STATS, {"llama": 0.5}, now_unix=1005.0), "fleet top - running"))
    text = console.export_text()
    for cell in ("TTFT p50", "TTFT p99", "TPOT p99", "queue p99", "errors/s", "last scaling", "rollout",
                 "2 READY 1 FAILED (want 3)", "120 ms", "1.50 s", "31 ms", "250 ms", "12.5", "0.50"):  # fmt: skip
        assert cell in text, (cell, text)


EXPOSITION = """# TYPE fleet_router_requests_total counter
fleet_router_requests_total{model="llama",endpoint="chat-0",code="200"} 90.0
fleet_router_requests_total{model="llama",endpoint="chat-0",code="500"} 3.0
fleet_router_requests_total{model="llama",endpoint="chat-1",code="502"} 1.0
# TYPE fleet_router_rejected_requests_total counter
fleet_router_rejected_requests_total{model="llama",code="503"} 6.0
fleet_router_rejected_requests_total{model="",code="404"} 9.0
"""


def test_5xx_totals_and_rates_from_the_router_counters() -> None:
    assert server_errors(EXPOSITION) == {"llama": 10.0}
    rates = ErrorRates()
    assert rates.update(10.0, {"llama": 10.0}) == {}       # one reading is no rate
    assert rates.update(12.0, {"llama": 14.0}) == {"llama": 2.0}
    assert rates.update(14.0, {}) == {"llama": 0.0}         # a model that vanished reads 0


class FakeReader:
    def __init__(self, url: str, token: str) -> None:
        self.url, self.token, self.closed = url, token, False
        FakeReader.last = self

    def stats(self, window_s: float) -> dict:
        return STATS

    def errors_total(self) -> dict:
        return {"llama": 1.0}

    def close(self) -> None:
        self.closed = True


def test_run_top_once_reads_the_state_and_the_router() -> None:
    state = {**STATE, "updated_at_unix": time.time()}
    console = Console(record=True, width=220)
    assert run_top(lambda: state, "secret", where="here", interval_s=1, window_s=30, once=True, console=console,
                   reader_factory=FakeReader) == 0  # fmt: skip
    assert FakeReader.last.url == "http://127.0.0.1:8080" and FakeReader.last.token == "secret"
    assert FakeReader.last.closed
    text = console.export_text()
    assert "chat" in text and "12.5" in text and "120 ms" in text
    empty = Console(record=True)
    assert run_top(lambda: None, "", where="/nowhere", interval_s=1, window_s=30, once=True, console=empty) == 1
    assert "No fleet state in /nowhere" in empty.export_text()


def test_fleet_top_reads_the_state_directory_and_its_admin_token(tmp_path: Path, monkeypatch) -> None:
    """`fleet top --once` hands run_top the state directory's state.json and admin token."""
    from typer.testing import CliRunner

    from fleet.cli import app

    (tmp_path / "state.json").write_text(json.dumps({**STATE, "updated_at_unix": time.time()}))
    (tmp_path / "admin-token").write_text("secret\n")
    monkeypatch.setattr("fleet.observability.top.RouterReader", FakeReader)
    result = CliRunner().invoke(app, ["top", "--once", "--state-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert FakeReader.last.url == "http://127.0.0.1:8080" and FakeReader.last.token == "secret"
    missing = CliRunner().invoke(app, ["top", "--once", "--state-dir", str(tmp_path / "none")])
    assert missing.exit_code == 1 and "No fleet state" in missing.output


NARROW_HEADERS = ("deployment", "version", "ready", "/want", "req/s", "TTFT", "TPOT", "queue", "p50", "p99", "errors")


def frame_at(width: int) -> str:
    console = Console(record=True, width=width)
    console.print(render(build_rows(STATE, STATS, {"llama": 0.5}, now_unix=1005.0), "fleet top - running"))
    return console.export_text()


def test_at_80_and_120_columns_nothing_is_cut_and_every_figure_and_fact_shows() -> None:
    for width in (80, 120):
        text = frame_at(width)
        assert "…" not in text and "..." not in text, text
        assert max(len(line) for line in text.splitlines()) <= width, text
        for word in (*NARROW_HEADERS, "2/3", "0/3", "120 ms", "1.50 s", "31 ms", "250 ms", "12.5", "0.50"):
            assert word in text, (width, word, text)
        flat = " ".join(text.split())        # the facts under the table wrap at the console's width
        for fact in ("chat v1: 2 READY 1 FAILED (want 3), 4 in flight, 2 queued; scaling =3 35 s ago: "
                     "queue_time_above_target; rollout canary step 2 canary 25 %", "chat v2: 1 WARMING (want 3)",
                     "embed -: none (want 1)"):  # fmt: skip
            assert fact in flat, (width, fact, text)


def test_the_wide_layout_keeps_one_line_per_row_where_it_fits() -> None:
    text = frame_at(220)
    assert "TTFT p99" in text and "chat v1:" not in text
    row = next(line for line in text.splitlines() if "v1" in line)
    assert "2 READY 1 FAILED (want 3)" in row and "queue_time_above_target" in row and "120 ms" in row


def test_fleet_top_once_at_columns_80_prints_the_narrow_frame(tmp_path: Path, monkeypatch) -> None:
    from typer.testing import CliRunner

    from fleet.cli import app

    (tmp_path / "state.json").write_text(json.dumps({**STATE, "updated_at_unix": time.time()}))
    (tmp_path / "admin-token").write_text("secret\n")
    monkeypatch.setattr("fleet.observability.top.RouterReader", FakeReader)
    for columns, narrow in (("80", True), ("120", True), ("230", False)):
        result = CliRunner().invoke(app, ["top", "--once", "--state-dir", str(tmp_path)], env={"COLUMNS": columns})
        assert result.exit_code == 0, result.output
        table = [line for line in result.output.splitlines() if line.startswith(("┃", "│", "┏", "└"))]
        assert table and all(len(line) <= int(columns) for line in table), result.output
        assert ("chat v1: 2 READY" in result.output) is narrow, result.output


def test_the_rollout_column_reads_the_rollout_the_controller_records() -> None:
    state = json.loads(json.dumps(STATE))
    del state["deployments"]["chat"]["rollout"]
    state["deployments"]["chat"]["revisions"] = {"rollout": {"phase": "Progressing", "step_index": 1, "weight": 25.0}}
    assert build_rows(state, {})[0].rollout == "Progressing step 1 canary 25 %"
