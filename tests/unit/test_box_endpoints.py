"""The cluster in a box's endpoints controller (fleet/testing/k8s/endpoints.py) over the
`ObjectStore`: Ready pods' IPs in ``addresses``, the others in ``notReadyAddresses``, pods without
an IP, terminating or not selected left out, a named targetPort resolved per pod, pods with other
ports in their own subset, written only on change, deleted with the Service; and the reading of
a router pod (fleet/k8s/service_endpoints.py) of what it wrote."""

from __future__ import annotations

from fleet.k8s.client import PODS
from fleet.k8s.service_endpoints import ready_addresses
from fleet.testing.k8s.endpoints import HEADLESS_LABEL, EndpointsController, endpoints_for
from fleet.testing.k8s.resources import ENDPOINTS, SERVICES
from fleet.testing.k8s.store import ObjectStore

NS = "fleet"
PICKER = {"app.kubernetes.io/name": "fleet", "app.kubernetes.io/component": "picker"}


def _service(name: str = "fleet-picker", publish: bool = False) -> dict:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS, "labels": {"a": "b"}},
            "spec": {"clusterIP": "None", "publishNotReadyAddresses": publish, "selector": PICKER,
                     "ports": [{"name": "picker", "port": 8090, "targetPort": "picker", "protocol": "TCP"}]}}  # fmt: skip


def _pod(name: str, ip: str | None, ready: bool, labels: dict = PICKER, picker_port: int | None = 8090) -> dict:
    ports = [{"name": "picker", "containerPort": picker_port}] if picker_port else []
    status: dict = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "namespace": NS, "labels": labels, "uid": f"uid-{name}"},
            "spec": {"nodeName": "cpu-1", "containers": [{"name": "picker", "ports": ports}]}, "status": status}


def test_ready_pods_are_addresses_the_others_not_ready_addresses() -> None:
    pods = [_pod("r1", "10.0.0.2", True), _pod("r2", "10.0.0.1", True), _pod("r3", "10.0.0.3", False),
            _pod("r4", None, True), _pod("other", "10.0.0.9", True, labels={"app": "x"}),
            _pod("r5", "10.0.0.5", True, picker_port=None)]   # no port named picker: left out
    terminating = _pod("r6", "10.0.0.6", True)
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj = endpoints_for(_service(), [*pods, terminating])
    assert obj["metadata"] == {"name": "fleet-picker", "namespace": NS, "labels": {"a": "b", HEADLESS_LABEL: ""}}
    (subset,) = obj["subsets"]
    assert [a["ip"] for a in subset["addresses"]] == ["10.0.0.1", "10.0.0.2"]
    assert [a["ip"] for a in subset["notReadyAddresses"]] == ["10.0.0.3"]
    assert subset["addresses"][0]["targetRef"] == {"kind": "Pod", "namespace": NS, "name": "r2", "uid": "uid-r2"}
    assert subset["ports"] == [{"name": "picker", "port": 8090, "protocol": "TCP"}]
    assert ready_addresses(obj, 8090) == ["10.0.0.1", "10.0.0.2"]
    # publishNotReadyAddresses: every pod with an IP is an address
    (subset,) = endpoints_for(_service(publish=True), pods)["subsets"]
    assert [a["ip"] for a in subset["addresses"]] == ["10.0.0.1", "10.0.0.2", "10.0.0.3"]
    # a pod whose picker port has another number: a subset of its own
    other = endpoints_for(_service(), [pods[0], _pod("r7", "10.0.0.7", True, picker_port=8191)])
    assert [(s["ports"][0]["port"], [a["ip"] for a in s["addresses"]]) for s in other["subsets"]] == [
        (8090, ["10.0.0.2"]), (8191, ["10.0.0.7"])]
    assert "subsets" not in endpoints_for(_service(), [])


def test_the_controller_writes_on_change_and_deletes_with_the_service() -> None:
    store = ObjectStore()
    store.create(SERVICES, NS, _service())
    store.create(SERVICES, NS, {"metadata": {"name": "no-selector"}, "spec": {"ports": [{"port": 1}]}})
    store.create(PODS, NS, _pod("r1", "10.0.0.1", True))
    controller = EndpointsController(store)
    controller.sync()
    assert ready_addresses(store.get(ENDPOINTS, NS, "fleet-picker"), 8090) == ["10.0.0.1"]
    assert (ENDPOINTS.plural, NS, "no-selector") not in store.objects   # selectorless: left to its owner
    controller.sync()
    assert controller.writes == 1   # unchanged: not written again
    store.create(PODS, NS, _pod("r2", "10.0.0.2", False))
    controller.sync()
    obj = store.get(ENDPOINTS, NS, "fleet-picker")
    assert [a["ip"] for a in obj["subsets"][0]["notReadyAddresses"]] == ["10.0.0.2"] and controller.writes == 2
    store.patch_status(PODS, NS, "r2", {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    controller.sync()
    assert ready_addresses(store.get(ENDPOINTS, NS, "fleet-picker"), 8090) == ["10.0.0.1", "10.0.0.2"]
    store.delete(SERVICES, NS, "fleet-picker")
    controller.sync()
    assert (ENDPOINTS.plural, NS, "fleet-picker") not in store.objects
