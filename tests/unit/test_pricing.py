"""GPU prices from a YAML file and what replica-hours cost (fleet/pricing.py), and `fleet simulate
--prices`'s refusals and cost column (fleet/cli/simulate.py; the full run with prices:
tests/integration/test_simulate_cli.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from fleet.cli.simulate import _simulation_table
from fleet.pricing import PricesError, load_prices, prices_from_json, replica_cost_usd
from tests.unit.test_simulate_cli import runner, write_files

from fleet.cli import app

PRICES = """\
source: "example list prices, 2026-11 (test data)"
gpuHourUsd:
  NVIDIA H100 80GB HBM3: 3.0
  NVIDIA L40S: 1.25
"""


def test_prices_load_and_the_first_priced_product_of_the_preference_is_used(tmp_path: Path) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(PRICES)
    prices = load_prices(path)
    assert prices.source.startswith("example list prices")
    assert prices.per_gpu_hour(("NVIDIA A100", "NVIDIA L40S", "NVIDIA H100 80GB HBM3")) == ("NVIDIA L40S", 1.25)
    with pytest.raises(PricesError, match="no price for NVIDIA A100 .*priced: NVIDIA H100 80GB HBM3, NVIDIA L40S"):
        prices.per_gpu_hour(("NVIDIA A100",))
    with pytest.raises(PricesError, match="names no gpuProduct"):
        prices.per_gpu_hour(())
    path.write_text('source: one\ngpuHourUsd: {"NVIDIA L40S": 1.25}\n')
    assert load_prices(path).per_gpu_hour(()) == ("NVIDIA L40S", 1.25)   # any product, one priced


@pytest.mark.parametrize(("text", "message"), [
    ("gpuHourUsd: {a: 1}\n", "source: Field required"),
    ("source: x\ngpuHourUsd: {a: -1}\n", "gpuHourUsd: Value error, a: -1.0 USD/GPU-hour is negative"),
    ("source: x\ngpuHourUsd: {a: lots}\n", "gpuHourUsd.a: Input should be a valid number"),
    ("source: x\ngpuHourUsd: {}\n", "gpuHourUsd: Dictionary should have at least 1 item"),
    ("source: x\ngpuHourUsd: {a: 1}\nregion: y\n", "region: Extra inputs are not permitted"),
    ("- a\n", "expected a mapping"),
    ("source: [\n", "invalid YAML at line 2"),
])  # fmt: skip
def test_a_bad_prices_file_is_refused_naming_the_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "prices.yaml"
    path.write_text(text)
    with pytest.raises(PricesError, match=rf"^{path}: .*") as err:
        load_prices(path)
    assert message in str(err.value)
    with pytest.raises(PricesError, match="cannot read"):
        load_prices(tmp_path / "missing.yaml")


def test_prices_from_the_charts_json_are_the_files_keys() -> None:
    prices = prices_from_json('{"source": "list prices (test data)", "gpuHourUsd": {"NVIDIA L40S": 1.25}}')
    assert (prices.source, prices.gpu_hour_usd) == ("list prices (test data)", {"NVIDIA L40S": 1.25})
    for text, message in [("{", "FLEET_PRICES_JSON: not JSON"), ("[]", "expected an object"),
                          ('{"gpuHourUsd": {"a": 1}}', "source: Field required"),
                          ('{"source": "s", "gpuHourUsd": {"a": -1}}', "is negative")]:  # fmt: skip
        with pytest.raises(PricesError, match=message):
            prices_from_json(text)


def test_cost_is_gpu_hours_times_the_price() -> None:
    assert replica_cost_usd(3.82, 2, 3.0) == pytest.approx(22.92)
    assert replica_cost_usd(0.0, 1, 3.0) == 0.0
    assert replica_cost_usd(7.0, 3 / 7, 3.0) == pytest.approx(9.0)   # a 3g.40gb MIG instance: 3/7 of a GPU
    with pytest.raises(ValueError, match="gpus_per_replica 0"):
        replica_cost_usd(1.0, 0, 3.0)


def test_simulate_refuses_prices_it_cannot_use(tmp_path: Path) -> None:
    trace, dep = write_files(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text(PRICES)
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--prices", str(prices)])
    assert result.exit_code == 2 and "prices are per GPU-hour" in result.output and "accelerator cpu" in result.output
    dep.write_text(dep.read_text().replace("{accelerator: cpu}", "{gpuProduct: NVIDIA A100}"))
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--prices", str(prices)])
    assert result.exit_code == 2 and "no price for NVIDIA A100" in result.output
    prices.write_text("source: x\n")
    result = runner.invoke(app, ["simulate", str(trace), "-d", str(dep), "--prices", str(prices)])
    assert result.exit_code == 2 and "gpuHourUsd: Field required" in result.output


def test_the_table_gains_a_cost_column_only_with_prices() -> None:
    summary = SimpleNamespace(name="fleet", within_slo=0.965, ttft_p99_s=1.5, ttft_p50_s=0.2, replica_hours=4.24,
                              standby_hours=0.0, max_replicas=6, scaling_actions=9, wakes=0, failed=0)  # fmt: skip
    comparison = SimpleNamespace(workload={"trace": "code"},
                                 results=[SimpleNamespace(ttft_slo_s=2.0, summary=lambda: summary)])
    with_cost = _simulation_table(comparison, 2 * 3.0)
    assert [c.header for c in with_cost.columns][4:6] == ["replica-hours", "cost"]
    assert list(with_cost.columns[5].cells) == ["25.44 USD"]   # 4.24 replica-h x 2 GPUs x 3 USD
    assert "cost" not in [c.header for c in _simulation_table(comparison).columns]


def test_fleet_up_refuses_a_bad_prices_file_before_starting_anything(tmp_path: Path) -> None:
    _, dep = write_files(tmp_path)
    prices = tmp_path / "prices.yaml"
    prices.write_text("source: x\ngpuHourUsd: {a: -2}\n")
    result = runner.invoke(app, ["up", str(dep), "--prices", str(prices), "--state-dir", str(tmp_path / "state")])
    assert result.exit_code == 2 and "--prices:" in result.output and "is negative" in result.output
    assert not (tmp_path / "state").exists()
