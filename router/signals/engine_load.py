"""The load the engines report, combined with this router's own: what other routers sent.

Owns `EngineLoad` (one sample of an engine's load), `parse_engine_load` (read it from vLLM's
Prometheus `/metrics` text, through `metric_families`, which the autoscaler's scrape shares) and
`EngineLoadView` (turn a sample into an estimate of the load other routers put on the endpoint,
handed to `router.pools.endpoint.EndpointState.set_others_load`). Called by
`router.signals.engine_poll.EnginePoller` (live: each endpoint's `/metrics` polled every
`DEFAULT_POLL_INTERVAL_S`) and by the trace simulator (`fleet.tracesim.engine`, samples of the
simulated engines at the same interval, in virtual time); `router.pools.policies.KvAware` reads the
estimate. Pure: no I/O, times are passed in.

**Why.** Each router counts only the requests it sent. With two routers behind one Service,
each sees about half of every endpoint's load, and both can send long prompts to the same
replica at once: in the trace simulator (docs/routing.md, "Load signals between two routers")
that raised `kv-aware`'s p99 TTFT on the Mooncake trace from 2.72 s to 4.39 s. This is the fallback of
routers without an endpoint picker: the picker (`router.picker`), which holds every router's
requests, does better, because what queues on an endpoint is prompt tokens and vLLM exports only
request counts.

**How.** At a sample the engine holds `waiting + running` requests, and this router knows how
many of them are its own (`EndpointState.in_flight` at that instant); the rest came from other
routers:

    others_in_flight     = max(0, waiting + running - own in flight)
    others_prefilling    = others_in_flight x waiting / (waiting + running)
    others_prefill_tokens = others_prefilling x mean queued prefill per own prefilling request

(when the engine reports its queued prefill tokens and prefilling requests, as the trace
simulator's engines can, those replace the two estimates: reported minus own). Between samples
the router's own load stays exact and live (its dispatches since the sample count at once), and
the others' estimate is held until `max_age_s` after the sample, then dropped (the policy falls
back to own load only). vLLM series: `vllm:num_requests_waiting`, `vllm:num_requests_running`
(gauges, requests, one series per data-parallel engine: summed), `vllm:kv_cache_usage_perc`
(gauge, fraction 0..1: the fullest engine) from vllm/v1/metrics/loggers.py (vLLM 0.32).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from router.pools.endpoint import EndpointState

DEFAULT_POLL_INTERVAL_S = 0.1
"""Seconds between two polls of an endpoint's `/metrics` for its load. In the trace simulator on
the Mooncake trace with two routers (docs/routing.md, "Load signals between two routers") the
interval made no difference between 50 ms and 1 s (p99 TTFT 4.32-4.54 s): the engines' request counts are
what limit this signal, not their age. With the engines' KV events, 100 ms took p99 from 4.19 s
(own load only) to 3.78 s. Opt-in (`python -m router --engine-load-interval-ms 100`) for routers
without an endpoint picker (the picker does better)."""

DEFAULT_MAX_AGE_S = 1.0
"""Seconds after a sample during which its estimate of other routers' load is used: ten
polls at the default interval. Past it (the endpoint stopped answering `/metrics`) `kv-aware`
counts only this router's own load, as a router without the shared signal does."""

DEFAULT_MEAN_PREFILL_TOKENS = 1024.0
"""Prefill tokens assumed per prefilling request before this router has seen any of its own
prefilling on the endpoint (then the EWMA of what it saw takes over)."""

MEAN_PREFILL_ALPHA = 0.2
"""Weight of the newest observation in the EWMA of queued prefill tokens per request."""

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
_FAMILIES = (WAITING, RUNNING, KV_CACHE_USAGE)


class EngineLoadError(ValueError):
    """The text is not a Prometheus exposition, or holds none of vLLM's load gauges."""


@dataclass(frozen=True)
class EngineLoad:
    """One sample of an engine's load.

    `waiting`, `running`: requests in the engine's scheduler (summed over data-parallel
    engines); `kv_cache_usage`: fraction 0..1 of KV blocks in use (max over engines; None when
    not exported); `prefill_tokens`, `prefilling`: prompt tokens still to prefill and the
    requests they belong to, where the engine reports them (the trace simulator's engines; vLLM
    exports neither: None)."""

    waiting: float
    running: float
    kv_cache_usage: float | None = None
    prefill_tokens: float | None = None
    prefilling: float | None = None


def metric_families(text: str, names: tuple[str, ...]) -> list[Metric]:
    """The families of the Prometheus exposition `text` whose names start with one of `names` (so
    a histogram's ``_bucket``, ``_sum`` and ``_count`` lines come with it), parsed by
    prometheus-client's text parser (`prometheus_client.parser.text_string_to_metric_families`)
    fed only their lines: a 600-line vLLM exposition parses in well under a millisecond. Shared
    with the autoscaler's scrape (`autoscaler.engine_metrics`).

    Raises:
        ValueError: the wanted lines do not parse ("cannot parse /metrics: ...").
    """
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(maxsplit=3)
            name = parts[2] if len(parts) > 2 and parts[1] in ("HELP", "TYPE") else ""
        else:
            name = line.split("{", 1)[0].split(" ", 1)[0]
        if name.startswith(names):
            keep.append(line)
    try:
        return list(text_string_to_metric_families("\n".join(keep) + "\n"))
    except (ValueError, TypeError, IndexError) as err:
        raise ValueError(f"cannot parse /metrics: {err}") from err


def parse_engine_load(text: str, model_name: str | None = None) -> EngineLoad:
    """The load gauges of a vLLM `/metrics` exposition (`metric_families` of the three wanted
    families).

    ``model_name``: keep only samples labelled with it (None: all).

    Raises:
        EngineLoadError: the text does not parse, or has no waiting or running gauge.
    """
    values: dict[str, list[float]] = {WAITING: [], RUNNING: [], KV_CACHE_USAGE: []}
    try:
        families = metric_families(text, _FAMILIES)
    except ValueError as err:
        raise EngineLoadError(str(err)) from err
    for family in families:
        for s in family.samples:
            if s.name != family.name or family.name not in values:
                continue
            if model_name is not None and s.labels.get("model_name", model_name) != model_name:
                continue
            values[family.name].append(float(s.value))
    if not values[WAITING] or not values[RUNNING]:
        raise EngineLoadError(f"/metrics has no {WAITING} or {RUNNING} gauge")
    usage = values[KV_CACHE_USAGE]
    return EngineLoad(waiting=sum(values[WAITING]), running=sum(values[RUNNING]),
                      kv_cache_usage=max(usage) if usage else None)  # fmt: skip


ESTIMATES = ("mix", "waiting")
"""How `EngineLoadView` splits the others' requests into prefilling and decoding ones when the
engine reports only counts: ``mix``, in the proportions of this router's own requests;
``waiting``, the engine's waiting share (module docstring)."""


class EngineLoadView:
    """One router's estimate of the load other routers put on each endpoint (module docstring).

    `observe(endpoint, sample, now_s)` sets `endpoint.others_*` from an engine sample taken
    now (router-clock seconds) and this router's own load on the endpoint at that instant;
    `forget(endpoint)` drops the estimate. Keeps EWMAs (`MEAN_PREFILL_ALPHA`) of this router's
    own requests in flight: the share still prefilling, and the prefill tokens per request.

    Args:
        max_age_s: how long an estimate is used after its sample (`DEFAULT_MAX_AGE_S`).
        estimate: one of `ESTIMATES` (default ``mix``).

    Raises:
        ValueError: `max_age_s` <= 0, or an unknown `estimate`.
    """

    def __init__(self, max_age_s: float = DEFAULT_MAX_AGE_S, estimate: str = "mix") -> None:
        if max_age_s <= 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        if estimate not in ESTIMATES:
            raise ValueError(f"estimate must be one of {', '.join(ESTIMATES)}, got {estimate!r}")
        self.max_age_s = max_age_s
        self.estimate = estimate
        self.prefilling_share = 1.0
        self.tokens_per_request = DEFAULT_MEAN_PREFILL_TOKENS
        self.tokens_per_prefilling = DEFAULT_MEAN_PREFILL_TOKENS

    def observe(self, endpoint: EndpointState, sample: EngineLoad, now_s: float) -> None:
        """Estimate the others' load on `endpoint` from `sample`, taken at `now_s`."""
        own = endpoint.in_flight
        own_prefilling = endpoint.prefilling
        a = MEAN_PREFILL_ALPHA
        if own > 0:
            self.prefilling_share += a * (own_prefilling / own - self.prefilling_share)
            self.tokens_per_request += a * (endpoint.prefill_tokens / own - self.tokens_per_request)
        if own_prefilling > 0:
            self.tokens_per_prefilling += a * (endpoint.prefill_tokens / own_prefilling - self.tokens_per_prefilling)
        engine = sample.waiting + sample.running
        others = max(0, round(engine) - own)
        if sample.prefill_tokens is not None and sample.prefilling is not None:
            prefilling = min(others, max(0, round(sample.prefilling) - own_prefilling))
            tokens = max(0.0, sample.prefill_tokens - endpoint.prefill_tokens) if prefilling else 0.0
        elif self.estimate == "mix":
            prefilling = round(others * self.prefilling_share)
            tokens = others * self.tokens_per_request
        else:
            prefilling = round(others * sample.waiting / engine) if engine > 0 else 0
            tokens = prefilling * self.tokens_per_prefilling
        endpoint.set_others_load(others, prefilling, tokens, now_s + self.max_age_s)

    @staticmethod
    def forget(endpoint: EndpointState) -> None:
        """Drop the estimate for `endpoint` (its engine is unreachable, or it left the pool)."""
        endpoint.forget_others_load()
