"""`fleet simulate` with several contenders, which it runs in worker processes: the policies pick
the contenders and the router limit can be overridden and the figures of docs/benchmarks.md are
reproduced (tests/unit/test_simulate_cli.py: the rest)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.cli import app
from tests.unit.test_simulate_cli import ROOT, runner, write_files  # the subject's helpers live in its unit file


@pytest.fixture()
def files(tmp_path: Path) -> tuple[Path, Path]:
    return write_files(tmp_path)


def test_policies_pick_the_contenders_and_the_router_limit_can_be_overridden(files: tuple[Path, Path],
                                                                            tmp_path: Path) -> None:  # fmt: skip
    trace, dep = files
    out_json = tmp_path / "out.json"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fixed-2,kpa",
                                 "--max-concurrency-per-endpoint", "4", "--json", str(out_json)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "│ fixed-2" in result.output and "│ kpa" in result.output and "│ fleet" not in result.output
    assert "4 per replica, then the router queue" in result.output
    doc = json.loads(out_json.read_text())
    assert {r["params"]["routing"]["max_concurrency_per_endpoint"] for r in doc["results"]} == {4}


def test_compare_prints_one_row_per_contender_and_writes_json_and_png(files: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:  # fmt: skip
    trace, dep = files
    out_json, out_png = tmp_path / "out.json", tmp_path / "out.png"
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--compare", "--policies", "fixed-3",
                                 "--jobs", "1", "--warm-startup-s", "5", "--json", str(out_json),
                                 "--plot", str(out_png)])  # fmt: skip
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Fleet trace SIMULATOR" in out and "1200 requests" in out
    assert "within 2 s TTFT" in out and "replica-hours" in out and "scaling actions" in out
    for row in ("fleet", "fixed-peak (", "fixed-mean (", "keda-queue", "kpa", "fixed-3"):
        assert f"│ {row}" in out, row
    doc = json.loads(out_json.read_text())
    names = [r["name"] for r in doc["results"]]
    assert names[0] == "fleet" and names[-1] == "fixed-3" and len(names) == 6
    fleet = doc["results"][0]
    assert fleet["summary"]["requests"] == 1200 and fleet["summary"]["failed"] == 0
    assert len(fleet["timeline"]["t_s"]) == 2 and fleet["timeline"]["arrivals_per_s"][0] > 0  # 60 s bins
    assert fleet["params"]["startup"]["warm_s"] == 5.0 and fleet["params"]["profile"] == "cpu-tiny-llama"
    assert doc["workload"]["trace"] == "small" and doc["sizing"]["peak"] >= 1
    png = out_png.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_the_readme_code_figures_are_reproduced() -> None:
    """The autoscaling tables for the Azure `code` trace (docs/autoscaling.md, docs/benchmarks.md) come
    from loadtests/results/autoscaling-code.json; a fresh run of Fleet's row must give the same
    figures (a policy change that moves them must regenerate the table)."""
    recorded = json.loads((ROOT / "loadtests/results/autoscaling-code.json").read_text())
    want = next(r["summary"] for r in recorded["results"] if r["name"] == "fleet")
    result = runner.invoke(app, ["simulate", str(ROOT / "loadtests/traces/azure-llm-2023/code.csv"),
                                 "-d", str(ROOT / "examples/simulate-h100.yaml"), "--policies", "fleet",
                                 "--jobs", "1"])  # fmt: skip
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("│ fleet"))
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[1] == f"{want['within_slo'] * 100:.1f}%"
    assert cells[2] == f"{want['ttft_p99_s']:.2f} s"
    assert cells[4] == f"{want['replica_hours']:.2f}"
    # then: of which standby, peak replicas, scaling actions, wake-ups, failed
    assert cells[5:] == ["0.00", str(want["max_replicas"]), str(want["scaling_actions"]), "0", str(want["failed"])]


def test_prices_add_the_cost_of_each_contender_and_say_where_the_price_came_from(files: tuple[Path, Path],
                                                                                 tmp_path: Path) -> None:
    trace, dep = files
    dep.write_text(dep.read_text().replace("{accelerator: cpu}",
                                           "{gpuProduct: [NVIDIA A100, NVIDIA L40S], tensorParallelSize: 2}"))
    prices = tmp_path / "prices.yaml"
    prices.write_text('source: "example list prices (test data)"\ngpuHourUsd: {NVIDIA L40S: 1.25}\n')
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fixed-2,fixed-3",
                                 "--prices", str(prices), "--warm-startup-s", "5"])
    assert result.exit_code == 0, result.output
    assert "1.25 USD per GPU-hour for NVIDIA L40S x 2 GPU(s) per replica" in result.output
    assert "prices from example list prices (test data)" in result.output
    for row in ("fixed-2", "fixed-3"):
        cells = [c.strip() for c in next(line for line in result.output.splitlines() if f"│ {row}" in line).split("│")[1:-1]]
        assert cells[5].endswith(" USD"), cells    # replica-hours are printed rounded to 0.01: 2.5 x that
        assert float(cells[5][:-4]) == pytest.approx(float(cells[4]) * 2 * 1.25, abs=0.005 * 2.5 + 0.005), cells


def test_a_mig_replica_costs_its_compute_share_of_the_gpu(files: tuple[Path, Path], tmp_path: Path) -> None:
    """A 3g.40gb instance is 3 of an H100's 7 compute slices (NVIDIA MIG user guide): priced at 3/7 GPU."""
    trace, dep = files
    dep.write_text(dep.read_text().replace("{accelerator: cpu}", "{gpuProduct: NVIDIA H100 80GB HBM3, "
                                           "migProfile: 3g.40gb}"))  # fmt: skip
    prices = tmp_path / "prices.yaml"
    prices.write_text('source: "test data"\ngpuHourUsd: {NVIDIA H100 80GB HBM3: 4.9}\n')
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--policies", "fixed-2",
                                 "--prices", str(prices), "--warm-startup-s", "5"])
    assert result.exit_code == 0, result.output
    assert "4.9 USD per GPU-hour for NVIDIA H100 80GB HBM3 x 0.429 GPU (MIG 3g.40gb) per replica" in result.output
    cells = [c.strip() for c in next(line for line in result.output.splitlines() if "│ fixed-2" in line).split("│")[1:-1]]
    assert float(cells[5][:-4]) == pytest.approx(float(cells[4]) * 3 / 7 * 4.9, abs=0.005 * 2.1 + 0.005), cells
