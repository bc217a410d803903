"""Prometheus export of canary rollouts, read from the controller at scrape time.

Owns `RolloutCollector`, a custom collector over `fleet.controller.reconcile.Controller`'s revisions
(`fleet.rollout.revisions.Revisions`). `fleet up` registers it on the registry it serves at
`http://HOST:METRICS_PORT/metrics` (beside the autoscaler's series).

Series (label ``deployment``):
`fleet_rollout_weight_percent{revision,role}` (share of new requests per revision, role stable,
canary or old), `fleet_rollout_replicas{revision,role,status}` (READY or other live replicas),
`fleet_rollout_phase{phase}` (1 for the current rollout's phase: Progressing, Paused, Promoted,
RolledBack), `fleet_rollout_step` (index of the current step), `fleet_rollout_analysis_runs_total
{verdict}` (runs of the current rollout by verdict), and of the last analysis run, per check
(``metric``, ``kind`` relative or absolute): `fleet_rollout_check_value{side}` (canary or stable;
seconds, a fraction for errorRate), `fleet_rollout_check_limit`, `fleet_rollout_check_samples
{side}` and `fleet_rollout_check_passed` (1 pass, 0 fail, NaN inconclusive or error).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from fleet.rollout.machine import RolloutPhase


def _nan(v: float | None) -> float:
    return math.nan if v is None else float(v)


class RolloutCollector(Collector):
    """Reads ``controller`` (anything with `deployments` and `rollout_status`) at each scrape."""

    def __init__(self, controller) -> None:
        self.controller = controller

    def collect(self) -> Iterator[Metric]:
        d = ["deployment"]
        weight = GaugeMetricFamily("fleet_rollout_weight_percent", "Share of new requests per revision, percent.",
                                   labels=[*d, "revision", "role"])  # fmt: skip
        replicas = GaugeMetricFamily("fleet_rollout_replicas", "Live replicas per revision (READY or not).",
                                     labels=[*d, "revision", "role", "status"])  # fmt: skip
        phase = GaugeMetricFamily("fleet_rollout_phase", "1 for the current rollout's phase.", labels=[*d, "phase"])
        step = GaugeMetricFamily("fleet_rollout_step", "Index of the current rollout step.", labels=d)
        runs = CounterMetricFamily("fleet_rollout_analysis_runs", "Analysis runs of the current rollout by verdict.",
                                   labels=[*d, "verdict"])  # fmt: skip
        value = GaugeMetricFamily("fleet_rollout_check_value", "Last analysis run: a check's value (seconds or "
                                  "fraction).", labels=[*d, "metric", "kind", "side"])  # fmt: skip
        limit = GaugeMetricFamily("fleet_rollout_check_limit", "Last analysis run: a check's limit on the canary.",
                                  labels=[*d, "metric", "kind"])  # fmt: skip
        samples = GaugeMetricFamily("fleet_rollout_check_samples", "Last analysis run: samples a check rests on.",
                                    labels=[*d, "metric", "kind", "side"])  # fmt: skip
        passed = GaugeMetricFamily("fleet_rollout_check_passed", "Last analysis run: 1 pass, 0 fail, NaN otherwise.",
                                   labels=[*d, "metric", "kind"])  # fmt: skip
        for name in list(self.controller.deployments):
            status = self.controller.rollout_status(name)
            for r in status["revisions"]:
                weight.add_metric([name, r["label"], r["role"]], r["weight"])
                replicas.add_metric([name, r["label"], r["role"], "READY"], r["ready"])
                replicas.add_metric([name, r["label"], r["role"], "other"], r["replicas"] - r["ready"])
            ro = status["rollout"]
            if not ro:
                continue
            for p in RolloutPhase:
                phase.add_metric([name, p.value], 1.0 if ro["phase"] == p.value else 0.0)
            step.add_metric([name], ro["step_index"])
            counts = {"pass": ro["passes"], "fail": ro["failures"], "error": ro["errors"],
                      "inconclusive": ro.get("inconclusive", 0)}  # fmt: skip
            for verdict, n in counts.items():
                runs.add_metric([name, verdict], n)
            if ro["runs"]:
                for c in ro["runs"][-1]["checks"]:
                    key = [name, c["metric"], c["kind"]]
                    value.add_metric([*key, "canary"], _nan(c["canary"]))
                    value.add_metric([*key, "stable"], _nan(c["stable"]))
                    limit.add_metric(key, _nan(c["limit"]))
                    samples.add_metric([*key, "canary"], c["canary_samples"])
                    samples.add_metric([*key, "stable"], c["stable_samples"])
                    passed.add_metric(key, {"pass": 1.0, "fail": 0.0}.get(c["verdict"], math.nan))
        yield from (weight, replicas, phase, step, runs, value, limit, samples, passed)
