"""How long and how slowly an engine may answer, and how often a broken stream may move on.

Owns `StreamLimits` (a pool's limits on one request's upstream answer, with their defaults and
where their names come from) and `DEFAULT_MIGRATION_LIMIT`. Built from the pool document's
`stream_limits` and `migration_limit` (`router.pools.spec.PoolSpec`) by
`router.pools.pool.PoolTable.put`; read by the request path (`router.request.relay.StreamGuard`
cuts a stream, `router.request.proxy` counts migrations). Pure data.

- `max_stream_duration_s` (Envoy's route `max_stream_duration`; 1,800 s): the longest a request
  may take from its arrival at the router to its last byte, retries and migrations included. A
  generation of 8,192 tokens at 0.2 s per token (ten times the slowest decode step of the
  simulator's profiles, `router.request.deadline`) takes 1,640 s; beyond it, an answer is no
  longer worth waiting for. A stream past it ends with an OpenAI error event; a request with no
  response head yet gets a 504.
- `min_bytes_per_s` over `rate_window_s` (the `MinRate` of Apache's mod_reqtimeout, applied to
  the engine's answer; 16 bytes/s over 30 s): once a stream's first chunk is in, each window of
  `rate_window_s` must bring at least `min_bytes_per_s x rate_window_s` bytes. A vLLM token event
  is 150 bytes or more, so the floor asks for about three tokens per 30 s: an engine trickling
  a byte every 2 s is cut after one window, an engine preempting a request (silent while it
  recomputes) is left to the idle cut (`router.request.relay.StreamIdle`).
- `max_response_bytes` (64 MiB): the largest sized (non-streamed) answer relayed. An OpenAI
  completion is some KiB; one with `n` choices and top-20 logprobs over thousands of tokens some
  MiB; an engine announcing more is broken (a body it should not send), and its answer fails the
  attempt before any byte goes to the client (retried elsewhere, counted for ejection).
- `DEFAULT_MIGRATION_LIMIT` (3): the most times one stream moves to another endpoint after its
  engine failed mid-stream (`router.request.migrate`). NVIDIA Dynamo's `--migration-limit`, whose
  documentation says to start with 3 (Dynamo's own default is 0, off; here migration is on
  because it costs nothing while no engine fails: docs/router.md, "Request migration").
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_STREAM_DURATION_S = 1800.0
"""Longest request, arrival to last byte (seconds; module docstring)."""
DEFAULT_MIN_BYTES_PER_S = 16.0
"""Least bytes per second an engine must send once its stream began (module docstring)."""
DEFAULT_RATE_WINDOW_S = 30.0
"""Seconds over which `min_bytes_per_s` is measured (module docstring)."""
DEFAULT_MAX_RESPONSE_BYTES = 64 * 1024 * 1024
"""Largest sized answer relayed (bytes; module docstring)."""
DEFAULT_MIGRATION_LIMIT = 3
"""Most migrations of one stream (module docstring)."""


@dataclass(frozen=True, slots=True)
class StreamLimits:
    """A pool's limits on one request's upstream answer (module docstring; seconds, bytes/s).

    `max_stream_duration_s` None: no total limit; `min_bytes_per_s` 0: no rate floor;
    `max_response_bytes`: the largest sized answer. Raises ValueError for a negative rate or a
    non-positive duration, window or size."""

    max_stream_duration_s: float | None = DEFAULT_MAX_STREAM_DURATION_S
    min_bytes_per_s: float = DEFAULT_MIN_BYTES_PER_S
    rate_window_s: float = DEFAULT_RATE_WINDOW_S
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        if self.max_stream_duration_s is not None and not self.max_stream_duration_s > 0:
            raise ValueError(f"max_stream_duration_s must be > 0, got {self.max_stream_duration_s}")
        if self.min_bytes_per_s < 0:
            raise ValueError(f"min_bytes_per_s must be >= 0, got {self.min_bytes_per_s}")
        if not self.rate_window_s > 0:
            raise ValueError(f"rate_window_s must be > 0, got {self.rate_window_s}")
        if self.max_response_bytes < 1:
            raise ValueError(f"max_response_bytes must be >= 1, got {self.max_response_bytes}")
