"""One assembly of the control plane: the controller, the autoscaler loop beside it and the
control-plane metrics, built from explicit inputs.

Owns `ControlPlane` (the inputs a runtime hands over, and the two things built from them:
`ControlPlane.controller`, a `fleet.controller.reconcile.Controller` with its collaborators, the
launcher, drainer, pool publisher, preemptor, standby keeper (`fleet.controller.standby`) and
rollout driver (`fleet.controller.rollouts`), which the controller builds from the same inputs;
`ControlPlane.autoscaler`, a `fleet.controller.autoscaling.AutoscalerLoop` over that controller)
and `ControlPlaneMetrics` (one Prometheus registry: the autoscaler's `fleet_autoscaler_*` and the
replica states `fleet_replicas`, `fleet_deployment_*`, `fleet_gpu_seconds_allocated_total`).

Called by both runtimes, which keep what differs between them: `fleet.local.up` (`fleet up`:
the local backend, the router process and its supervision, the control channel, the autoscaler
run as a task, the metrics served by prometheus_client and the file_sd file) and
`fleet.k8s.operator` (`fleet operator`: the Kubernetes backend, leader election and fenced
writes, the router pods' fan-out, the autoscaler stepped in its tick and rebuilt when the
declared deployments change, the metrics on its own /metrics while it leads). Builds only: it
starts nothing and does no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import ScalingDecision
from fleet.controller.arrival_history import ArrivalHistoryStore
from fleet.controller.autoscaling import AutoscalerLoop, RouterStatsSource
from fleet.controller.backend import Backend
from fleet.controller.pools import PoolSink
from fleet.controller.reconcile import Controller, ControllerSettings, ReplicaEvent, StateSink
from fleet.observability.discovery import ControllerStateCollector
from fleet.rollout.revisions import AnalysisSource
from fleet.spec import LoadedDeployment
from warmup.client import EngineAPI


class ControlPlaneMetrics:
    """The control plane's series on one registry (``registry``, never the global one):
    ``autoscaler`` (`autoscaler.metrics.AutoscalerMetrics`, set by the autoscaler loop at each
    decision) and ``controller_state`` (`fleet.observability.discovery.ControllerStateCollector`,
    fed a controller snapshot by `update`). ``prices``: USD per GPU-hour by GPU product
    (`fleet.pricing.GpuPrices.gpu_hour_usd`), exported as ``fleet_gpu_price_usd_per_hour``."""

    def __init__(self, prices: Mapping[str, float] | None = None) -> None:
        self.autoscaler = AutoscalerMetrics()
        self.registry = self.autoscaler.registry
        self.controller_state = ControllerStateCollector(prices)
        self.registry.register(self.controller_state)  # type: ignore[arg-type]  # duck-typed Collector

    def update(self, snapshot: Mapping[str, Any]) -> None:
        """Take a new controller snapshot (`fleet.controller.reconcile.Controller.snapshot`)."""
        self.controller_state.update(snapshot)


@dataclass
class ControlPlane:
    """What a runtime hands the assembly, and the controller and autoscaler built from it.

    ``backend`` runs replicas (`fleet.controller.backend.Backend`); ``engine_api`` is HTTP to the
    engines; ``pool_sink`` the router admin API the pools are published to; ``analysis_source``
    the router's per-revision samples for canary analysis (None: no analysis);
    ``stats_source`` the router's windowed statistics for the autoscaler (None: no autoscaler);
    ``state_sink`` where the controller persists its snapshot (None: nowhere); ``clock`` the
    controller's seconds (monotonic across controller restarts on one machine), ``wall_clock``
    Unix seconds (the arrival history's saved times); ``history`` where the policies' arrival
    history is kept (None: memory only); the callbacks are handed each replica transition
    (``on_event``), each rollout line (``on_rollout_event(deployment, line)``) and each scaling
    decision (``on_decision(deployment, decision)``). ``settings`` is read each time a
    controller is built."""

    backend: Backend
    engine_api: EngineAPI
    pool_sink: PoolSink
    clock: Callable[[], float]
    analysis_source: AnalysisSource | None = None
    stats_source: RouterStatsSource | None = None
    state_sink: StateSink | None = None
    settings: ControllerSettings | None = None
    history: ArrivalHistoryStore | None = None
    wall_clock: Callable[[], float] = time.time
    metrics: ControlPlaneMetrics = field(default_factory=ControlPlaneMetrics)
    on_event: Callable[[ReplicaEvent], None] | None = None
    on_rollout_event: Callable[[str, str], None] | None = None
    on_decision: Callable[[str, ScalingDecision], None] | None = None

    def controller(self, deployments: list[LoadedDeployment]) -> Controller:
        """A controller of ``deployments`` over these inputs, not started yet (the caller awaits
        `Controller.start` with the snapshot it takes over from, or None)."""
        return Controller(deployments, backend=self.backend, engine_api=self.engine_api, pool_sink=self.pool_sink,
                          clock=self.clock, state_sink=self.state_sink, settings=self.settings,
                          on_event=self.on_event, analysis_source=self.analysis_source,
                          on_rollout_event=self.on_rollout_event)  # fmt: skip

    def autoscaler(self, controller: Controller, replacing: AutoscalerLoop | None = None,
                   changed: frozenset[str] | set[str] = frozenset()) -> AutoscalerLoop | None:  # fmt: skip
        """The autoscaler loop over ``controller``'s deployments, exporting to ``metrics``; None
        when none of them has ``spec.autoscaling`` or there is no ``stats_source``. ``replacing``:
        the loop it takes the place of, whose state carries over for the deployments ``changed``
        does not name (`AutoscalerLoop.carry_over`)."""
        if self.stats_source is None or not any(ds.loaded.deployment.spec.autoscaling is not None
                                                for ds in controller.deployments.values()):  # fmt: skip
            return None
        loop = AutoscalerLoop(controller, router=self.stats_source, engine_api=self.engine_api, clock=self.clock,
                              metrics=self.metrics.autoscaler, on_decision=self.on_decision, history=self.history,
                              wall_clock=self.wall_clock)  # fmt: skip
        if replacing is not None:
            loop.carry_over(replacing, set(changed))
        return loop
