"""The Pod Security level each of Fleet's pods needs (docs/kubernetes.md, "Pod Security"), checked
on the pods as rendered by `helm template` and as the operator makes them: operator and router
meet ``restricted``; the node agent needs ``privileged`` for its hostPaths alone (its root
``prepare`` container keeps only CHOWN, which ``baseline`` allows); an engine pod needs
``privileged`` with the node weight cache and ``baseline`` without; a pre-pull pod ``baseline``.
The levels' rules: tests/support/pod_security.py."""

from __future__ import annotations

import copy

import pytest

from fleet.k8s.pod_settings import EnginePodSettings
from fleet.k8s.pods import pod_manifest
from fleet.k8s.prepull import pull_pod_manifest
from tests.support.helm import helm_binary, render
from tests.support.pod_security import level, violations
from tests.unit.test_k8s_backend import _dep, _want

IMAGE = "ghcr.io/inference-fleet/fleet:0.1.0"


def test_the_levels_are_not_vacuous():
    root = {"containers": [{"name": "c", "securityContext": {"privileged": True}}]}
    assert level(root) == "privileged"
    assert violations({"containers": [{"name": "c"}]}, "restricted")   # no runAsNonRoot, no seccomp, ...
    assert level({"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}) \
        == "privileged"


@pytest.mark.skipif(helm_binary() is None, reason="helm not installed: run `bash .ci/helm.sh`")
def test_the_charts_pods_need_the_levels_the_docs_state():
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in render()
            if o["kind"] in ("Deployment", "DaemonSet")}  # fmt: skip
    assert level(pods["fleet-operator"]) == "restricted", violations(pods["fleet-operator"], "restricted")
    assert level(pods["fleet-router"]) == "restricted", violations(pods["fleet-router"], "restricted")
    agent = pods["fleet-agent"]
    assert level(agent) == "privileged"
    assert violations(agent, "baseline") == ["hostPath volume 'cache'", "hostPath volume 'pod-resources'"]
    without_host_paths = copy.deepcopy(agent)
    without_host_paths["volumes"] = [v for v in agent["volumes"] if "hostPath" not in v]
    assert level(without_host_paths) == "baseline"   # the root `prepare` (CHOWN) and `pod-devices` containers alone


def test_engine_and_pre_pull_pods_need_the_levels_the_docs_state():
    cached = EnginePodSettings(default_image=IMAGE, weight_cache_path="/var/lib/fleet/cache", fleet_image=IMAGE)
    want = _want(_dep(model={"name": "tiny", "source": "hf://org/tiny@v2"}), node_name="cpu-1")
    spec = pod_manifest(want, fleet_id="f", owner=None, settings=cached)["spec"]
    assert level(spec) == "privileged" and violations(spec, "baseline") == ["hostPath volume 'weight-cache'"]
    spec = pod_manifest(want, fleet_id="f", owner=None, settings=EnginePodSettings(default_image=IMAGE))["spec"]
    assert level(spec) == "baseline"
    path = _want(_dep(model={"name": "tiny", "source": "/models/tiny"}, engine={"kind": "vllm", "image": "vllm:1"}),
                 node_name="cpu-1")  # fmt: skip
    spec = pod_manifest(path, fleet_id="f", owner=None, settings=EnginePodSettings(default_image=IMAGE))["spec"]
    assert level(spec) == "privileged" and violations(spec, "baseline") == ["hostPath volume 'weights'"]
    pull = pull_pod_manifest("cpu-1", IMAGE, fleet_id="f", settings=cached)
    assert level(pull["spec"]) == "baseline"
