"""Prometheus metrics of one SIMULATED replica, under vLLM's own names, labels and buckets.

Owns `ReplicaMetrics`: one prometheus-client registry per simulated replica (many replicas
share a process, each with its own ``/metrics``). Names, label names (``model_name``,
``engine``, plus ``finished_reason`` / ``reason`` / ``source`` / ``sleep_state`` where vLLM has
them), help texts and bucket boundaries follow vLLM 0.32 (vllm/v1/metrics/loggers.py and
buckets.py), checked against a capture of real vLLM in tests/data/vllm-0.32-metrics.txt. Every
help text ends with "(Fleet engine SIMULATOR)". Fed by `fleet.enginesim.server` from the model's
`StepResult` / `FinishedRequest` / `EngineStats`.

Not implemented (vLLM has them, the simulator has nothing to report): speculative decoding, KV
connector / external prefix cache, multi-modal cache, LoRA, estimated FLOPs and bytes, and
``vllm:cache_config_info`` (whose labels are the whole CacheConfig); ``fleet_sim_info`` says
which profile a replica runs instead.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fleet.enginesim.model import EngineStats, FinishedRequest, StepResult

SIM_NOTE = " (Fleet engine SIMULATOR)"
LABELS = ("model_name", "engine")

# vllm/v1/metrics/buckets.py (vLLM 0.32).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series capped at ``max_model_len`` (`build_1_2_5_buckets`)."""
    out: list[float] = []
    exponent = 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class ReplicaMetrics:
    """The ``vllm:`` series of one simulated replica (engine index "0", like a one-engine vLLM)."""

    def __init__(self, model_name: str, max_model_len: int, profile: str = "", engine: str = "0") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        lv = (model_name, engine)
        tok = request_tokens_buckets(max_model_len)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc + SIM_NOTE, LABELS, registry=r, multiprocess_mode="mostrecent")

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc + SIM_NOTE, LABELS + extra, registry=r)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc + SIM_NOTE, LABELS, buckets=buckets, registry=r).labels(*lv)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.").labels(*lv)
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.").labels(*lv)
        waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
            "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
            "Sum of all reasons equals vllm:num_requests_waiting." + SIM_NOTE,
            LABELS + ("reason",), registry=r,
        )  # fmt: skip
        self.waiting_capacity = waiting_by_reason.labels(*lv, "capacity")
        waiting_by_reason.labels(*lv, "deferred").set(0)
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2." + SIM_NOTE,
            LABELS + ("sleep_state",), registry=r,
        )  # fmt: skip
        sleep.labels(*lv, "awake").set(1)
        sleep.labels(*lv, "weights_offloaded").set(0)
        sleep.labels(*lv, "discard_all").set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.").labels(*lv)

        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.").labels(*lv)
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.").labels(*lv)
        self.preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.").labels(*lv)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.").labels(*lv)
        by_source = counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", ("source",))
        self.prompt_by_source = {s: by_source.labels(*lv, s) for s in PROMPT_TOKEN_SOURCES}
        self.prompt_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).").labels(*lv)
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed.").labels(*lv)
        success = counter("vllm:request_success", "Count of successfully processed requests.", ("finished_reason",))
        self.success = {reason: success.labels(*lv, reason) for reason in FINISHED_REASONS}

        self.h_prompt_tokens = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tok)
        self.h_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tok)
        self.h_iteration_tokens = hist(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.h_max_generation_tokens = hist(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tok)
        self.h_params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS)
        self.h_params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tok)
        self.h_ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           TIME_TO_FIRST_TOKEN_BUCKETS)  # fmt: skip
        self.h_itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          INTER_TOKEN_LATENCY_BUCKETS)  # fmt: skip
        self.h_tpot = hist("vllm:request_time_per_output_token_seconds",
                           "Histogram of time_per_output_token_seconds per request.",
                           INTER_TOKEN_LATENCY_BUCKETS)  # fmt: skip
        self.h_e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                          REQUEST_LATENCY_BUCKETS)  # fmt: skip
        self.h_queue = hist("vllm:request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.h_inference = hist("vllm:request_inference_time_seconds",
                                "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.h_prefill = hist("vllm:request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.h_decode = hist("vllm:request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.h_num_preemptions = hist(
            "vllm:request_num_preemptions", "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS)  # fmt: skip
        self.h_prefill_kv_computed = hist(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", tok)  # fmt: skip

        info = Gauge("fleet_sim_info", "This replica is a Fleet engine SIMULATOR, not vLLM; value 1.",
                     ("model_name", "profile"), registry=r)  # fmt: skip
        info.labels(model_name, profile).set(1)
        self._last = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0, 0)

    # ----- feeding ----------------------------------------------------------------------

    def request_received(self, max_tokens: int, n: int = 1) -> None:
        """A request was admitted with these sampling parameters."""
        self.h_params_n.observe(n)
        self.h_params_max_tokens.observe(max_tokens)

    def step(self, result: StepResult, stats: EngineStats, itls_s: list[float]) -> None:
        """After a step: iteration tokens, inter-token latencies, gauges and counters."""
        if result.num_batched_tokens:
            self.h_iteration_tokens.observe(result.num_batched_tokens)
        for itl in itls_s:
            self.h_itl.observe(itl)
        self.gauges(stats)

    def gauges(self, stats: EngineStats) -> None:
        """Set gauges and advance counters to ``stats``."""
        last = self._last
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.waiting_capacity.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_queries.inc(stats.prefix_cache_queries - last.prefix_cache_queries)
        self.prefix_hits.inc(stats.prefix_cache_hits - last.prefix_cache_hits)
        self.preemptions.inc(stats.num_preemptions - last.num_preemptions)
        self.prompt_tokens.inc(stats.prompt_tokens - last.prompt_tokens)
        self.generation_tokens.inc(stats.generation_tokens - last.generation_tokens)
        self._last = stats

    def first_token(self, ttft_s: float) -> None:
        """A request emitted its first token (vLLM observes TTFT then, not at the end)."""
        self.h_ttft.observe(ttft_s)

    def finished(self, fr: FinishedRequest, max_tokens: int) -> None:
        """A request left the engine."""
        self.success[fr.finish_reason if fr.finish_reason in self.success else "error"].inc()
        self.h_prompt_tokens.observe(fr.num_prompt_tokens)
        self.h_generation_tokens.observe(fr.num_output_tokens)
        self.h_max_generation_tokens.observe(max_tokens)
        self.h_num_preemptions.observe(fr.num_preemptions)
        computed = fr.num_prompt_tokens - fr.num_cached_prompt_tokens
        self.h_prefill_kv_computed.observe(computed)
        self.prompt_by_source["local_compute"].inc(computed)
        self.prompt_by_source["local_cache_hit"].inc(fr.num_cached_prompt_tokens)
        self.prompt_cached.inc(fr.num_cached_prompt_tokens)
        self.h_e2e.observe(fr.e2e_s)
        self.h_queue.observe(fr.queue_s)
        self.h_inference.observe(fr.inference_s)
        self.h_prefill.observe(fr.prefill_s)
        self.h_decode.observe(fr.decode_s)
        if fr.num_output_tokens > 1:
            self.h_tpot.observe(fr.tpot_s)

    def exposition(self) -> bytes:
        """The text format (0.0.4) of every series."""
        return generate_latest(self.registry)
