"""Unit: `three_way` (tests/support/helm_release.py), the merge Helm's upgrade makes of the
release's manifest, the new manifest and the live object. The real API server's side is
tests/integration/test_helm_upgrade_real.py."""

from __future__ import annotations

from tests.support.helm_release import key, three_way


def test_what_the_new_manifest_drops_is_removed_and_what_no_manifest_sets_stays():
    original = {"spec": {"ports": [{"name": "http", "port": 80}], "selector": {"app": "a"}, "old": 1}}
    target = {"spec": {"ports": [{"name": "http", "port": 8080}], "selector": {"app": "a"}}}
    live = {"metadata": {"resourceVersion": "7"},
            "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP"}], "selector": {"app": "a"}, "old": 1,
                     "clusterIP": "10.96.0.9"}}  # fmt: skip
    assert three_way(original, target, live) == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"ports": [{"name": "http", "port": 8080, "protocol": "TCP"}], "selector": {"app": "a"},
                 "clusterIP": "10.96.0.9"}}  # fmt: skip


def test_drift_on_a_field_the_chart_sets_is_reset_and_named_items_merge_by_name():
    original = {"containers": [{"name": "a", "image": "x:1"}, {"name": "b", "image": "y:1"}], "replicas": 2}
    target = {"containers": [{"name": "a", "image": "x:2"}], "replicas": 2}
    live = {"containers": [{"name": "a", "image": "x:1", "imagePullPolicy": "IfNotPresent"},
                           {"name": "b", "image": "y:1"}, {"name": "sidecar", "image": "s:1"}],
            "replicas": 5}  # fmt: skip
    merged = three_way(original, target, live)
    assert merged["replicas"] == 2   # drifted live: the chart's value again
    assert merged["containers"] == [{"name": "a", "image": "x:2", "imagePullPolicy": "IfNotPresent"},
                                    {"name": "sidecar", "image": "s:1"}]  # b dropped by the chart; sidecar never its


def test_other_lists_are_replaced_whole_and_a_new_object_is_the_target():
    assert three_way({"args": ["--a"]}, {"args": ["--b"]}, {"args": ["--a", "--c"]}) == {"args": ["--b"]}
    assert three_way(None, {"kind": "X", "spec": {"n": 1}}, {"kind": "X", "status": {}}) == {
        "kind": "X", "spec": {"n": 1}, "status": {}}


def test_the_identity_of_an_object_has_no_version():
    pdb = {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "r"}}
    beta = {**pdb, "apiVersion": "policy/v1beta1"}
    assert key(pdb, "ns") == key(beta, "ns") == ("policy", "PodDisruptionBudget", "ns", "r")
