"""What the trace simulator simulates: one deployment's engines, autoscaling, routing, start-up
model and SLO, and the defaults of the modelled times.

Owns `SimConfig` and the modelled defaults (`DEFAULT_WARM_STARTUP_S`, `DEFAULT_COLD_STARTUP_S`,
`DRAIN_TIMEOUT_S`, `DEFAULT_TTFT_SLO_S`, `DEFAULT_WAKE_S`, `LOAD_SIGNALS`). Read by
`fleet.tracesim.engine` (the simulation; its docstring says what each setting models),
`fleet.tracesim.compare` and `fleet simulate`. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec
from fleet.enginesim.profiles import Profile
from router.pools.spec import DEFAULT_MAX_QUEUE_LENGTH, DEFAULT_QUEUE_TIMEOUT_S

DEFAULT_WARM_STARTUP_S = 60.0
"""Modelled placement-to-READY on a warm node (image and weights on the node), seconds: 52 s
measured for one 8B pod with node-local weights (docs/anchors.md), plus warm-up."""

DEFAULT_COLD_STARTUP_S = 600.0
"""Modelled placement-to-READY on a cold node, seconds: image pull (~30 GB vLLM images take
minutes) and weights copied first; "a 4-GPU model load can take about 10 minutes" (same
notes). The same figure as `spec.autoscaling.coldStartupSeconds`' default."""

DRAIN_TIMEOUT_S = 120.0
"""A draining replica's requests still running after this many seconds are aborted
(`fleet.controller.reconcile.ControllerSettings.drain_timeout_s`' default)."""

DEFAULT_TTFT_SLO_S = 2.0
"""The TTFT SLO the share is measured against, seconds: MLPerf Inference's server-scenario
limit for Llama 3.1 8B (and Llama 2 70B), `llama3_1-8b.Server.ttft_latency = 2000` at the 99th
percentile in mlcommons/inference loadgen/mlperf.conf. The interactive scenario's is 0.5 s."""

DEFAULT_WAKE_S = 3.0
"""Modelled seconds from a wake-up asked for (vLLM `POST /wake_up` after `POST /sleep?level=1`)
to READY: the ~3 s llm-d's fast-model-actuation work reports for waking 64 GiB of weights (the
figure `fleet.controller.autoscaling.DEFAULT_WAKE_S` cites), not scaled down for an 8B model's
16 GB: a conservative figure."""

LOAD_SIGNALS = ("own", "engine", "engine-waiting", "engine-prefill")
"""What a router knows of the load other routers sent (`SimConfig.load_signal`)."""


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment.

    ``profile``: the simulated replica (`fleet.enginesim.profiles`); ``autoscaling``: the policy
    and its parameters (`autoscaler.spec.AutoscalingSpec`); ``bounds``: spec.replicas;
    ``routing_policy``, ``max_concurrency_per_endpoint``, ``max_queue_length``,
    ``queue_timeout_s``: spec.routing; ``warm_startup_s`` / ``cold_startup_s``: modelled
    start-up times in seconds (the policy's own estimates start from the spec's
    ``warmStartupSeconds`` / ``coldStartupSeconds`` and follow what it observes);
    ``warm_nodes``: node slots that hold image and weights at the start (default
    `node_slots_warm`: every replica the policy may ask for starts warm, standby included); ``slowdown``: factor on
    every engine step; ``ttft_slo_s``: the SLO the share is measured against (seconds);
    ``drain_timeout_s``: see `DRAIN_TIMEOUT_S`; ``seed``: token ids; ``name``: the row's label;
    ``standby_max``: most STANDBY replicas kept (0: standby off; `fleet.tracesim.engine`'s docstring);
    ``wake_s``: modelled seconds from wake-up to READY (`DEFAULT_WAKE_S`); ``history``: arrival
    rates before the trace, (bin start in seconds before 0, requests/s), given to the policy once
    (`ScalingPolicy.prime`: the forecast of `standby` learns from them);
    ``load_signal`` (one of `LOAD_SIGNALS`) and ``load_interval_s`` (seconds between engine load
    samples): what each router knows of the others' load (module
    docstring of `fleet.tracesim.engine`); ``kv_events``: the engines' KV cache events reach every
    router's exact index, ``kv_events_delay_s`` after the step that made them (same docstring);
    ``picker``: the routers ask one endpoint picker for every pick (`fleet.tracesim.picker`), which
    alone keeps an exact index (with ``kv_events``) and every router's load.

    Raises ValueError for an unknown ``load_signal``, a negative ``load_interval_s`` (or 0 for an
    engine signal), start-up times outside ``0 <= warm <= cold``, a negative
    ``warm_nodes``, ``standby_max`` or ``wake_s``, or a non-positive ``ttft_slo_s``,
    ``slowdown`` or ``drain_timeout_s``.
    """

    profile: Profile
    autoscaling: AutoscalingSpec
    bounds: ReplicaBounds
    routing_policy: str = "kv-aware"
    max_concurrency_per_endpoint: int | None = None
    max_queue_length: int = DEFAULT_MAX_QUEUE_LENGTH
    queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S
    warm_startup_s: float = DEFAULT_WARM_STARTUP_S
    cold_startup_s: float = DEFAULT_COLD_STARTUP_S
    warm_nodes: int | None = None
    slowdown: float = 1.0
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    drain_timeout_s: float = DRAIN_TIMEOUT_S
    seed: int = 0
    name: str = ""
    model: str = "sim-model"
    routers: int = 1
    shared_view: bool = False
    standby_max: int = 0
    wake_s: float = DEFAULT_WAKE_S
    load_signal: str = "own"
    load_interval_s: float = 0.1
    kv_events: bool = False
    kv_events_delay_s: float = 0.0
    picker: bool = False
    history: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if self.load_signal not in LOAD_SIGNALS:
            raise ValueError(f"load_signal must be one of {', '.join(LOAD_SIGNALS)}, got {self.load_signal!r}")
        if self.kv_events_delay_s < 0:
            raise ValueError(f"kv_events_delay_s must be >= 0, got {self.kv_events_delay_s}")
        if self.load_interval_s < 0 or (self.load_interval_s == 0 and self.load_signal.startswith("engine")):
            raise ValueError(f"load_interval_s must be > 0 for an engine load signal (>= 0 otherwise), "
                             f"got {self.load_interval_s}")
        if self.standby_max < 0 or self.wake_s < 0:
            raise ValueError(f"standby_max and wake_s must be >= 0, got {self.standby_max} and {self.wake_s} s")
        if self.routers < 1:
            raise ValueError(f"routers must be >= 1, got {self.routers}")
        if self.picker and self.max_concurrency_per_endpoint is not None:
            raise ValueError("picker is simulated without max_concurrency_per_endpoint (queued picks are the router's)")
        if self.routers > 1 and self.max_concurrency_per_endpoint is not None:
            raise ValueError("routers > 1 is simulated without max_concurrency_per_endpoint (no shared admission queue)")
        if not 0 <= self.warm_startup_s <= self.cold_startup_s:
            raise ValueError(f"need 0 <= warm start-up <= cold start-up, got {self.warm_startup_s} s and "
                             f"{self.cold_startup_s} s")  # fmt: skip
        if self.warm_nodes is not None and self.warm_nodes < 0:
            raise ValueError(f"warm_nodes must be >= 0, got {self.warm_nodes}")
        if self.ttft_slo_s <= 0 or self.slowdown <= 0 or self.drain_timeout_s <= 0:
            raise ValueError("ttft_slo_s, slowdown and drain_timeout_s must be > 0")

    @property
    def label(self) -> str:
        return self.name or self.autoscaling.policy

    def params(self) -> dict[str, Any]:
        """JSON-ready description of this configuration (for the results file)."""
        return {
            "profile": self.profile.name, "policy": self.autoscaling.policy,
            "autoscaling": self.autoscaling.to_document() if self.autoscaling.policy != "fixed" else None,
            "replicas": {"min": self.bounds.min, "max": self.bounds.max, "initial": self.bounds.initial},
            "routing": {"policy": self.routing_policy, "routers": self.routers, "shared_view": self.shared_view,
                        "load_signal": self.load_signal, "load_interval_s": self.load_interval_s,
                        "kv_events": self.kv_events, "kv_events_delay_s": self.kv_events_delay_s,
                        "picker": self.picker,
                        "max_concurrency_per_endpoint": self.max_concurrency_per_endpoint,
                        "max_queue_length": self.max_queue_length, "queue_timeout_s": self.queue_timeout_s},
            "startup": {"warm_s": self.warm_startup_s, "cold_s": self.cold_startup_s,
                        "warm_nodes": self.node_slots_warm},
            "slowdown": self.slowdown, "ttft_slo_s": self.ttft_slo_s, "drain_timeout_s": self.drain_timeout_s,
            "seed": self.seed, "standby": {"max": self.standby_max, "wake_s": self.wake_s},
            "history_s": -self.history[0][0] if self.history else 0.0,
        }  # fmt: skip

    @property
    def node_slots_warm(self) -> int:
        """Node slots warm at the start: ``warm_nodes``, by default ``bounds.max`` plus
        ``standby_max`` (every replica the deployment may hold at once, the standby pool beside
        the most serving)."""
        return self.bounds.max + self.standby_max if self.warm_nodes is None else self.warm_nodes
