"""The Helm chart (charts/fleet) without a cluster: `helm lint --strict`, `helm template` under
four values files validated with kubernetes-validate (strict) for Kubernetes 1.30 and 1.37, the
values schema refusing bad values, least-privilege RBAC, the Prometheus objects gated on their
API, the same manifests on every render (GitOps: no random admin token), and a golden snapshot
of the rendered defaults.

Helm comes from `.ci/helm.sh` (tests/run.sh runs it); without it these tests are skipped. Reading the
example values files without Helm: tests/unit/test_k8s_chart.py."""

from __future__ import annotations

import os
import subprocess

import kubernetes_validate
import pytest

from fleet.k8s.crd import crd_document
from tests.support.helm import CHART, REPO, helm, helm_binary, render, render_text
from tests.unit.test_k8s_chart import VALUES  # the subject's helpers live in its unit file

pytestmark = pytest.mark.skipif(helm_binary() is None, reason="helm not installed: run `bash .ci/helm.sh`")

MONITORING_API = ("monitoring.coreos.com/v1",)
GOLDEN = REPO / "tests" / "data" / "golden" / "chart-defaults.yaml"


def _by_kind(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


@pytest.mark.parametrize("name", list(VALUES))
def test_helm_lint_strict(name):
    args = ["lint", "--strict", str(CHART)]
    for v in VALUES[name]:
        args += ["-f", str(v)]
    assert "0 chart(s) failed" in helm(*args).stdout


@pytest.mark.parametrize("kube", ["1.30.0", "1.37.0"])
@pytest.mark.parametrize("name", list(VALUES))
def test_rendered_manifests_validate_strictly(name, kube):
    objs = render(VALUES[name], kube_version=kube, api_versions=MONITORING_API)
    assert objs
    checked = 0
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue   # custom resources: kubernetes-validate has no schema for them (checked below)
        kubernetes_validate.validate(obj, kube, strict=True)   # raises ValidationError
        checked += 1
    assert checked >= 10


def test_validation_catches_a_broken_manifest():
    """The check above is not vacuous: a misspelt field fails it."""
    dep = _by_kind(render())["Deployment"][0]
    dep["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, "1.37.0", strict=True)


def test_defaults_render_the_expected_objects():
    kinds = _by_kind(render())
    assert {k: len(v) for k, v in kinds.items()} == {   # the node agent's DaemonSet, account and role too
        "CustomResourceDefinition": 1, "ServiceAccount": 3, "Role": 2, "RoleBinding": 2, "ClusterRole": 2,
        "ClusterRoleBinding": 2, "Deployment": 3, "DaemonSet": 1, "Service": 4, "PodDisruptionBudget": 1,
    }
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-router")
    assert router["spec"]["replicas"] == 2
    # the chart ships the CRD the generator makes (plus Helm's labels and the keep annotation)
    crd = kinds["CustomResourceDefinition"][0]
    assert crd["spec"] == crd_document()["spec"]
    assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_admin_api_never_on_the_public_service():
    kinds = _by_kind(render(VALUES["ha"]))
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: (p["containerPort"], p["protocol"]) for p in container["ports"]}
    assert ports == {"http": (8080, "TCP"), "admin": (9090, "TCP")}
    assert "--admin-port=9090" in container["args"] and container["args"][0] == "router-pod"
    for svc in kinds["Service"]:
        assert all(p["targetPort"] != "admin" and p["port"] != 9090 for p in svc["spec"]["ports"]), svc
    policy = next(p for p in kinds["NetworkPolicy"] if p["metadata"]["name"] == "fleet-router")
    assert [r["ports"] for r in policy["spec"]["ingress"]] == [[{"port": 8080, "protocol": "TCP"}],
                                                               [{"port": 9090, "protocol": "TCP"}]]  # fmt: skip
    admin_rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 9090)
    assert admin_rule["from"] == [{"podSelector": {"matchLabels": {   # the operator alone
        "app.kubernetes.io/name": "fleet", "app.kubernetes.io/instance": "fleet",
        "app.kubernetes.io/component": "operator"}}}]
    # the admin token comes from the Secret: the router's through secretKeyRef, the operator's
    # through the API (test_the_operator_owns_the_admin_token_secret)
    env = {e["name"]: e for e in container["env"]}
    assert env["FLEET_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "fleet-router-admin", "key": "token"}


def test_rbac_is_least_privilege():
    kinds = _by_kind(render())
    cluster_rules = {r["metadata"]["name"]: r["rules"] for r in kinds["ClusterRole"]}
    assert cluster_rules == {   # the operator reads nodes; the node agent patches its own (any: RBAC cannot say which)
        "fleet-fleet-nodes": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}],
        "fleet-fleet-agent": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},   # and gets
                              {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]}   # its GPU pods' uids
    roles = {r["metadata"]["name"]: r for r in kinds["Role"]}
    # the router pods: get on the picker Service's Endpoints (by name), nothing else (router-rbac.yaml)
    assert roles["fleet-router"]["rules"] == [{"apiGroups": [""], "resources": ["endpoints"],
                                               "resourceNames": ["fleet-picker"], "verbs": ["get"]}]  # fmt: skip
    role = roles["fleet-operator"]
    assert role["metadata"]["namespace"] == "fleet"
    resources = {r for rule in role["rules"] for r in rule["resources"]}
    assert resources == {"inferencedeployments", "inferencedeployments/status", "inferencedeployments/finalizers",
                         "pods", "pods/log", "events", "leases", "secrets", "serviceaccounts", "configmaps"}
    # Secrets: get only the admin token's (by name), create (RBAC cannot name what is created);
    # never list, watch, update or delete any
    assert [r for r in role["rules"] if r["resources"] == ["secrets"]] == [
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["fleet-router-admin"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    # ConfigMaps: get and update only the autoscaler's arrival history (by name), create; never list or delete
    assert [r for r in role["rules"] if r["resources"] == ["configmaps"]] == [
        {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": ["fleet-operator-arrival-history"],
         "verbs": ["get", "update"]},
        {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]}]
    # its own ServiceAccount, read once to own the Secret and ConfigMap it makes (uninstall then deletes them)
    assert [r for r in role["rules"] if r["resources"] == ["serviceaccounts"]] == [
        {"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": ["fleet-operator"], "verbs": ["get"]}]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        if rule["resources"] == ["inferencedeployments"]:
            assert rule["verbs"] == ["get", "list", "watch", "patch"]   # patch: its finalizer; never create/delete
        if rule["resources"] == ["pods"]:
            assert "update" not in rule["verbs"] and "deletecollection" not in rule["verbs"]


def test_monitoring_objects_need_their_api():
    without = _by_kind(render(VALUES["monitoring"]))
    assert not {"ServiceMonitor", "PodMonitor", "PrometheusRule"} & set(without)
    kinds = _by_kind(render(VALUES["monitoring"], api_versions=MONITORING_API))
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= set(kinds)
    pm = kinds["PodMonitor"][0]
    assert pm["spec"]["selector"] == {"matchLabels": {"app.kubernetes.io/managed-by": "fleet-operator"}}
    # the generated rules (fleet/observability/rules.py); tests/integration/test_chart_monitoring.py checks them whole
    alerts = {r["alert"] for g in kinds["PrometheusRule"][0]["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {"FleetDeploymentBelowDesired", "FleetOperatorDown", "FleetTTFTBudgetBurnFast"} <= alerts


def test_global_registry_extra_objects_and_engine_pod_settings():
    kinds = _by_kind(render(VALUES["gpu-mig"]))
    images = [c["image"] for d in kinds["Deployment"] for c in d["spec"]["template"]["spec"]["containers"]]
    assert images and all(i == "registry.example.com/inference-fleet/fleet:0.1.0" for i in images)
    quota = kinds["ResourceQuota"][0]
    assert quota["metadata"]["namespace"] == "fleet"   # extraObjects are templated
    op = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-operator")
    env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    import json
    engine = json.loads(env["FLEET_ENGINE_POD_JSON"])
    assert engine["runtimeClassName"] == "nvidia" and engine["migStrategy"] == "mixed"
    assert engine["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert engine["imagePullSecrets"] == [{"name": "registry-credentials"}]


@pytest.mark.parametrize("bad,field", [
    (["--set", "router.service.type=Ingress"], "type"),
    (["--set", "image.pullPolicy=Sometimes"], "pullPolicy"),
    (["--set", "engine.migStrategy=half"], "migStrategy"),
    (["--set", "operator.replicaz=2"], "replicaz"),
    (["--set", "router.port=0"], "port"),
    (["--set", "router.adminToken.existingSecret=Not_A_Name"], "existingSecret"),
    (["--set", "router.adminToken.existingSecretKey=a/b"], "existingSecretKey"),
    (["--set", "router.picker.enabled=sometimes"], "enabled"),
    (["--set", "router.peers.enabled=true"], "peers"),
    (["--set", "agent.nodeselector.a=b"], "nodeselector"),
    (["--set", "agent.runtimeClassName=NVIDIA_runtime"], "runtimeClassName"),
])


def test_values_schema_refuses_bad_values(bad, field):
    binary = helm_binary()
    proc = subprocess.run([binary, "template", "fleet", str(CHART), *bad], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert field in proc.stderr, proc.stderr


def _router_args(*extra: str) -> tuple[list[str], dict[str, dict]]:
    """(router args, router env by name) of a render."""
    kinds = _by_kind(render(extra=extra))
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-router")
    container = router["spec"]["template"]["spec"]["containers"][0]
    return container["args"], {e["name"]: e for e in container["env"]}


def _router_pod_spec(*extra: str) -> dict:
    kinds = _by_kind(render(extra=extra))
    return next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-router")["spec"]["template"]["spec"]


def test_routers_find_the_picker_through_its_services_endpoints():
    """By default (the picker on, whatever router.replicas) each router pod reads the Endpoints of
    the picker Service through the API, with a token of its own service account, and connects to
    their ready address (fleet/k8s/service_endpoints.py, router.picker.client); no DNS name, no
    virtual IP. Without the picker: no API token at all."""
    for replicas in ("1", "2"):
        args, env = _router_args("--set", f"router.replicas={replicas}")
        assert args[:4] == ["router-pod", "--host=0.0.0.0", "--port=8080", "--admin-port=9090"]
        assert [a for a in args if a.startswith("--picker")] == ["--picker-endpoints=fleet-picker:8090"]
        assert set(env) == {"FLEET_ROUTER_ADMIN_TOKEN", "HF_HOME"}
        spec = _router_pod_spec("--set", f"router.replicas={replicas}")
        assert spec["serviceAccountName"] == "fleet-router" and spec["automountServiceAccountToken"] is True
    args, _ = _router_args("--set", "router.picker.enabled=false")
    assert not any(a.startswith("--picker") for a in args)
    spec = _router_pod_spec("--set", "router.picker.enabled=false")
    assert "serviceAccountName" not in spec and spec["automountServiceAccountToken"] is False
    kinds = _by_kind(render(extra=("--set", "router.picker.enabled=false")))
    assert not any(r["metadata"]["name"] == "fleet-router" for r in kinds.get("Role", []))


def _router_deployment(*extra: str) -> dict:
    return next(d for d in _by_kind(render(extra=extra))["Deployment"] if d["metadata"]["name"] == "fleet-router")


def test_a_rolling_restart_of_the_routers_refuses_no_one():
    """One new router pod before an old one goes, Ready only once it has every pool; the old one
    keeps accepting through its preStop sleep while its endpoint leaves the Service, then drains
    its requests in flight (--drain-timeout-s) and is killed only after that bound."""
    router = _router_deployment()
    assert router["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}  # fmt: skip
    spec = router["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["lifecycle"] == {"preStop": {"exec": {"command": ["sleep", "5"]}}}
    assert spec["terminationGracePeriodSeconds"] == 45 and "--drain-timeout-s=35" in container["args"]
    spec = _router_deployment("--set", "router.terminationGracePeriodSeconds=20",
                              "--set", "router.preStopSleepSeconds=3")["spec"]["template"]["spec"]  # fmt: skip
    container = spec["containers"][0]
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "3"]
    assert spec["terminationGracePeriodSeconds"] == 20 and "--drain-timeout-s=12" in container["args"]
    for bad, field in ((("--set", "router.preStopSleepSeconds=-1"), "preStopSleepSeconds"),
                       (("--set", "router.terminationGracePeriodSeconds=5"), "terminationGracePeriodSeconds")):
        proc = subprocess.run([helm_binary(), "template", "fleet", str(CHART), *bad], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert proc.returncode != 0 and field in proc.stderr, proc.stderr


def test_values_schema_passes_through_kubernetes_fields():
    objs = render(extra=("--set", "router.resources.limits.nvidia\\.com/gpu=0",
                         "--set", "operator.affinity.nodeAffinity.anything=1"))
    assert objs


@pytest.mark.parametrize("name", list(VALUES))
def test_every_render_gives_the_same_manifests(name):
    """GitOps (Argo CD, Flux) renders with `helm template` on every sync: nothing random, nothing
    read from a cluster (the admin token Secret is the operator's: fleet/k8s/admin_token.py)."""
    first = render_text(VALUES[name])
    assert render_text(VALUES[name]) == first
    assert "kind: Secret" not in first


def test_the_operator_owns_the_admin_token_secret():
    kinds = _by_kind(render())
    op = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-operator")
    env = {e["name"]: e for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert "FLEET_ROUTER_ADMIN_TOKEN" not in env   # the explicit override stays unset: the Secret is read
    assert {k: env[k]["value"] for k in env if k.startswith("FLEET_ROUTER_ADMIN_SECRET")} == {
        "FLEET_ROUTER_ADMIN_SECRET": "fleet-router-admin", "FLEET_ROUTER_ADMIN_SECRET_KEY": "token",
        "FLEET_ROUTER_ADMIN_SECRET_CREATE": "true"}


def test_an_existing_secret_is_read_never_made():
    extra = ("--set", "router.adminToken.existingSecret=my-admin", "--set", "router.adminToken.existingSecretKey=admin")
    args = ["lint", "--strict", str(CHART), *extra]
    assert "0 chart(s) failed" in helm(*args).stdout
    objs = render(extra=extra)
    for obj in objs:
        for kube in ("1.30.0", "1.37.0"):
            kubernetes_validate.validate(obj, kube, strict=True)
    kinds = _by_kind(objs)
    assert "Secret" not in kinds
    deps = {d["metadata"]["name"]: d["spec"]["template"]["spec"]["containers"][0] for d in kinds["Deployment"]}
    router_env = {e["name"]: e for e in deps["fleet-router"]["env"]}
    assert router_env["FLEET_ROUTER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "my-admin", "key": "admin"}
    op_env = {e["name"]: e.get("value") for e in deps["fleet-operator"]["env"]}
    assert (op_env["FLEET_ROUTER_ADMIN_SECRET"], op_env["FLEET_ROUTER_ADMIN_SECRET_KEY"],
            op_env["FLEET_ROUTER_ADMIN_SECRET_CREATE"]) == ("my-admin", "admin", "false")  # fmt: skip
    secret_rules = [r for r in kinds["Role"][0]["rules"] if r["resources"] == ["secrets"]]
    assert secret_rules == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["my-admin"], "verbs": ["get"]}]


def test_golden_snapshot_of_the_defaults():
    text = render_text()
    if os.environ.get("FLEET_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), "no golden file: run with FLEET_UPDATE_GOLDEN=1 once and review it"
    assert text == GOLDEN.read_text(), (
        "the rendered defaults changed: review `helm template fleet charts/fleet -n fleet --kube-version 1.30.0` "
        "and update tests/data/golden/chart-defaults.yaml with FLEET_UPDATE_GOLDEN=1"
    )


def test_dockerfile_matches_the_chart_and_the_packages():
    """The image runs as the user the chart's securityContext names and carries every package
    pyproject ships (the operator, the router and the simulator run from it)."""
    import tomllib

    text = (REPO / "charts" / "fleet" / "Dockerfile").read_text()
    kinds = _by_kind(render())
    users = {d["spec"]["template"]["spec"]["securityContext"]["runAsUser"] for d in kinds["Deployment"]}
    assert users == {10001} and "USER 10001" in text
    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    for pkg in packages:
        assert f"COPY {pkg.rstrip('*')} ./{pkg.rstrip('*')}" in text, pkg
    assert 'ENTRYPOINT ["fleet"]' in text
    router = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-router")
    assert router["spec"]["template"]["spec"]["containers"][0]["args"][0] == "router-pod"   # a `fleet` command


def test_the_agent_annotates_its_node_with_least_privilege_and_pre_pull_settings_reach_the_operator():
    objs = render(extra=("--set", "agent.enabled=true", "--set", "engine.prePull.attempts=5"))
    for obj in objs:
        if obj["kind"] in ("DaemonSet", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"):
            for kube in ("1.30.0", "1.37.0"):
                kubernetes_validate.validate(obj, kube, strict=True)
    kinds = _by_kind(objs)
    ds = kinds["DaemonSet"][0]["spec"]["template"]["spec"]
    container = ds["containers"][0]
    assert container["args"][0] == "node-agent"
    assert {"--root=/var/lib/fleet/cache", "--annotate-node", "--node-name=$(NODE_NAME)", "--host=$(POD_IP)",
            "--state-dir=/var/lib/fleet/cache/.agent",
            "--pod-devices-file=/run/fleet/pod-devices/pod-devices.json"} <= set(container["args"])
    env = {e["name"]: e.get("value") or e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP", "NVIDIA_VISIBLE_DEVICES": "all",
                   "NVIDIA_DRIVER_CAPABILITIES": "utility"}
    # It can start: the image's user, a read-only root, the hostPath handed over by `prepare`.
    assert container["securityContext"] == {
        "runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    [prepare] = ds["initContainers"]
    assert prepare["name"] == "prepare" and prepare["image"] == container["image"]
    assert prepare["command"] == ["sh", "-c", "mkdir -p /var/lib/fleet/cache && chown 10001:10001 /var/lib/fleet/cache"
                                  " && if [ -d /var/lib/fleet/cache/.agent ]; then chown 10001:10001 "
                                  "/var/lib/fleet/cache/.agent; fi"]  # fmt: skip
    assert prepare["securityContext"]["runAsUser"] == 0   # fsGroup does not apply to a hostPath
    assert prepare["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
    assert "runtimeClassName" not in ds   # the node's default runtime (the GPU Operator's: NVIDIA's)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert set(mounts) == {"cache", "tmp", "pod-devices"} and mounts["pod-devices"]["readOnly"] is True
    volumes = {v["name"]: v for v in ds["volumes"]}
    assert "emptyDir" in volumes[mounts["tmp"]["name"]]   # the only writable place beside the cache
    # The kubelet's PodResources socket is root's: a root container with no capability asks it and
    # hands the answer over; it mounts nothing else.
    relay = ds["containers"][1]
    assert relay["name"] == "pod-devices" and relay["image"] == container["image"]
    assert relay["args"] == ["pod-devices", "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
                             "--out=/run/fleet/pod-devices/pod-devices.json", "--interval-s=10"]
    assert relay["securityContext"] == {
        "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False, "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in relay["volumeMounts"]} == {
        "pod-resources": ("/var/lib/kubelet/pod-resources", True), "pod-devices": ("/run/fleet/pod-devices", False)}
    assert volumes["pod-resources"]["hostPath"] == {"path": "/var/lib/kubelet/pod-resources",
                                                    "type": "DirectoryOrCreate"}
    assert volumes["pod-devices"]["emptyDir"]["medium"] == "Memory"
    assert ds["serviceAccountName"] == "fleet-agent" and ds["automountServiceAccountToken"] is True
    agent_role = next(r for r in kinds["ClusterRole"] if r["metadata"]["name"].endswith("-agent"))
    assert agent_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                                   {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]
    binding = next(b for b in kinds["ClusterRoleBinding"] if b["metadata"]["name"].endswith("-agent"))
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "fleet-agent", "namespace": "fleet"}]
    op = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-operator")
    env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    import json

    assert json.loads(env["FLEET_ENGINE_POD_JSON"])["prePull"] == {
        "enabled": True, "timeoutSeconds": 1800, "initialBackoffSeconds": 10, "maxBackoffSeconds": 600, "attempts": 5}
    # without the annotation the agent gets no API token and no role
    kinds = _by_kind(render(extra=("--set", "agent.enabled=true", "--set", "agent.annotateNode=false")))
    assert kinds["DaemonSet"][0]["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    assert "--annotate-node" not in kinds["DaemonSet"][0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert [c["name"] for c in kinds["DaemonSet"][0]["spec"]["template"]["spec"]["containers"]] == ["agent"]
    assert {v["name"] for v in kinds["DaemonSet"][0]["spec"]["template"]["spec"]["volumes"]} == {"cache", "tmp"}
    assert len(kinds["ClusterRole"]) == 1
    # a runtime class only where the values ask for one
    kinds = _by_kind(render(extra=("--set", "agent.runtimeClassName=nvidia")))
    assert kinds["DaemonSet"][0]["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


def test_the_node_agent_runs_on_gpu_nodes_by_default_tolerating_their_taint(tmp_path):
    """A first install: the agent's DaemonSet is rendered without asking, selects GPU Feature
    Discovery's GPU nodes, tolerates the GPU taint, names no RuntimeClass; engine pods tolerate
    the taint too (else the operator counts no tainted GPU node usable); the cache hostPath is
    made when missing. values-gpu-mig.yaml turns the agent on with the nvidia RuntimeClass; one
    values line runs it on every node."""
    import json

    def agent_pod(objs: list[dict]) -> dict:
        [ds] = _by_kind(objs)["DaemonSet"]
        return ds["spec"]["template"]["spec"]

    objs = render()
    for obj in objs:
        if obj["kind"] == "DaemonSet":
            for kube in ("1.30.0", "1.37.0"):
                kubernetes_validate.validate(obj, kube, strict=True)
    pod = agent_pod(objs)
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [GPU_TOLERATION]
    assert "runtimeClassName" not in pod and "affinity" not in pod
    assert {v["name"]: v["hostPath"]["type"] for v in pod["volumes"] if "hostPath" in v} == {
        "cache": "DirectoryOrCreate", "pod-resources": "DirectoryOrCreate"}
    op = next(d for d in _by_kind(objs)["Deployment"] if d["metadata"]["name"] == "fleet-operator")
    env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
    engine = json.loads(env["FLEET_ENGINE_POD_JSON"])
    assert engine["tolerations"] == [GPU_TOLERATION] and engine["weightCache"]["hostPath"] == "/var/lib/fleet/cache"

    pod = agent_pod(render(VALUES["gpu-mig"]))
    assert pod["runtimeClassName"] == "nvidia" and pod["tolerations"] == [GPU_TOLERATION]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}

    # every node, as values.yaml says: `{}` would merge with the default selector; null removes it
    every = tmp_path / "every-node.yaml"
    every.write_text("agent: {nodeSelector: null, tolerations: [{operator: Exists}]}\n")
    pod = agent_pod(render([every]))
    assert "nodeSelector" not in pod and pod["tolerations"] == [{"operator": "Exists"}]
    merged = tmp_path / "empty-selector.yaml"
    merged.write_text("agent: {nodeSelector: {}}\n")
    assert agent_pod(render([merged]))["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    affinity = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "nvidia.com/gpu.present", "operator": "In", "values": ["true"]}]}]}}}
    pinned = tmp_path / "affinity.yaml"
    pinned.write_text(json.dumps({"agent": {"nodeSelector": None, "affinity": affinity}}))
    pod = agent_pod(render([pinned]))
    assert pod["affinity"] == affinity and "nodeSelector" not in pod
    assert "DaemonSet" not in _by_kind(render(extra=("--set", "agent.enabled=false")))


def test_prices_reach_the_operator_as_the_files_json_and_the_schema_wants_their_source(tmp_path):
    """The chart's prices: value (examples/kubernetes/values-monitoring.yaml) becomes the operator's
    FLEET_PRICES_JSON, which `fleet operator` reads with fleet.pricing (fleet_gpu_price_usd_per_hour);
    none by default."""
    import json

    from fleet.pricing import prices_from_json

    def operator_env(objs: list[dict]) -> dict:
        op = next(d for d in _by_kind(objs)["Deployment"] if d["metadata"]["name"] == "fleet-operator")
        return {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}

    assert "FLEET_PRICES_JSON" not in operator_env(render())
    env = operator_env(render(VALUES["monitoring"]))
    prices = prices_from_json(env["FLEET_PRICES_JSON"])
    assert prices.gpu_hour_usd["NVIDIA H100 80GB HBM3"] == 4.916 and prices.source.startswith("AWS EC2")
    for bad, field in [({"gpuHourUsd": {"NVIDIA H100 80GB HBM3": 4.9}}, "/prices/source"),
                       ({"source": "s", "gpuHourUsd": {"NVIDIA H100 80GB HBM3": -1}}, "/prices/gpuHourUsd")]:
        values = tmp_path / "prices.yaml"
        values.write_text(json.dumps({"prices": bad}))
        proc = subprocess.run([helm_binary(), "template", "fleet", str(CHART), "-f", str(values)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode != 0 and field in proc.stderr, proc.stderr


def test_values_schema_refuses_bad_pre_pull_settings():
    proc = subprocess.run([helm_binary(), "template", "fleet", str(CHART), "--set", "engine.prePull.attempts=0"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "attempts" in proc.stderr, proc.stderr


def test_engine_pods_get_the_node_cache_fleets_image_and_resource_sizing():
    """FLEET_ENGINE_POD_JSON as rendered reads back as the operator's settings: the weight cache
    is the agent's hostCachePath (none without the agent), the init container runs Fleet's image."""
    import json

    from fleet.k8s.pod_settings import EnginePodSettings

    def settings(*extra):
        op = next(d for d in _by_kind(render(extra=extra))["Deployment"] if d["metadata"]["name"] == "fleet-operator")
        env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
        return EnginePodSettings.from_json(env["FLEET_ENGINE_POD_JSON"])

    on = settings("--set", "agent.enabled=true", "--set", "engine.resources.guaranteed=true")
    assert on.weight_cache_path == "/var/lib/fleet/cache" and on.fleet_image.endswith("/fleet:0.1.0")
    assert on.resources.guaranteed and on.resources.cpu_per_gpu == 2
    assert settings().weight_cache_path == "/var/lib/fleet/cache"   # the agent is on by default
    assert settings("--set", "agent.enabled=false").weight_cache_path == ""
    assert json.loads(json.dumps(settings("--set", "engine.resources.swapSpaceGiB=8").resources.swap_space_gib)) == 8


def test_engine_pods_publish_kv_events_on_the_charts_ports():
    """engine.kvEvents as rendered reaches the operator: every engine pod binds its KV event PUB
    and replay sockets on the declared ports and the pool gets the pod IP's addresses; the switch
    and the ports are the chart's, and the schema refuses a port the engine's HTTP server holds."""
    import json

    from fleet.k8s.pod_facts import pod_facts
    from fleet.k8s.pod_settings import EnginePodSettings
    from fleet.k8s.pods import pod_manifest
    from tests.unit.test_k8s_backend import _dep, _want

    def settings(*extra):
        op = next(d for d in _by_kind(render(extra=extra))["Deployment"] if d["metadata"]["name"] == "fleet-operator")
        env = {e["name"]: e.get("value") for e in op["spec"]["template"]["spec"]["containers"][0]["env"]}
        return EnginePodSettings.from_json(env["FLEET_ENGINE_POD_JSON"], default_image="fleet:1")

    pod = pod_manifest(_want(_dep()), fleet_id="f", owner=None, settings=settings())
    engine = pod["spec"]["containers"][0]
    config = json.loads(engine["command"][engine["command"].index("--kv-events-config") + 1])
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")
    assert {(p["name"], p["containerPort"]) for p in engine["ports"]} == {("http", 8000), ("kv-events", 5557),
                                                                          ("kv-replay", 5558)}
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.9",
                     "containerStatuses": [{"name": "engine", "imageID": "x", "state": {"running": {}}}]}
    assert pod_facts(pod).kv_events == {"publisher": "tcp://10.0.0.9:5557", "replay": "tcp://10.0.0.9:5558",
                                        "topic": ""}
    off = pod_manifest(_want(_dep()), fleet_id="f", owner=None, settings=settings("--set", "engine.kvEvents.enabled=false"))
    assert "--kv-events-config" not in off["spec"]["containers"][0]["command"]
    assert settings("--set", "engine.kvEvents.port=6000").kv_events_port == 6000
    proc = subprocess.run([helm_binary(), "template", "fleet", str(CHART), "--set", "engine.kvEvents.port=8000"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode != 0 and "port" in proc.stderr, proc.stderr


def test_values_schema_refuses_bad_engine_resources():
    for bad, field in ((("--set", "engine.resources.cpuPerGPU=1"), "cpuPerGPU"),
                       (("--set", "engine.resources.baseMemoryGiB=-1"), "baseMemoryGiB")):  # fmt: skip
        proc = subprocess.run([helm_binary(), "template", "fleet", str(CHART), *bad], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert proc.returncode != 0 and field in proc.stderr, proc.stderr


NEWEST_KUBE = kubernetes_validate.latest_version()   # the newest schemas kubernetes-validate bundles


def test_chart_renders_the_apis_of_the_oldest_and_newest_supported_kubernetes():
    """The chart's stated range (Chart.yaml ``kubeVersion``) starts at 1.20: rendered for 1.20.2,
    the router's PodDisruptionBudget is policy/v1beta1 (1.20 has no policy/v1; the real 1.20 API
    server takes every object: tests/integration/test_real_control_plane.py); rendered for the
    newest Kubernetes kubernetes-validate knows, it is policy/v1 (v1beta1 is gone since 1.25) and
    every object validates strictly. The same holds for every example values file."""
    for name, files in VALUES.items():
        old = {d["kind"]: d for d in render(files, kube_version="1.20.2")}
        new = render(files, kube_version=NEWEST_KUBE)
        assert old["PodDisruptionBudget"]["apiVersion"] == "policy/v1beta1", name
        assert {d["kind"]: d for d in new}["PodDisruptionBudget"]["apiVersion"] == "policy/v1", name
        for obj in new:
            kubernetes_validate.validate(obj, NEWEST_KUBE, strict=True)   # raises ValidationError
    # a cluster older than the range is refused by Helm itself, naming the range
    proc = subprocess.run([helm_binary(), "template", "fleet", str(CHART), "--kube-version", "1.19.16"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0 and ">=1.20.0-0" in proc.stderr, proc.stderr


def test_the_endpoint_picker_is_on_by_default_and_every_router_asks_it():
    """router.picker.enabled (the default): a Deployment of one `fleet endpoint-picker` pod and its
    Service; every router pod gets --picker-endpoints; engines admit the picker (KV events), the
    picker admits the routers (docs/routing.md, "Endpoint picker"). Off: no picker objects."""
    kinds = _by_kind(render(extra=("--set", "router.picker.enabled=false")))
    assert not any(d["metadata"]["name"] == "fleet-picker" for d in kinds["Deployment"] + kinds["Service"])
    on = ("--set", "networkPolicy.enabled=true",)
    kinds = _by_kind(render(extra=on))
    picker = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-picker")
    assert picker["spec"]["replicas"] == 1 and picker["spec"]["strategy"] == {"type": "Recreate"}
    container = picker["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][:3] == ["endpoint-picker", "--host=0.0.0.0", "--port=8090"]
    service = next(s for s in kinds["Service"] if s["metadata"]["name"] == "fleet-picker")
    assert service["spec"]["ports"] == [{"name": "picker", "port": 8090, "targetPort": "picker", "protocol": "TCP"}]
    args, _ = _router_args(*on)
    assert "--picker-endpoints=fleet-picker:8090" in args
    policies = {p["metadata"]["name"]: p for p in kinds["NetworkPolicy"]}
    engine_from = policies["fleet-engines"]["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fleet", "app.kubernetes.io/instance": "fleet",
                                            "app.kubernetes.io/component": "picker"}}} in engine_from
    picker_in = policies["fleet-picker"]["spec"]["ingress"][0]
    assert picker_in["ports"] == [{"port": 8090, "protocol": "TCP"}]
    assert picker_in["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "router"


def test_the_picker_in_ha_runs_two_replicas_on_a_lease_and_only_the_leader_is_ready():
    """router.picker.ha: two `fleet endpoint-picker --lease` pods with client-go's timings, a
    readiness probe on /ready (200 only while holding the Lease, so the Service's Endpoints hold
    the leader alone), a rollout that does not wait for a standby to be Ready, a service account
    allowed get/update on its one Lease and create on leases; a PodMonitor scrapes every picker
    pod (job fleet-picker) and the NetworkPolicy admits Prometheus to its metrics port."""
    on = ("--set", "router.picker.enabled=true", "--set", "router.picker.ha.enabled=true",
          "--set", "networkPolicy.enabled=true", "--set", "monitoring.podMonitor.enabled=true")  # fmt: skip
    kinds = _by_kind(render(api_versions=MONITORING_API, extra=on))
    picker = next(d for d in kinds["Deployment"] if d["metadata"]["name"] == "fleet-picker")
    spec = picker["spec"]
    assert spec["replicas"] == 2
    assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": "100%"}}
    pod = spec["template"]["spec"]
    assert pod["serviceAccountName"] == "fleet-picker" and pod["automountServiceAccountToken"] is True
    container = pod["containers"][0]
    for arg in ("--metrics-port=9091", "--lease=fleet-picker", "--identity=$(POD_NAME)", "--namespace=$(POD_NAMESPACE)",
                "--lease-duration-s=15", "--renew-deadline-s=10", "--retry-period-s=2"):  # fmt: skip
        assert arg in container["args"], arg
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "metrics"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    role = next(r for r in kinds["Role"] if r["metadata"]["name"] == "fleet-picker")
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["fleet-picker"],
         "verbs": ["get", "update"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]}]  # fmt: skip
    binding = next(b for b in kinds["RoleBinding"] if b["metadata"]["name"] == "fleet-picker")
    assert binding["subjects"][0]["name"] == "fleet-picker"
    monitor = next(m for m in kinds["PodMonitor"] if m["metadata"]["name"] == "fleet-picker")
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    assert monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["replacement"] == "fleet-picker"
    policy = next(p for p in kinds["NetworkPolicy"] if p["metadata"]["name"] == "fleet-picker")
    assert policy["spec"]["ingress"][1]["ports"] == [{"port": 9091, "protocol": "TCP"}]
    # without HA: one pod, no service account, no Lease
    kinds = _by_kind(render(extra=("--set", "router.picker.enabled=true")))
    assert not any(r["metadata"]["name"] == "fleet-picker" for r in kinds.get("Role", []))
