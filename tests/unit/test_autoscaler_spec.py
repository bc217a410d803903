"""spec.autoscaling: defaults, the YAML round trip, and errors that name field and reason
(autoscaler.spec, fleet.spec)."""

from __future__ import annotations

import copy

import pytest
import yaml

from autoscaler.spec import AutoscalingSpec
from fleet.spec import SpecError, dump_deployment, parse_document

BASE = {
    "apiVersion": "fleet.inference.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "chat"},
    "spec": {
        "model": {"name": "tiny", "source": "./models/tiny"},
        "resources": {"accelerator": "cpu"},
        "replicas": {"min": 1, "max": 4},
    },
}


def doc(autoscaling: object, replicas: dict | None = None, routing: dict | None = None) -> dict:
    d = copy.deepcopy(BASE)
    d["spec"]["autoscaling"] = autoscaling
    if replicas is not None:
        d["spec"]["replicas"] = replicas
    if routing is not None:
        d["spec"]["routing"] = routing
    return d


def test_defaults_follow_hpa_and_knative_and_round_trip() -> None:
    dep = parse_document(doc({}))
    a = dep.spec.autoscaling
    assert a is not None
    assert (a.policy, a.queue_time_target_seconds, a.ttft_p99_target_seconds) == ("fleet", 0.5, 2.0)
    assert (a.scale_up_stabilization_seconds, a.scale_down_stabilization_seconds) == (0.0, 300.0)
    assert (a.max_scale_up_rate, a.max_scale_up_step, a.max_scale_down_rate) == (2.0, 4, 2.0)
    assert a.kpa_params.target == pytest.approx(16 * 0.7) and a.kpa_params.panic_window_seconds == 6.0
    assert a.keda_params.target_waiting_per_replica == 5.0
    assert parse_document(BASE).spec.autoscaling is None  # absent: fixed at spec.replicas.initial
    text = dump_deployment(dep)
    assert "queueTimeTargetSeconds: 0.5" in text and "scaleDownStabilizationSeconds: 300.0" in text
    assert parse_document(yaml.safe_load(text)) == dep


def test_routing_admission_queue_fields() -> None:
    dep = parse_document(doc(None, routing={"maxConcurrencyPerEndpoint": 8, "queueTimeoutSeconds": 10}))
    r = dep.spec.routing
    assert (r.max_concurrency_per_endpoint, r.max_queue_length, r.queue_timeout_seconds) == (8, 1000, 10.0)
    assert parse_document(BASE).spec.routing.max_concurrency_per_endpoint is None


@pytest.mark.parametrize(
    "autoscaling, replicas, expected",
    [
        ({"policy": "hpa"}, None, "spec.autoscaling.policy: unknown autoscaling policy 'hpa'; known: fixed, fleet, keda-queue, kpa"),
        ({"queueTimeTargetSeconds": 0}, None, "spec.autoscaling.queueTimeTargetSeconds: Input should be greater than 0"),
        ({"queueTimeTargetSeconds": 3, "ttftP99TargetSeconds": 2}, None,
         "spec.autoscaling.queueTimeTargetSeconds: must be < ttftP99TargetSeconds (3 >= 2): queue time is part of"),
        ({"coldStartupSeconds": 10, "warmStartupSeconds": 60}, None,
         "spec.autoscaling.coldStartupSeconds: must be >= warmStartupSeconds (10 < 60)"),
        ({"intervalSeconds": 60, "windowSeconds": 30}, None, "spec.autoscaling.intervalSeconds: must be <= windowSeconds"),
        ({"scaleDownBelowFraction": 1.0}, None, "spec.autoscaling.scaleDownBelowFraction: Input should be less than 1"),
        ({"maxScaleDownRate": 1}, None, "spec.autoscaling.maxScaleDownRate: Input should be greater than 1"),
        ({"scaleDownStabilizationSeconds": 7200}, None, "spec.autoscaling.scaleDownStabilizationSeconds: Input should be less than or equal to 3600"),
        ({"kpa": {"targetConcurrencyPerReplica": 8}}, None, "spec.autoscaling.kpa: applies to policy kpa only (policy is fleet)"),
        ({"policy": "kpa", "kpa": {"stableWindowSeconds": 2}}, None, "spec.autoscaling.kpa.stableWindowSeconds: Input should be greater than or equal to 6"),
        ({"policy": "keda-queue", "kedaQueue": {"targetWaiting": 5}}, None, "spec.autoscaling.kedaQueue.targetWaiting: unknown field"),
        ({"targetQueueTime": 1}, None, "spec.autoscaling.targetQueueTime: unknown field"),
        ({}, {"min": 2, "max": 2}, "spec.replicas.max: must be > spec.replicas.min to autoscale (both 2)"),
        ("yes", None, "spec.autoscaling: Input should be a valid dictionary"),
    ],
)
def test_bad_autoscaling_names_field_and_reason(autoscaling: object, replicas: dict | None, expected: str) -> None:
    with pytest.raises(SpecError) as exc:
        parse_document(doc(autoscaling, replicas))
    assert any(p.startswith(expected) for p in exc.value.problems), exc.value.problems


def test_fixed_policy_may_have_equal_bounds_and_baseline_blocks_are_accepted() -> None:
    assert parse_document(doc({"policy": "fixed"}, {"min": 2, "max": 2})).spec.autoscaling.policy == "fixed"
    a = AutoscalingSpec.model_validate({"policy": "kpa", "kpa": {"targetConcurrencyPerReplica": 8}})
    assert a.kpa_params.target == pytest.approx(8 * 0.7)
