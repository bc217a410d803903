"""Signals: histogram-window increases with counter resets, Prometheus-style quantiles, the vLLM
/metrics parser on a real vLLM 0.32 scrape, and the combination into `Signals`
(autoscaler.histograms, autoscaler.engine_metrics, autoscaler.signals)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest

from autoscaler.engine_metrics import EngineMetricsError, EngineSample, parse_engine_metrics
from autoscaler.histograms import CumulativeHistogram, HistogramWindow, histogram_quantile
from autoscaler.signals import DeploymentSignals

DATA = Path(__file__).resolve().parents[1] / "data"
INF = math.inf
BOUNDS = (1.0, 2.0, 4.0, INF)


def hist(counts: tuple[float, ...], total_sum: float, bounds: tuple[float, ...] = BOUNDS) -> CumulativeHistogram:
    return CumulativeHistogram(bounds, counts, total_sum, counts[-1])


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus() -> None:
    h = hist((10, 30, 40, 40), 60.0)
    assert histogram_quantile(0.5, h) == pytest.approx(1.5)  # rank 20: halfway through (1, 2]
    assert histogram_quantile(0.99, h) == pytest.approx(3.92)  # rank 39.6: 96 % through (2, 4]
    assert histogram_quantile(0.1, h) == pytest.approx(0.4)  # first bucket starts at 0
    # A rank in the +Inf bucket answers the largest finite bound.
    assert histogram_quantile(0.99, hist((10, 30, 40, 50), 90.0)) == 4.0
    assert histogram_quantile(0.5, hist((0, 0, 0, 0), 0.0)) is None
    with pytest.raises(ValueError):
        histogram_quantile(1.5, h)
    with pytest.raises(ValueError):
        CumulativeHistogram((1.0, 2.0), (1, 2), 1.0, 2)  # no +Inf bucket


def test_histogram_quantile_is_within_a_bucket_of_the_true_quantile() -> None:
    rng = random.Random(3)
    samples = [rng.expovariate(1.0) for _ in range(5000)]
    bounds = (*(i * 0.25 for i in range(1, 41)), INF)
    counts = tuple(float(sum(1 for x in samples if x <= b)) for b in bounds)
    h = CumulativeHistogram(bounds, counts, sum(samples), len(samples))
    true_p99 = sorted(samples)[math.ceil(0.99 * len(samples)) - 1]
    assert abs(histogram_quantile(0.99, h) - true_p99) <= 0.25  # the bucket width
    assert h.mean == pytest.approx(sum(samples) / len(samples))  # the mean is exact


def test_window_increase_is_the_growth_since_the_scrape_at_the_window_start() -> None:
    w = HistogramWindow(retention_s=120)
    for t in range(0, 65, 5):  # one observation of 1.5 s per second
        w.add(float(t), hist((0, t, t, t), 1.5 * t))
    grown = w.increase(60.0, 30.0)
    assert grown is not None
    assert grown.counts == (0, 30, 30, 30) and grown.sum == pytest.approx(45.0)
    assert grown.mean == pytest.approx(1.5)
    assert w.increase(60.0, 1000.0).count == 60  # type: ignore[union-attr]  # from the oldest scrape


def test_window_increase_counts_a_restart_from_zero() -> None:
    w = HistogramWindow(retention_s=120)
    w.add(0.0, hist((0, 100, 100, 100), 150.0))
    w.add(10.0, hist((0, 110, 110, 110), 165.0))  # +10
    w.add(20.0, hist((2, 3, 3, 3), 3.0))  # the engine restarted: +3 since
    w.add(30.0, hist((4, 8, 8, 8), 9.0))  # +5
    grown = w.increase(30.0, 30.0)
    assert grown is not None
    assert grown.count == 18 and grown.counts == (4, 18, 18, 18) and grown.sum == pytest.approx(24.0)


def test_window_needs_two_scrapes_and_a_scrape_inside_the_window() -> None:
    w = HistogramWindow(retention_s=60)
    w.add(0.0, hist((1, 1, 1, 1), 0.5))
    assert w.increase(0.0, 30.0) is None
    w.add(5.0, hist((2, 2, 2, 2), 1.0))
    assert w.increase(100.0, 30.0) is None  # nothing scraped in [70, 100]
    # Old scrapes are pruned, but one before the retention stays as a baseline.
    for t in range(10, 200, 10):
        w.add(float(t), hist((t, t, t, t), t / 2))
    assert len(w) <= 8


def test_parser_reads_a_real_vllm_0_32_scrape() -> None:
    text = (DATA / "vllm-0.32-metrics-busy.txt").read_text()
    s = parse_engine_metrics(text, "tiny-llama")
    assert (s.waiting, s.running) == (11.0, 2.0)
    assert s.kv_cache_usage == pytest.approx(0.0004884004884004867)
    qt = s.queue_time
    assert qt is not None
    assert qt.bounds[:4] == (0.3, 0.5, 0.8, 1.0) and qt.bounds[-2:] == (7680.0, INF)
    assert qt.count == 27 and qt.sum == pytest.approx(7.310822093001661)
    assert dict(zip(qt.bounds, qt.counts))[2.0] == 26
    # vllm:num_requests_waiting_by_reason shares the prefix but is not the gauge.
    assert parse_engine_metrics(text, "other-model") == EngineSample()
    idle = parse_engine_metrics((DATA / "vllm-0.32-metrics-idle.txt").read_text())
    assert (idle.waiting, idle.running, idle.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert idle.queue_time is not None and idle.queue_time.count == 13


def test_parser_sums_engines_and_rejects_garbage() -> None:
    text = "\n".join([
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 4.0',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.2',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7',
        "# TYPE vllm:request_queue_time_seconds histogram",
        *(f'vllm:request_queue_time_seconds_bucket{{engine="{e}",le="{le}",model_name="m"}} {c}'
          for e in (0, 1) for le, c in (("1.0", 1), ("+Inf", 2))),
        *(f'vllm:request_queue_time_seconds_{k}{{engine="{e}",model_name="m"}} {v}'
          for e in (0, 1) for k, v in (("count", 2), ("sum", 2.5))),
    ])  # fmt: skip
    s = parse_engine_metrics(text, "m")
    assert s.waiting == 7.0 and s.running is None and s.kv_cache_usage == 0.7
    assert s.queue_time == CumulativeHistogram((1.0, INF), (2.0, 4.0), 5.0, 4.0)
    with pytest.raises(EngineMetricsError):
        parse_engine_metrics('vllm:num_requests_waiting{model_name="m" 3', "m")


def test_deployment_signals_add_router_and_engine_queue_time() -> None:
    sig = DeploymentSignals(window_s=30.0)
    for t in (0.0, 30.0):
        n = t / 30.0 * 10  # each replica: 10 requests in the window, 2 s queued each
        sig.observe_engine("r0", t, EngineSample(waiting=1, running=4, kv_cache_usage=0.5,
                                                 queue_time=hist((0, n, n, n), 2 * n)))  # fmt: skip
        sig.observe_engine("r1", t, EngineSample(waiting=2, running=4, kv_cache_usage=0.9,
                                                 queue_time=hist((0, n, n, n), 2 * n)))  # fmt: skip
    router = {"arrival_rate_per_s": 0.7, "in_flight": 8, "queued": 3,
              "queue_time_s": {"mean": 0.5, "samples": 20}, "ttft_s": {"p99": 4.0, "samples": 20},
              "e2e_s": {"mean": 6.0, "p99": 9.0, "samples": 20}}  # fmt: skip
    s = sig.signals(30.0, router)
    assert s.engine_queue_time_mean_s == pytest.approx(2.0)
    assert s.queue_time_s == pytest.approx(2.5)  # router 0.5 + engine 2.0
    assert s.engine_queue_samples == 20
    assert s.engine_queue_time_p99_s == pytest.approx(2.0 - 1.0 * (1 - 0.99))  # in (1, 2]
    assert (s.engine_waiting, s.engine_running, s.kv_cache_usage) == (3, 8, 0.9)
    assert (s.in_flight, s.queued, s.concurrency, s.ttft_p99_s, s.ttft_samples) == (8, 3, 11, 4.0, 20)
    # A replica that left is forgotten; with no router snapshot the router signals are unmeasured.
    sig.forget_others({"r0"})
    s = sig.signals(30.0, None)
    assert s.engine_waiting == 1 and s.router_queue_time_mean_s is None and s.ttft_p99_s is None
    assert s.queue_time_s == pytest.approx(2.0)
    empty = DeploymentSignals(30.0).signals(0.0, None)
    assert empty.queue_time_s is None and empty.engine_waiting is None and empty.concurrency == 0
