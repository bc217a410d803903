"""Prometheus service discovery for a local fleet, and the controller's replica-state metrics.

Owns three things, all fed by the controller's JSON snapshot (`fleet.controller.reconcile.Controller.snapshot`,
the same document `state.json` holds) and never by the controller object itself:

- `file_sd_groups` - a pure function from a snapshot to Prometheus file_sd target groups
  (https://prometheus.io/docs/guides/file-sd/): the router, `fleet up`'s own metrics endpoint
  (autoscaler decisions and the replica states below), the node agent's (GPU health and
  quarantine, `fleet.agent.runner`), the endpoint picker's when it runs, and every engine replica
  whose process runs, each labelled with ``job`` (`JOB_ROUTER`, `JOB_CONTROLLER`,
  `JOB_NODE_AGENT`, `JOB_PICKER`, `JOB_ENGINE`) and, for
  engines, ``deployment``, ``version`` (the replica's revision) and ``replica`` (its id, the
  same string as the ``endpoint`` label of the router's per-endpoint series).
- `FileSDWriter` - writes those groups atomically (temp file + rename, as Prometheus asks of
  file_sd writers), and only when they changed.
- `ControllerStateCollector` - a prometheus-client collector exporting the replica states,
  desired/min/max replicas, consecutive failures and the model each deployment serves, from
  the last snapshot it was given (scrapes run on another thread; they read the snapshot, never
  the live controller).

`LocalObservability` bundles the writer and the collector (a failed write of the file is counted
and backed off through `fleet up`'s `fleet.local.failsoft.WriteErrors`, handed in as `WriteAttempts`); `fleet.local.up` builds one and calls
`tick(snapshot)` after each controller tick. `fleet.cli.observability` (`fleet prometheus-config`)
reads the file path from `targets_path`.

Why the router and controller targets carry no ``deployment`` label: one router serves every
deployment and its series say which pool they are about in their own ``model`` label
(the controller's in ``deployment``); a target label would overwrite those (Prometheus renames
the scraped label to ``exported_deployment``). The dashboard maps model to deployment through
``fleet_deployment_info{deployment, model}``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from fleet.controller.lifecycle import ReplicaStatus
from fleet.inventory.mig import mig_gpu_fraction

JOB_ROUTER = "fleet-router"
JOB_ENGINE = "fleet-engine"
JOB_CONTROLLER = "fleet-controller"
JOB_NODE_AGENT = "fleet-node-agent"
JOB_PICKER = "fleet-picker"
"""``job`` label values: the router's series (``fleet_router_*``), the engines' (``vllm:*``; the
engine simulator exports the same names), `fleet up`'s own or the operator's
(``fleet_autoscaler_*``, ``fleet_replicas``, ``fleet_deployment_*``), and the node agent's
(``fleet_gpu_*``, ``fleet_node_agent_*``, ``fleet_weight_cache_*``, each with a ``node`` label),
and the endpoint picker's (``fleet_picker_*``: router/picker/metrics.py).
The Helm chart's ServiceMonitor and PodMonitors set the same values (charts/fleet/templates/
monitoring.yaml), so the shipped dashboard and rules read a cluster as they read `fleet up`."""

SCRAPED_STATUSES = ("STARTING", "WARMING", "READY", "DRAINING")
"""Replica statuses whose engine process runs and serves ``/metrics`` (`fleet.controller.lifecycle`)."""

REPLICA_STATUSES = tuple(s.value for s in ReplicaStatus)
"""Every `fleet.controller.lifecycle.ReplicaStatus` value: `fleet_replicas` exports each (0 included), so a
state that empties shows 0 instead of vanishing."""

log = logging.getLogger(__name__)

TARGETS_FILE = "prometheus-targets.json"
"""Name of the file_sd file in the state directory (`fleet.local.state.StateStore.root`)."""


def targets_path(state_dir: Path) -> Path:
    """Where `fleet up` keeps its file_sd file for the fleet whose state is in ``state_dir``."""
    return Path(state_dir) / TARGETS_FILE


def _host_port(url: str) -> str:
    """``http://127.0.0.1:8080/`` -> ``127.0.0.1:8080`` (a Prometheus target address)."""
    rest = url.split("://", 1)[-1]
    return rest.split("/", 1)[0]


def file_sd_groups(snapshot: Mapping[str, Any], router_url: str | None, controller_url: str | None = None,
                   node_agent_url: str | None = None, picker_url: str | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Prometheus file_sd target groups for one local fleet.

    Args:
        snapshot: `Controller.snapshot()` (or state.json): ``replicas`` is a list of dicts with
            ``id``, ``deployment``, ``revision``, ``status`` and ``endpoint``
            (``http://host:port`` or None).
        router_url: the router's base URL (its ``/metrics`` is scraped), or None.
        controller_url: base URL of `fleet up`'s metrics server, or None when not served.
        node_agent_url: base URL of the node agent's server (`fleet.agent.runner.serve`), or
            None when no agent runs (a machine without NVIDIA GPUs).
        picker_url: base URL of the endpoint picker's HTTP side (`fleet up --picker-port`), or None.

    Returns:
        ``[{"targets": ["host:port"], "labels": {...}}, ...]``, sorted (router, controller, node
        agent, picker, then engines by deployment and replica id), so equal fleets give equal files.
    """
    groups: list[dict[str, Any]] = []
    if router_url:
        groups.append({"targets": [_host_port(router_url)], "labels": {"job": JOB_ROUTER}})
    if controller_url:
        groups.append({"targets": [_host_port(controller_url)], "labels": {"job": JOB_CONTROLLER}})
    if node_agent_url:
        groups.append({"targets": [_host_port(node_agent_url)], "labels": {"job": JOB_NODE_AGENT}})
    if picker_url:
        groups.append({"targets": [_host_port(picker_url)], "labels": {"job": JOB_PICKER}})
    engines = [
        r for r in snapshot.get("replicas", [])
        if r.get("endpoint") and r.get("status") in SCRAPED_STATUSES
    ]
    for r in sorted(engines, key=lambda r: (r["deployment"], r["id"])):
        groups.append({
            "targets": [_host_port(r["endpoint"])],
            "labels": {
                "job": JOB_ENGINE,
                "deployment": r["deployment"],
                "version": str(r.get("revision") or ""),
                "replica": r["id"],
            },
        })
    return groups


class FileSDWriter:
    """Keeps a file_sd file current: `write(groups)` replaces it atomically when it changed."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._last: str | None = None

    def write(self, groups: list[dict[str, Any]]) -> bool:
        """Write ``groups`` as JSON unless identical to the last write; True when written.
        Raises OSError when the directory is not writable."""
        text = json.dumps(groups, indent=1, sort_keys=True) + "\n"
        if text == self._last:
            return False
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)
        self._last = text
        return True


def controller_families(snapshot: Mapping[str, Any]) -> list[Metric]:
    """The controller's metric families for one snapshot (pure).

    `fleet_replicas{deployment,version,state}` - replicas per status (every status, 0 included);
    `fleet_replica_failures_total{deployment,version}` - replicas that failed, the controller's
    own counter per deployment and revision (``failures_total``: kept across a controller
    restart, and counting replicas trimmed from the snapshot's history);
    `fleet_deployment_desired_replicas`, `..._min_replicas`, `..._max_replicas{deployment}`;
    `fleet_deployment_consecutive_failures{deployment}` - failures since the last replica
    became READY (what the restart backoff grows with);
    `fleet_deployment_info{deployment,model}` - 1, to map the router's ``model`` to a deployment.
    """
    replicas = GaugeMetricFamily("fleet_replicas", "Replicas of a deployment version, by lifecycle state "
                                 "(fleet/controller/lifecycle.py).", labels=["deployment", "version", "state"])  # fmt: skip
    failures = CounterMetricFamily("fleet_replica_failures", "Replicas that failed (any FAILED_* state), "
                                   "counted once each.", labels=["deployment", "version"])  # fmt: skip
    desired = GaugeMetricFamily("fleet_deployment_desired_replicas", "Replicas the controller targets.",
                                labels=["deployment"])  # fmt: skip
    minimum = GaugeMetricFamily("fleet_deployment_min_replicas", "spec.replicas.min.", labels=["deployment"])
    maximum = GaugeMetricFamily("fleet_deployment_max_replicas", "spec.replicas.max.", labels=["deployment"])
    in_row = GaugeMetricFamily("fleet_deployment_consecutive_failures",
                               "Replica failures since a replica of the deployment last became READY.",
                               labels=["deployment"])  # fmt: skip
    info = GaugeMetricFamily("fleet_deployment_info", "The model name a deployment serves (value 1).",
                             labels=["deployment", "model"])  # fmt: skip
    counts: dict[tuple[str, str], dict[str, int]] = {}
    for r in snapshot.get("replicas", []):
        key = (r["deployment"], str(r.get("revision") or ""))
        by_state = counts.setdefault(key, dict.fromkeys(REPLICA_STATUSES, 0))
        by_state[r["status"]] = by_state.get(r["status"], 0) + 1
    for name, d in snapshot.get("deployments", {}).items():
        desired.add_metric([name], float(d.get("desired", 0)))
        minimum.add_metric([name], float(d.get("min", 0)))
        maximum.add_metric([name], float(d.get("max", 0)))
        in_row.add_metric([name], float(d.get("failures_in_row", 0)))
        info.add_metric([name, str(d.get("model", ""))], 1.0)
    failed = {(name, str(version)): n for name, d in snapshot.get("deployments", {}).items()
              for version, n in (d.get("failures_total") or {}).items()}
    for (deployment, version), by_state in sorted(counts.items()):
        for state, n in by_state.items():
            replicas.add_metric([deployment, version, state], float(n))
    for (deployment, version) in sorted(set(counts) | set(failed)):
        failures.add_metric([deployment, version], float(failed.get((deployment, version), 0)))
    return [replicas, failures, desired, minimum, maximum, in_row, info]


GPU_STATES = {
    "serving": ("READY", "DRAINING"),
    "starting": ("PLACED", "PULLING", "CACHING", "STARTING", "WARMING"),
    "standby": ("STANDBY",),
}
"""``state`` label of `fleet_gpu_seconds_allocated_total` -> the replica statuses it counts
(`fleet.controller.lifecycle.ReplicaStatus`): every status in which a replica holds its devices.
``standby`` counts a ``STANDBY`` status once the controller has one (asleep, holding its GPUs)."""

_GPU_STATE_OF = {status: state for state, statuses in GPU_STATES.items() for status in statuses}


_MIG_LABEL = re.compile(r"mig:([^@\s]+)@")
"""An assignment's label for a MIG instance, ``mig:3g.40gb@gpu0`` (`fleet.placement.slots.assign`)."""


def _member_gpus(member: Mapping[str, Any]) -> float:
    """GPUs one assignment holds: 1 per whole GPU, a MIG instance as its share of the GPU
    (`fleet.inventory.mig.mig_gpu_fraction` of the profile its label names; 0 when the label
    names none), CPU cores (``cpu:N``) none."""
    gpus = 0.0
    for d in member.get("devices", []):
        d = str(d)
        if d.startswith("cpu:"):
            continue
        if d.startswith("MIG-"):
            match = _MIG_LABEL.match(str(member.get("label", "")))
            try:
                gpus += mig_gpu_fraction(match.group(1)) if match else 0.0
            except ValueError:
                pass
        else:
            gpus += 1
    return gpus


def gpus_held(snapshot: Mapping[str, Any]) -> dict[tuple[str, str, str, str], float]:
    """GPUs held now, by (deployment, revision, product, state) (pure).

    A replica holds the devices of its placement (``placement.members[].devices``,
    `fleet.placement.shapes.ReplicaPlacement.to_dict`) while its status is in `GPU_STATES`.
    Counted: devices of a placement with a ``product`` (for a MIG instance, its parent GPU's):
    a whole GPU as 1, a MIG instance as its profile's compute share of the GPU (``3g.40gb``:
    3/7; `fleet.inventory.mig.mig_gpu_fraction`, NVIDIA's MIG user guide), read from the
    assignment's label (``mig:3g.40gb@gpu0``); CPU cores (``cpu:N``) not at all.
    """
    out: dict[tuple[str, str, str, str], float] = {}
    for r in snapshot.get("replicas", []):
        state = _GPU_STATE_OF.get(r.get("status", ""))
        placement = r.get("placement") or {}
        product = placement.get("product")
        if state is None or not product:
            continue
        gpus = sum(_member_gpus(m) for m in placement.get("members", []))
        if gpus:
            key = (r["deployment"], str(r.get("revision") or ""), str(product), state)
            out[key] = out.get(key, 0) + gpus
    return out


class ControllerStateCollector:
    """prometheus-client collector of `controller_families` over the last snapshot given to
    `update`, and of `fleet_gpu_seconds_allocated_total{deployment,revision,product,state}`:
    GPU-seconds held, integrated over the snapshots' ``clock_s`` (the GPUs each snapshot holds
    count until the next one; a counter from this process's start, as Prometheus counters are).
    ``prices``: USD per GPU-hour by product (`fleet.pricing.GpuPrices.gpu_hour_usd`), exported as
    `fleet_gpu_price_usd_per_hour{product}` for the dashboard's cost row. Thread-safe: `update`
    runs on the controller's loop, `collect` on the scrape thread."""

    def __init__(self, prices: Mapping[str, float] | None = None) -> None:
        self._lock = threading.Lock()
        self._snapshot: Mapping[str, Any] = {}
        self._held: dict[tuple[str, str, str, str], float] = {}
        self._held_since_s: float | None = None
        self._gpu_seconds: dict[tuple[str, str, str, str], float] = {}
        self.prices = dict(prices or {})

    def update(self, snapshot: Mapping[str, Any]) -> None:
        """Take a new snapshot (`fleet.controller.reconcile.Controller.snapshot`)."""
        now_s = snapshot.get("clock_s")
        with self._lock:
            if isinstance(now_s, (int, float)):
                if self._held_since_s is not None and now_s > self._held_since_s:
                    for key, gpus in self._held.items():
                        self._gpu_seconds[key] = self._gpu_seconds.get(key, 0.0) + gpus * (now_s - self._held_since_s)
                self._held_since_s = float(now_s)
            self._held = gpus_held(snapshot)
            for key in self._held:
                self._gpu_seconds.setdefault(key, 0.0)
            self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshot = self._snapshot
            gpu_seconds = dict(self._gpu_seconds)
        yield from controller_families(snapshot)
        allocated = CounterMetricFamily(
            "fleet_gpu_seconds_allocated", "GPU-seconds held by replicas, by state (serving: READY or DRAINING; "
            "starting: placed to warm; standby: asleep). A MIG instance counts as its compute share "
            "of the GPU (3g.40gb: 3/7).",
            labels=["deployment", "revision", "product", "state"])  # fmt: skip
        for key, seconds in sorted(gpu_seconds.items()):
            allocated.add_metric(list(key), seconds)
        yield allocated
        if self.prices:
            price = GaugeMetricFamily("fleet_gpu_price_usd_per_hour", "USD per GPU-hour of a GPU product "
                                      "(fleet up --prices; fleet/pricing.py).", labels=["product"])  # fmt: skip
            for product, usd in sorted(self.prices.items()):
                price.add_metric([product], usd)
            yield price


TARGETS_WRITE = "prometheus_targets"
"""The write target of the file_sd file in `fleet up`'s failed-write counts (`WriteAttempts`)."""


class WriteAttempts(Protocol):
    """Runs a write unless its target is backing off after a failure, counts and logs a failure
    once per try (the tries spaced by a doubling backoff) and says when writing works again:
    `fleet.local.failsoft.WriteErrors`."""

    def attempt(self, target: str, write: Callable[[], object], *, force: bool = False) -> bool: ...


class LocalObservability:
    """What `fleet up` does for Prometheus after each tick: keep the file_sd file current and the
    replica-state metrics fresh. ``write_errors``: where a failed write of the file_sd file is
    counted and backed off (target `TARGETS_WRITE`); None: each failure is logged."""

    def __init__(self, state_dir: Path, router_url: str, controller_url: str | None,
                 registry: CollectorRegistry | None = None, node_agent_url: str | None = None,
                 prices: Mapping[str, float] | None = None,
                 collector: ControllerStateCollector | None = None,
                 write_errors: WriteAttempts | None = None, picker_url: str | None = None) -> None:  # fmt: skip
        self.router_url = router_url
        self.picker_url = picker_url
        self.controller_url = controller_url
        self.node_agent_url = node_agent_url
        self.writer = FileSDWriter(targets_path(state_dir))
        self.write_errors = write_errors
        self.collector = collector or ControllerStateCollector(prices)   # given: registered by its owner
        if registry is not None:
            registry.register(self.collector)  # type: ignore[arg-type]  # duck-typed Collector

    def stopped(self) -> None:
        """The fleet stopped in order (engines and router gone): leave Prometheus no target, so
        nothing reads as down."""
        self._write([], force=True)

    def tick(self, snapshot: Mapping[str, Any]) -> None:
        """Refresh the metrics and the file_sd file from ``snapshot``; a file that cannot be
        written is counted and tried again at a later tick once its backoff is over
        (``write_errors``), never raised into the controller loop."""
        self.collector.update(snapshot)
        self._write(file_sd_groups(snapshot, self.router_url, self.controller_url, self.node_agent_url,
                                   self.picker_url))  # fmt: skip

    def _write(self, groups: list[dict[str, Any]], force: bool = False) -> None:
        if self.write_errors is not None:
            self.write_errors.attempt(TARGETS_WRITE, lambda: self.writer.write(groups), force=force)
            return
        try:
            self.writer.write(groups)
        except OSError as err:
            log.warning("cannot write Prometheus targets %s: %s", self.writer.path, err)
