"""`spec.rollout`: defaults, YAML round trip, and every malformed section rejected naming its field."""

from __future__ import annotations

import copy

import pytest
import yaml

from fleet.spec import SpecError, dump_deployment, parse_document
from fleet.rollout.spec import MetricCheck, RolloutSpec

BASE = {
    "apiVersion": "fleet.inference.dev/v1alpha1",
    "kind": "InferenceDeployment",
    "metadata": {"name": "chat"},
    "spec": {"model": {"name": "tiny", "source": "./models/tiny"}, "resources": {"accelerator": "cpu"}},
}

CANARY = {
    "strategy": "canary",
    "steps": [{"weight": 5}, {"pauseSeconds": 120}, {"analysis": {"passes": 2}}, {"weight": 50}],
    "analysis": {
        "intervalSeconds": 30, "minSamplesPerSide": 100,
        "metrics": [{"metric": "ttftP99", "maxRatioToStable": 1.2}, {"metric": "tpotP99", "maxRatioToStable": 1.1},
                    {"metric": "errorRate", "maxIncreaseOverStable": 0.005},
                    {"metric": "queueTimeP99", "maxRatioToStable": 1.5, "maxIncreaseOverStable": 0.25},
                    {"metric": "ttftP99", "max": 2.0}],
        "failureLimit": 0, "inconclusiveLimit": 5,
    },
    "stickiness": {"header": "x-session-id"},
}


def doc(rollout):
    d = copy.deepcopy(BASE)
    d["spec"]["rollout"] = rollout
    return d


def problems(rollout) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_document(doc(rollout))
    return info.value.problems


def test_absent_rollout_means_replace_with_default_analysis():
    dep = parse_document(BASE)
    assert dep.spec.rollout.strategy == "replace" and dep.spec.rollout.steps == []
    assert [m.metric for m in dep.spec.rollout.analysis.metrics] == ["ttftP99", "tpotP99", "tpotP50", "errorRate"]


def test_canary_section_round_trips_through_yaml():
    dep = parse_document(doc(CANARY))
    r = dep.spec.rollout
    assert [s.kind for s in r.steps] == ["weight", "pause", "analysis", "weight"]
    assert r.steps[2].analysis.passes == 2 and r.analysis.inconclusive_limit == 5
    assert r.stickiness.header == "x-session-id"
    text = dump_deployment(dep)
    again = parse_document(yaml.safe_load(text))
    assert again == dep and dump_deployment(again) == text


def test_relative_limit_takes_the_more_lenient_of_ratio_and_increase():
    check = MetricCheck(metric="queueTimeP99", max_ratio_to_stable=1.5, max_increase_over_stable=0.25)
    assert check.relative_limit(0.0) == 0.25      # the increase is a floor for tiny stable values
    assert check.relative_limit(2.0) == 3.0
    assert MetricCheck(metric="errorRate", max_increase_over_stable=0.005).relative_limit(0.01) == pytest.approx(0.015)


@pytest.mark.parametrize("rollout, expected", [
    ({"strategy": "canary"}, "spec.rollout.steps: required with strategy: canary"),
    ({"strategy": "replace", "steps": [{"weight": 5}]}, "spec.rollout.steps: only with strategy: canary"),
    ({"strategy": "blue-green"}, "spec.rollout.strategy: Input should be 'replace' or 'canary'"),
    ({"strategy": "canary", "steps": [{"weight": 100}]}, "spec.rollout.steps[0].weight: Input should be less than 100"),
    ({"strategy": "canary", "steps": [{"weight": 0}]}, "spec.rollout.steps[0].weight: Input should be greater than 0"),
    ({"strategy": "canary", "steps": [{"weight": 5, "pauseSeconds": 3}]},
     "spec.rollout.steps[0]: a step has exactly one of weight, pauseSeconds, analysis"),
    ({"strategy": "canary", "steps": [{}]}, "spec.rollout.steps[0]: a step has exactly one of"),
    ({"strategy": "canary", "steps": [{"pauseSeconds": 10}]},
     "spec.rollout.steps: the first step must set a weight"),
    ({"strategy": "canary", "steps": [{"weight": 5}, {"pauseSeconds": -1}]},
     "spec.rollout.steps[1].pauseSeconds: Input should be greater than 0"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "analysis": {"metrics": [{"metric": "ttftP99"}]}},
     "spec.rollout.analysis.metrics[0].metric: ttftP99: set maxRatioToStable, maxIncreaseOverStable and/or max"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "analysis": {"metrics": [{"metric": "p99", "max": 1}]}},
     "spec.rollout.analysis.metrics[0].metric: Input should be"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "analysis": {"metrics": [{"metric": "errorRate", "max": 5}]}},
     "spec.rollout.analysis.metrics[0].max: errorRate is a fraction"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "analysis": {"metrics": []}},
     "spec.rollout.analysis.metrics: List should have at least 1 item"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "analysis": {"minSamplesPerSide": 0}},
     "spec.rollout.analysis.minSamplesPerSide: Input should be greater than or equal to 1"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "analysis": {"intervalSeconds": 0}},
     "spec.rollout.analysis.intervalSeconds: Input should be greater than 0"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "stickiness": {}},
     "spec.rollout.stickiness.header: set exactly one of header and requestField"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "stickiness": {"requestField": "messages"}},
     "spec.rollout.stickiness.requestField: Input should be 'user'"),
    ({"strategy": "canary", "steps": [{"weight": 5}], "stickiness": {"header": "x session"}},
     "spec.rollout.stickiness.header: String should match pattern"),
    ({"strategy": "canary", "steps": [{"weight": 5, "wieght": 6}]}, "spec.rollout.steps[0].wieght: unknown field"),
])
def test_bad_rollout_sections_name_the_field(rollout, expected):
    found = problems(rollout)
    assert any(p.startswith(expected) for p in found), found


def test_the_rollout_section_does_not_change_what_a_replica_serves(tmp_path):
    from fleet.spec import LoadedDeployment

    a = LoadedDeployment(parse_document(BASE), tmp_path / "d.yaml", 0)
    b = LoadedDeployment(parse_document(doc(CANARY)), tmp_path / "d.yaml", 0)
    assert a.serving_hash == b.serving_hash
    assert RolloutSpec().strategy == "replace"
