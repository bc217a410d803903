"""The desired-state documents of the router's admin API: pools and their endpoints.

Owns the pydantic models `EndpointSpec`, `KvEventsSource`, `OutlierDetectionSpec`,
`StreamLimitsSpec` and `PoolSpec`, the body of
`PUT /admin/v1/pools/{model}`. Parsed by `router.http.admin`; applied by
`router.pools.pool.PoolTable.put`; a controller may build them to talk to the router.
Bad input is rejected here, naming the field (`router.http.admin` turns it into a 422 in OpenAI's
error format). Numbers must be finite: `NaN` and `Infinity` (which Python's JSON parser accepts)
are refused, as are pools of more than `MAX_ENDPOINTS_PER_POOL` endpoints. An endpoint's
`kv_events` (`KvEventsSource`) names where its engine publishes KV cache events.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.pools.outlier import OutlierSettings
from router.pools.policies import DEFAULT_POLICY, ROUTING_POLICIES, policy_names
from router.pools.split import STICKY_KEY_PATTERN
from router.pools.upstream import DEFAULT_MIGRATION_LIMIT, StreamLimits

DEFAULT_MAX_QUEUE_LENGTH = 1000
"""Requests that may wait in one model's admission queue (when the queue is on)."""
DEFAULT_QUEUE_TIMEOUT_S = 30.0
"""Longest wait (seconds) in the admission queue before the router answers 503."""
DEFAULT_MAX_RETRIES = 1
"""Times a request is re-sent to another endpoint after a first-token timeout or a 5xx answer,
while nothing has been sent to the client (connection failures have their own budget,
`router.request.proxy.DEFAULT_MAX_ATTEMPTS`)."""
MAX_ENDPOINTS_PER_POOL = 100_000
"""Most endpoints one pool document may list: ten times the largest pool the router is measured
with (loadtests/bench_pool_update.py), so a runaway controller gets a 422, not a stalled router."""


ZMQ_URL_PATTERN = r"^(tcp://[^\s/]+:[0-9]{1,5}|ipc://[^\s]+)$"
"""A ZMQ address a subscriber connects to: `tcp://host:port` or `ipc://path`."""


class KvEventsSource(BaseModel):
    """Where an endpoint's engine publishes its KV cache events: the addresses of its vLLM
    `--kv-events-config` (`endpoint`, `replay_endpoint`, `topic`; vllm/config/kv_events.py) as a
    subscriber connects to them (the engine binds `tcp://*:5557`, the router connects to
    `tcp://<engine host>:5557`). Read by `router.signals.kv_subscriber`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    publisher: str = Field(
        max_length=2048, pattern=ZMQ_URL_PATTERN,
        description="The engine's PUB socket, `tcp://host:port` or `ipc://path`.",
    )  # fmt: skip
    replay: str | None = Field(
        default=None, max_length=2048, pattern=ZMQ_URL_PATTERN,
        description="The engine's replay ROUTER socket (`replay_endpoint`), from which missed batches are "
        "asked after a gap; None: a gap cannot be replayed and the endpoint's view is rebuilt instead.",
    )  # fmt: skip
    topic: str = Field(default="", max_length=256, description="The publisher's topic (vLLM `topic`; default empty).")

    @field_validator("publisher", "replay")
    @classmethod
    def _check_port(cls, url: str | None) -> str | None:
        if url is not None and url.startswith("tcp://") and not 0 < int(url.rsplit(":", 1)[1]) < 65536:
            raise ValueError(f"port must be 1-65535, got {url!r}")
        return url


MAX_ENDPOINT_WEIGHT = 1_000_000.0
"""Largest endpoint weight a pool document may give: weights are relative, and a bound keeps their
sum finite (a larger one is refused with the field named, where its sum overflowed into a 500)."""


class EndpointSpec(BaseModel):
    """One engine endpoint of a pool."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    id: str = Field(
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]*$",
        description="Endpoint id, unique in the pool (e.g. the replica name `chat-0`); a metric label.",
    )
    url: str = Field(
        max_length=2048,
        description="Base URL of the engine's OpenAI server, `http://host:port`, no path; "
        "the request path (`/v1/completions`) is appended.",
    )
    version: str = Field(
        default="", max_length=128,
        description="Revision served (e.g. `v1`): requests are split between the versions of a pool by "
        "weight, and it is the `version` label of the endpoint's metric series.",
    )  # fmt: skip
    weight: float = Field(
        default=1.0,
        ge=0.0,
        le=MAX_ENDPOINT_WEIGHT,
        description="Traffic weight: a revision (version) gets the sum of its ready endpoints' weights as its "
        "share of requests when the pool holds more than one version (router.pools.split); ignored otherwise. "
        f"At most {MAX_ENDPOINT_WEIGHT:g} (the controller's weights are percentages).",
    )
    draining: bool = Field(default=False, description="True: send no new requests; in-flight ones finish.")
    kv_events: KvEventsSource | None = Field(
        default=None,
        description="Where the engine publishes its KV cache events (vLLM `--kv-events-config`); the router "
        "subscribes and routes `kv-aware` on the exact blocks the engine holds. None: no events, the "
        "router's approximate view of the endpoint's cache applies (router.kv.prefix_index).",
    )

    @field_validator("url")
    @classmethod
    def _check_url(cls, url: str) -> str:
        """``http(s)://host[:port]``: a host that is an IP address or a DNS name (no space, RFC 1123
        labels), a port 1-65535, no path, query or fragment. Raises ValueError saying which part."""
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be http(s)://host[:port], got {url!r}")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"url must have no path, query or fragment, got {url!r}")
        if not _is_host(parts.hostname):
            raise ValueError(f"url host {parts.hostname!r} is neither an IP address nor a DNS name, got {url!r}")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"url has a bad port (1-65535): {url!r}") from exc
        if port == 0:
            raise ValueError(f"url has a bad port (1-65535): {url!r}")
        return url.rstrip("/")


_DNS_NAME = re.compile(r"^(?=.{1,253}\.?$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                       r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")
"""A DNS name: dot-separated labels of letters, digits, hyphens (RFC 1123; underscores as some
service records carry), each at most 63 characters, 253 in all."""


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return bool(_DNS_NAME.match(host))
    return True


_OUTLIER = OutlierSettings()


class OutlierDetectionSpec(BaseModel):
    """Envoy-style outlier ejection of a pool's endpoints (`router.pools.outlier`: sources and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    consecutive_5xx: int = Field(
        default=_OUTLIER.consecutive_5xx, ge=0, le=1000,
        description="5xx answers, connection failures and first-token timeouts in a row that eject an "
        "endpoint (Envoy's consecutive_5xx); 0: off.",
    )  # fmt: skip
    consecutive_gateway_failure: int = Field(
        default=_OUTLIER.consecutive_gateway_failure, ge=0, le=1000,
        description="502/503/504 answers, connection failures and first-token timeouts in a row that eject "
        "an endpoint (Envoy's consecutive_gateway_failure); 0: off.",
    )  # fmt: skip
    consecutive_stalls: int = Field(
        default=_OUTLIER.consecutive_stalls, ge=0, le=1000,
        description="First-token timeouts in a row that eject an endpoint; 0: off.",
    )  # fmt: skip
    interval_s: float = Field(
        default=_OUTLIER.interval_s, gt=0, le=3600,
        description="Seconds back in service that lower an endpoint's ejection multiplier by one (Envoy's interval).",
    )  # fmt: skip
    base_ejection_time_s: float = Field(
        default=_OUTLIER.base_ejection_time_s, gt=0, le=3600,
        description="An ejection lasts this many seconds times the endpoint's ejection count (Envoy's "
        "base_ejection_time).",
    )  # fmt: skip
    max_ejection_time_s: float = Field(
        default=_OUTLIER.max_ejection_time_s, gt=0, le=86400,
        description="Longest ejection, seconds (Envoy's max_ejection_time).",
    )  # fmt: skip
    max_ejection_percent: float = Field(
        default=_OUTLIER.max_ejection_percent, ge=0, le=100,
        description="Most of the pool's ready endpoints ejected at once, percent (at least one, never the last).",
    )  # fmt: skip
    slow_start_window_s: float = Field(
        default=_OUTLIER.slow_start_window_s, ge=0, le=3600,
        description="Seconds over which an endpoint back from an ejection ramps up to its full share of "
        "traffic (Envoy's slow_start_window); 0: at once.",
    )  # fmt: skip
    slow_start_aggression: float = Field(
        default=_OUTLIER.slow_start_aggression, gt=0, le=100,
        description="Shape of the ramp (Envoy's aggression): 1 linear, above 1 faster at first.",
    )  # fmt: skip
    slow_start_min_weight_percent: float = Field(
        default=_OUTLIER.slow_start_min_weight_percent, ge=0, le=100,
        description="Least share of its traffic a ramping endpoint takes, percent (Envoy's min_weight_percent).",
    )  # fmt: skip

    def settings(self) -> OutlierSettings:
        """The `router.pools.outlier.OutlierSettings` this spec describes."""
        return OutlierSettings(**self.model_dump())


_LIMITS = StreamLimits()


class StreamLimitsSpec(BaseModel):
    """How long and how slowly an engine may answer one request (`router.pools.upstream`: sources
    and defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_stream_duration_s: float | None = Field(
        default=_LIMITS.max_stream_duration_s, gt=0, le=86400,
        description="Longest a request may take, arrival to last byte, retries and migrations included "
        "(Envoy's max_stream_duration); None: no limit.",
    )  # fmt: skip
    min_bytes_per_s: float = Field(
        default=_LIMITS.min_bytes_per_s, ge=0, le=1e9,
        description="Least bytes per second a stream must bring, measured over rate_window_s once it began "
        "(mod_reqtimeout's MinRate); 0: no floor.",
    )  # fmt: skip
    rate_window_s: float = Field(
        default=_LIMITS.rate_window_s, gt=0, le=3600,
        description="Seconds over which min_bytes_per_s is measured.",
    )  # fmt: skip
    max_response_bytes: int = Field(
        default=_LIMITS.max_response_bytes, ge=1, le=2**40,
        description="Largest sized (non-streamed) answer relayed, bytes; a larger one fails the attempt.",
    )  # fmt: skip

    def limits(self) -> StreamLimits:
        """The `router.pools.upstream.StreamLimits` this spec describes."""
        return StreamLimits(**self.model_dump())


class PoolSpec(BaseModel):
    """The endpoints that serve one model, and how to choose among them."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    policy: str = Field(default=DEFAULT_POLICY, description=f"Routing policy name; one of {policy_names()}.")
    endpoints: list[EndpointSpec] = Field(
        default_factory=list, max_length=MAX_ENDPOINTS_PER_POOL,
        description="All endpoints of the pool, draining ones included; may be empty (503s).",
    )
    max_concurrency_per_endpoint: int | None = Field(
        default=None, ge=1, le=100_000,
        description="Most requests one endpoint gets at once; a request finding every ready endpoint at "
        "this limit waits in the router's admission queue. None: no limit and no queue (dispatch at once).",
    )  # fmt: skip
    max_queue_length: int = Field(
        default=DEFAULT_MAX_QUEUE_LENGTH, ge=0, le=1_000_000,
        description="Most requests waiting in the admission queue; more are answered 503 at once.",
    )  # fmt: skip
    queue_timeout_s: float = Field(
        default=DEFAULT_QUEUE_TIMEOUT_S, gt=0, le=3600,
        description="Longest wait in the admission queue (seconds) before a 503.",
    )  # fmt: skip
    tokenizer: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="Where the router gets the model's tokenizer: a directory on the router's machine holding "
        "tokenizer.json (and tokenizer_config.json / chat_template.jinja), or a hub model `hf://org/name[@revision]` "
        "whose tokenizer files (never its weights) the router fetches with huggingface_hub (HF_ENDPOINT, HF_TOKEN, "
        "HF_HOME). Prompts are tokenized with it to match them against the engines' KV events (router.kv.tokenize). "
        "None, or a tokenizer the router cannot load (logged and counted in fleet_router_tokenizer_loads_total): "
        "routing on the approximate prefix view only.",
    )
    sticky_key: str | None = Field(
        default=None, pattern=STICKY_KEY_PATTERN,
        description="Request key that keeps one user on one revision while weights hold: `header:NAME` "
        "or `body:user` (the OpenAI `user` field). None: requests are split one by one.",
    )
    first_token_timeout_s: float | None = Field(
        default=None, gt=0, le=3600,
        description="Seconds an attempt waits for the engine's first streamed token (or a non-streamed "
        "answer's head, plus a per-output-token allowance) before it is retried elsewhere and counted as a "
        "stall. None: from the request's expected prefill time (router.request.deadline).",
    )  # fmt: skip
    max_retries: int = Field(
        default=DEFAULT_MAX_RETRIES, ge=0, le=10,
        description="Times a request is re-sent to another endpoint after a first-token timeout or a 5xx, "
        "while nothing has been sent to the client.",
    )  # fmt: skip
    migration_limit: int = Field(
        default=DEFAULT_MIGRATION_LIMIT, ge=0, le=10,
        description="Times a stream whose engine broke it off mid-way moves on to another ready endpoint of "
        "its revision (Dynamo's migration_limit; router.request.migrate); 0: never.",
    )  # fmt: skip
    stream_limits: StreamLimitsSpec = Field(
        default_factory=StreamLimitsSpec,
        description="Total-time limit and byte-rate floor of an engine's answer (router.pools.upstream).",
    )
    outlier_detection: OutlierDetectionSpec = Field(
        default_factory=OutlierDetectionSpec,
        description="Ejection of endpoints that stall or fail in a row (router.pools.outlier).",
    )

    @field_validator("policy")
    @classmethod
    def _check_policy(cls, policy: str) -> str:
        return ROUTING_POLICIES.check(policy)

    @model_validator(mode="after")
    def _check_unique_ids(self) -> PoolSpec:
        seen: set[str] = set()
        for endpoint in self.endpoints:
            if endpoint.id in seen:
                raise ValueError(f"duplicate endpoint id {endpoint.id!r}")
            seen.add(endpoint.id)
        return self
