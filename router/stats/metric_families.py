"""The router's counter and histogram families: names, help texts, labels and buckets.

Owns `RouterFamilies` (every counter and histogram the router exports at `GET /metrics`, made on
one `CollectorRegistry`), the histogram buckets (`TTFT_BUCKETS_S`, `TPOT_BUCKETS_S`,
`E2E_BUCKETS_S`) and the labels of per-endpoint series (`ENDPOINT_LABELS`). Built once per app as
the base of `router.stats.metrics.RouterMetrics`; the bundles of label children
(`router.stats.endpoint_metrics`) record into these families; `fleet.observability` reads the
buckets and labels to write its rules and dashboards.

Names follow the Prometheus conventions (base units, `_total` for counters, `_seconds` for
durations).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the time-to-first-token and time-to-first-byte histograms: vLLM's
`TIME_TO_FIRST_TOKEN_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32), so the router's
TTFT and the engines' `vllm:time_to_first_token_seconds` can be compared bucket by bucket."""

TPOT_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the time-per-output-token histogram: vLLM's
`INTER_TOKEN_LATENCY_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32; the buckets of
`vllm:request_time_per_output_token_seconds`, as in fleet/enginesim/metrics.py)."""

E2E_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.1,
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Bucket upper bounds (s) of the end-to-end latency histogram: vLLM's
`REQUEST_LATENCY_BUCKETS` (vllm/v1/metrics/buckets.py, vLLM 0.32, 0.3 s to 7680 s) with
four sub-0.3 s bounds added in front, because the router also sees fast upstream errors
and tiny completions that vLLM's engine-side histogram lumps into its first bucket."""

ENDPOINT_LABELS = ("model", "endpoint", "version")
"""Labels of every per-endpoint series: the pool's model, the endpoint id and the endpoint's
version (`router.pools.spec.EndpointSpec.version`), so dashboards compare a canary's version with the
stable one (`sum by (model, version)`). Bounded by the pools an operator declares, never by
clients; an endpoint that leaves its pool (or changes version) takes its series with it."""


class RouterFamilies:
    """The router's counters and histograms on ``registry`` (a dedicated `CollectorRegistry`, never
    the process-global one, so several apps can live in one process). Each attribute is one
    family; its help text says what it counts. The gauges read at scrape time are
    `router.stats.scrape_gauges`'."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        r = registry
        endpoint = list(ENDPOINT_LABELS)
        self.requests = Counter(
            "fleet_router_requests",
            "Requests answered by an endpoint, by HTTP status code the endpoint returned.",
            [*endpoint, "code"],
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "fleet_router_time_to_first_byte_seconds",
            "Seconds from dispatching a request to an endpoint until its response began: the first "
            "body chunk of a streamed response, the response head of a sized one (for a non-streamed "
            "completion that is the whole answer). Successful (< 400) responses only.",
            endpoint,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "fleet_router_time_to_first_token_seconds",
            "Seconds from dispatching a streamed request to an endpoint until the first SSE event "
            "carrying generated text (text, content, reasoning or a tool call) arrived. Successful "
            "(< 400) streamed responses only.",
            endpoint,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.time_per_output_token = Histogram(
            "fleet_router_time_per_output_token_seconds",
            "Per streamed request: (arrival of the last token event - arrival of the first) / "
            "(output tokens - 1), output tokens from the stream's usage chunk when it has one, else "
            "the count of events carrying text (router.protocol.sse). Requests with >= 2 tokens over >= 2 reads.",
            endpoint,
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.e2e_latency = Histogram(
            "fleet_router_e2e_request_latency_seconds",
            "Seconds from dispatching a request to an endpoint until the last response byte "
            "was relayed to the client.",
            endpoint,
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.endpoint_errors = Counter(
            "fleet_router_endpoint_errors",
            "Failed attempts against an endpoint, by reason (connect, timeout, http_5xx, interrupted).",
            [*endpoint, "reason"],
            registry=r,
        )
        self.retries = Counter(
            "fleet_router_retries",
            "Requests re-sent to another endpoint while nothing had been sent to the client: after a "
            "connection failure before any response byte, a first-token timeout or a 5xx answer.",
            ["model"],
            registry=r,
        )
        self.first_token_timeouts = Counter(
            "fleet_router_first_token_timeouts",
            "Attempts that got no first token (streamed) or response head (not streamed) from the endpoint "
            "within the request's first-token deadline (router.request.deadline): a stalled or overloaded engine.",
            endpoint,
            registry=r,
        )
        self.endpoint_ejections = Counter(
            "fleet_router_endpoint_ejections",
            "Times outlier detection took an endpoint out of its pool's candidates (router.pools.outlier), by the "
            "failure run that caused it: stall (first-token timeouts), gateway (502/503/504, connection "
            "failures), 5xx.",
            [*endpoint, "reason"],
            registry=r,
        )
        self.migrations = Counter(
            "fleet_router_migrations",
            "Streams moved to another endpoint of their revision after their engine broke them off "
            "mid-stream (router.request.migrate), by why it broke: interrupted (connection reset, engine "
            "gone, an answer that is not a stream) or stalled (silent, under the byte-rate floor).",
            ["model", "reason"],
            registry=r,
        )
        self.unmigrated_streams = Counter(
            "fleet_router_unmigrated_streams",
            "Streams broken off mid-way that were not migrated and ended with an error event, by reason: a "
            "request field that rules migration out (n, logprobs, echo, suffix, tools, structured_output, "
            "prompt_not_text), too_long, limit (migration_limit spent), duration (max_stream_duration_s over), "
            "no_endpoint, nothing_left.",
            ["model", "reason"],
            registry=r,
        )
        self.migration_time = Histogram(
            "fleet_router_migration_seconds",
            "Seconds a migrated stream waited between its engine's failure and its continuation's first "
            "event: the latency a migration adds.",
            ["model"],
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.queue_time = Histogram(
            "fleet_router_queue_time_seconds",
            "Seconds from a request's arrival at the router (body read, model known) until its "
            "dispatch to an endpoint: the wait in the admission queue, 0 without one (a request "
            "that timed out in the queue counts with the time it waited).",
            ["model"],
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.rejected = Counter(
            "fleet_router_rejected_requests",
            "Requests the router answered itself with an error, by HTTP status: 400 bad request "
            "(JSON or HTTP), "
            "401 admin token, 404 unknown model or path, 405, 408 request not received in time, 413, "
            "414 request target too long, 422 bad admin document, 431 request head or a header "
            "too large, 500 router bug, 502 all attempts "
            "failed or the endpoint failed before answering, 504 endpoint timed out, 503 no "
            "ready endpoint, queue full, or a model served before a restart not yet published "
            "again. model: the pool's model (or the model served before the restart); '(unknown)' "
            "for a model without a pool; empty when no model was named.",
            ["model", "code"],
            registry=r,
        )
        model_version = ["model", "version"]
        self.prompt_tokens = Counter(
            "fleet_router_prompt_tokens",
            "Prompt tokens of answered (< 400) requests, from the engine's usage object (a stream "
            "without a usage chunk counts none: see fleet_router_responses_without_usage_total). "
            "As vllm:prompt_tokens_total, per model and version (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.generation_tokens = Counter(
            "fleet_router_generation_tokens",
            "Generated (output) tokens of answered (< 400) requests: usage.completion_tokens when the "
            "response has a usage object (always when not streamed; streamed with "
            "stream_options.include_usage), else the stream's events carrying text (one per token "
            "in vLLM's default; fewer when it batches). As vllm:generation_tokens_total (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.responses_without_usage = Counter(
            "fleet_router_responses_without_usage",
            "Answered (< 400) responses without a usage object: their generated tokens were counted "
            "from the stream's text events and their prompt tokens not at all (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "fleet_router_prefix_cache_hits",
            "Prompt tokens the engine found in its prefix cache, for answered (< 400) requests whose "
            "usage says so (usage.prompt_tokens_details.cached_tokens: vLLM's "
            "--enable-prompt-tokens-details). As vllm:prefix_cache_hits_total, counted at the router, "
            "per model and version (router.protocol.tokens).",
            model_version,
            registry=r,
        )
        self.prefix_cache_predicted_hits = Counter(
            "fleet_router_prefix_cache_predicted_hits",
            "Prompt tokens the routing policy expected the chosen endpoint to hold in its prefix cache "
            "(kv-aware, cache-aware; 0 for policies that do not predict), for the same requests as "
            "fleet_router_prefix_cache_hits_total: their ratio is how well the router's view of the "
            "caches matches the engines' (1: exact; above: the router believes more is cached).",
            model_version,
            registry=r,
        )
        self.state_write_errors = Counter(
            "fleet_router_state_write_errors",
            "Failed writes of the router's models file (the models it serves, kept so a restarted "
            "router answers 503 for them, not 404, until they are published again; "
            "router.http.remembered). Each failure is retried with backoff; serving is unaffected.",
            registry=r,
        )
        kv = ["model", "endpoint"]
        self.kv_events = Counter(
            "fleet_router_kv_events",
            "KV cache events (vLLM --kv-events-config: BlockStored, BlockRemoved, AllBlocksCleared) applied to the "
            "router's exact block index, live or replayed (router.signals.kv_subscriber).",
            kv, registry=r,
        )  # fmt: skip
        self.kv_event_gaps = Counter(
            "fleet_router_kv_event_gaps",
            "Breaks in an endpoint's KV event stream: a sequence number skipped or gone back, or the stream "
            "reconnected; each is followed by a replay request.",
            kv, registry=r,
        )  # fmt: skip
        self.kv_event_resyncs = Counter(
            "fleet_router_kv_event_resyncs",
            "Times an endpoint's exact view was dropped and rebuilt from the stream, by reason: restart (the "
            "publisher restarted: seq went back or the replayed batch differs), replay_gone (the replay buffer no "
            "longer held the missed batches, or the replay socket did not answer), no_replay (no replay address), "
            "bad_payload (a batch that did not decode).",
            [*kv, "reason"], registry=r,
        )  # fmt: skip
        self.kv_event_errors = Counter(
            "fleet_router_kv_event_errors",
            "KV event messages that could not be read, by reason: decode (payload not a KV event batch), "
            "frames (not topic, seq, payload), replay (a bad replay answer).",
            [*kv, "reason"], registry=r,
        )  # fmt: skip
