"""Fleet's scaling policy and the baselines on one workload, in the same simulator.

Owns `contender_names`, `config_from_deployment` (a deployment spec -> the `SimConfig` of its
own policy), `contender` (that config with another policy: a baseline with its published
defaults, or a fixed fleet sized for the peak or the mean), `Comparison` (the rows and what
they were run on) and `run_comparison` (every contender, serially or in worker processes).
Called by `fleet simulate`; the rows are drawn by `fleet.tracesim.plot`. Pure except for the
worker processes and the wall-time measurement of each run (reported, never used to decide).

Every contender gets the same workload, profile, routing, start-up model, replica bounds and
SLO; only the scaling policy differs. Names:

- ``fleet``, ``standby``, ``keda-queue``, ``kpa``: that policy. If the deployment's own
  ``spec.autoscaling.policy`` is this one, its spec is used as written; otherwise the policy's
  defaults (docs/autoscaling.md, "Baselines"). ``keda-queue`` also gets
  ``maxScaleDownRate: 1000``: the HPA that KEDA drives may remove every surplus pod in one
  15 s period by default (scaleDown policy 100 %, kubernetes.io "Horizontal Pod Autoscaling"),
  which Fleet's default of halving would not let it do.
- ``standby-forecast``: `standby` scaling ahead on a forecast of the arrival rate
  (``spec.forecast``: the deployment's block, else `autoscaler.spec.ForecastSpec`'s defaults).
- ``fixed-peak``, ``fixed-mean``: a fixed fleet of ceil(rate / one replica's capacity)
  replicas, the rate being the busiest minute's or the mean's
  (`fleet.tracesim.workload.FleetSizing`); ``fixed-N``: N replicas; ``fixed``: the
  deployment's ``spec.replicas.initial``. Fixed fleets ignore ``spec.replicas.max`` and keep no
  standby replicas (``SimConfig.standby_max`` 0); every other contender gets the same standby
  allowance (`fleet.tracesim.engine`: a policy without a standby target keeps the maximum).
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Any

from autoscaler.policy import ReplicaBounds
from autoscaler.spec import AutoscalingSpec, ForecastSpec
from fleet.enginesim.profiles import Profile, get_profile
from fleet.tracesim.config import SimConfig
from fleet.tracesim.engine import Simulation
from fleet.tracesim.results import SimResult
from fleet.tracesim.workload import FleetSizing, Workload
from fleet.spec import InferenceDeployment

COMPARE = ("fleet", "fixed-peak", "fixed-mean", "keda-queue", "kpa")
"""The contenders of ``fleet simulate --compare``, in table order."""

SCALING_POLICIES = ("fleet", "standby", "keda-queue", "kpa")

STANDBY_FORECAST = "standby-forecast"
"""Contender: `standby` with ``spec.forecast`` (the deployment's own block if it has one, else the
defaults of `autoscaler.spec.ForecastSpec`)."""

KEDA_MAX_SCALE_DOWN_RATE = 1000.0
"""`keda-queue`'s maxScaleDownRate: HPA's default scale-down policy removes up to 100 % of the
pods per period, i.e. no rate limit (module docstring)."""

Progress = Callable[[int, float, int, int], None]
"""``progress(index, now_s, done, total)``: contender ``index`` reached virtual second
``now_s`` with ``done`` of ``total`` requests finished."""


def contender_names() -> str:
    """The accepted contender names, for help texts and errors."""
    return ", ".join([*SCALING_POLICIES, STANDBY_FORECAST, "fixed", "fixed-peak", "fixed-mean", "fixed-N"])


def profile_of(deployment: InferenceDeployment, override: str | None = None) -> Profile:
    """The engine-simulator profile a deployment's replicas stand for: ``override`` if given,
    else the profile its ``spec.model.source`` names (``sim://<profile>``).

    Raises ValueError (naming the field) when neither names one, KeyError (listing the known
    profiles) for an unknown name."""
    if override is not None:
        return get_profile(override)
    source = deployment.spec.model.source
    if source.startswith("sim://"):
        return get_profile(source.removeprefix("sim://"))
    raise ValueError(f"spec.model.source {source!r} is not a simulator profile (sim://<profile>); "
                     "name one with --profile")  # fmt: skip


def config_from_deployment(deployment: InferenceDeployment, profile: Profile, **overrides: Any) -> SimConfig:
    """The `SimConfig` of ``deployment`` as written: its autoscaling spec (``fixed`` at
    ``spec.replicas.initial`` when it has none), replica bounds, routing and standby pool
    (``spec.standby.maxReplicas``). ``overrides``
    replace `SimConfig` fields (start-up times, warm nodes, SLO, slowdown, seed, routing)."""
    spec = deployment.spec
    autoscaling = spec.autoscaling or AutoscalingSpec(policy="fixed")
    r = spec.replicas
    fields: dict[str, Any] = {
        "profile": profile, "autoscaling": autoscaling, "bounds": ReplicaBounds(r.min, r.max, r.desired_at_start),
        "routing_policy": spec.routing.policy, "max_concurrency_per_endpoint": spec.routing.max_concurrency_per_endpoint,
        "max_queue_length": spec.routing.max_queue_length, "queue_timeout_s": spec.routing.queue_timeout_seconds,
        "model": spec.model.name, "standby_max": spec.standby_max,
    }  # fmt: skip
    return SimConfig(**{**fields, **overrides})


def contender(base: SimConfig, name: str, sizing: FleetSizing | None = None) -> SimConfig:
    """``base`` with the scaling policy ``name`` (module docstring), labelled with it.

    Raises ValueError for an unknown name, or for ``fixed-peak`` / ``fixed-mean`` without
    ``sizing``."""
    if name == STANDBY_FORECAST:
        own = base.autoscaling if base.autoscaling.policy == "standby" else AutoscalingSpec(policy="standby")
        spec = own if own.forecast is not None else own.model_copy(update={"forecast": ForecastSpec()})
        return replace(base, autoscaling=spec, name=name)
    if name in SCALING_POLICIES:
        if base.autoscaling.policy == name:
            spec = base.autoscaling
        elif name == "keda-queue":
            spec = AutoscalingSpec(policy=name, max_scale_down_rate=KEDA_MAX_SCALE_DOWN_RATE)
        else:
            spec = AutoscalingSpec(policy=name)
        return replace(base, autoscaling=spec, name=name)
    fixed = AutoscalingSpec(policy="fixed")
    if name == "fixed":
        n = base.bounds.initial
    elif name in ("fixed-peak", "fixed-mean"):
        if sizing is None:
            raise ValueError(f"{name} needs the workload's sizing")
        n = sizing.peak if name == "fixed-peak" else sizing.mean
        name = f"{name} ({n})"
    elif name.startswith("fixed-") and name[6:].isdigit() and int(name[6:]) >= 1:
        n = int(name[6:])
    else:
        raise ValueError(f"unknown contender {name!r}; known: {contender_names()}")
    return replace(base, autoscaling=fixed, bounds=ReplicaBounds(n, n, n), name=name, standby_max=0)


@dataclass
class Comparison:
    """Contenders run on one workload: ``workload`` (`Workload.describe`), one replica's
    ``capacity_per_s`` (requests/s at saturation on the workload's mix) and the ``sizing``
    derived from it, one `SimResult` per contender in order (``wall_s`` set), and the
    ``hindsight`` yardsticks (`fleet.tracesim.hindsight.yardsticks`) when they were solved."""

    workload: dict[str, Any]
    capacity_per_s: float
    sizing: FleetSizing
    results: list[SimResult] = field(default_factory=list)
    hindsight: dict[str, Any] | None = None   # `fleet.tracesim.hindsight.Yardsticks.to_dict`, when solved

    def to_dict(self, timeline_bin_s: float = 60.0) -> dict[str, Any]:
        """JSON-ready: the workload, the sizing, and each contender's `SimResult.to_dict`."""
        return {
            "simulator": "Fleet trace simulator (fleet simulate): engines are fleet.enginesim latency models, not vLLM",
            "workload": self.workload,
            "capacity_per_replica_per_s": self.capacity_per_s,
            "sizing": {"peak": self.sizing.peak, "mean": self.sizing.mean,
                       "peak_rate_per_s": self.sizing.peak_rate_per_s, "mean_rate_per_s": self.sizing.mean_rate_per_s},
            "results": [r.to_dict(timeline_bin_s) for r in self.results],
            "hindsight": self.hindsight,
        }  # fmt: skip


def run_one(config: SimConfig, workload: Workload,
            progress: Callable[[float, int, int], None] | None = None) -> SimResult:  # fmt: skip
    """Simulate one contender; the result carries the real seconds it took (``wall_s``)."""
    started = time.perf_counter()
    result = Simulation(config, workload, progress=progress).run()
    result.wall_s = time.perf_counter() - started
    return result


def run_comparison(configs: Sequence[SimConfig], workload: Workload, *, jobs: int = 1,
                   progress: Progress | None = None) -> list[SimResult]:  # fmt: skip
    """Run every config on ``workload``; results in the configs' order.

    ``jobs > 1`` runs them in that many worker processes (each run is deterministic, so the
    results are the same as a serial run's); ``progress`` is called in this process either way.
    """
    if jobs <= 1 or len(configs) <= 1:
        out = []
        for index, config in enumerate(configs):
            report = None if progress is None else (lambda now_s, done, total, i=index: progress(i, now_s, done, total))
            out.append(run_one(config, workload, report))
        return out
    ctx = multiprocessing.get_context()
    updates = ctx.Queue()
    with ProcessPoolExecutor(min(jobs, len(configs)), mp_context=ctx, initializer=_init_worker,
                             initargs=(updates,)) as pool:  # fmt: skip
        futures: dict[Future[SimResult], int] = {
            pool.submit(_run_in_worker, index, config, workload): index for index, config in enumerate(configs)
        }
        results: dict[int, SimResult] = {}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _drain(updates, progress)
            for future in done:
                results[futures[future]] = future.result()
        _drain(updates, progress)
    return [results[i] for i in range(len(configs))]


_updates: Any = None


def _init_worker(updates: Any) -> None:
    global _updates
    _updates = updates


def _run_in_worker(index: int, config: SimConfig, workload: Workload) -> SimResult:
    return run_one(config, workload, lambda now_s, done, total: _updates.put((index, now_s, done, total)))


def _drain(updates: Any, progress: Progress | None) -> None:
    while True:
        try:
            update = updates.get_nowait()
        except queue.Empty:
            return
        if progress is not None:
            progress(*update)
