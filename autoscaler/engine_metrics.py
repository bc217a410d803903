"""Read an engine's Prometheus `/metrics` text: the few vLLM series the autoscaler uses.

Owns `EngineSample` and `parse_engine_metrics`. Called by `fleet.controller.autoscaling` on each scrape
of a READY replica (the text comes from `warmup.client.EngineClient.metrics`); the trace
simulator builds `EngineSample`s directly. Parsing is the router's
(`router.signals.engine_load.metric_families`: prometheus-client's own text parser on the lines of the
wanted families only, so a 600-line vLLM exposition costs a fraction of a full parse).

Series (names and labels as vLLM 0.32 exports them, `vllm/v1/metrics/loggers.py`; the
fixture `tests/data/vllm-0.32-metrics-busy.txt` is a real scrape):
`vllm:num_requests_waiting` and `vllm:num_requests_running` (gauges, requests),
`vllm:kv_cache_usage_perc` (gauge, a fraction 0..1 despite its name),
`vllm:request_queue_time_seconds` (histogram: seconds a request spent WAITING in the engine's
scheduler before it first ran). Each carries `model_name` and `engine` (the data-parallel
engine index); series of several engines are summed (gauges of requests, histograms) or
maxed (KV-cache usage, the fullest engine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from autoscaler.histograms import CumulativeHistogram
from router.signals.engine_load import metric_families

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
QUEUE_TIME = "vllm:request_queue_time_seconds"
FAMILIES = (WAITING, RUNNING, KV_CACHE_USAGE, QUEUE_TIME)


class EngineMetricsError(ValueError):
    """The text is not a Prometheus exposition the parser accepts."""


@dataclass(frozen=True)
class EngineSample:
    """One scrape of one replica. None where the engine exports no such series.

    `waiting`, `running`: requests (summed over engines); `kv_cache_usage`: fraction 0..1 (max
    over engines); `queue_time`: the cumulative `vllm:request_queue_time_seconds` histogram
    (summed over engines)."""

    waiting: float | None = None
    running: float | None = None
    kv_cache_usage: float | None = None
    queue_time: CumulativeHistogram | None = None


def parse_engine_metrics(text: str, model_name: str | None = None) -> EngineSample:
    """The autoscaler's series from an engine's `/metrics` ``text``.

    ``model_name``: keep only samples labelled with it (None: all). Raises EngineMetricsError
    when the text cannot be parsed.
    """
    gauges: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_CACHE_USAGE: []}
    buckets: dict[float, float] = {}
    hist_sum = hist_count = 0.0
    seen_hist = False
    try:
        families = metric_families(text, FAMILIES)
    except ValueError as err:
        raise EngineMetricsError(str(err)) from err
    for family in families:
        for s in family.samples:
            if model_name is not None and s.labels.get("model_name", model_name) != model_name:
                continue
            if family.name in gauges and s.name == family.name:
                gauges[family.name].append(float(s.value))
            elif family.name == QUEUE_TIME:
                if s.name == QUEUE_TIME + "_bucket":
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + float(s.value)
                    seen_hist = True
                elif s.name == QUEUE_TIME + "_sum":
                    hist_sum += float(s.value)
                elif s.name == QUEUE_TIME + "_count":
                    hist_count += float(s.value)
    queue_time = None
    if seen_hist and math.inf in buckets:
        bounds = tuple(sorted(buckets))
        queue_time = CumulativeHistogram(bounds, tuple(buckets[b] for b in bounds), hist_sum, hist_count)
    return EngineSample(
        waiting=sum(gauges[WAITING]) if gauges[WAITING] else None,
        running=sum(gauges[RUNNING]) if gauges[RUNNING] else None,
        kv_cache_usage=max(gauges[KV_CACHE_USAGE]) if gauges[KV_CACHE_USAGE] else None,
        queue_time=queue_time,
    )
