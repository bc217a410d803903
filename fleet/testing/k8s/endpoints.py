"""The endpoints controller of the cluster in a box: every Service with a selector gets an
Endpoints object of the same name listing its pods. A TEST STAND-IN for kube-controller-manager's
endpoints controller (pkg/controller/endpoint/endpoints_controller.go, `syncService`), as much of
it as the chart's Services need. Started by `fleet.testing.k8s.box.ClusterInABox`.

`EndpointsController.sync()` (called every ``period_s`` by `run`), per Service with a
``spec.selector``, over the pods of its namespace matching it that have a ``status.podIP`` and
no ``deletionTimestamp``:
- each pod's ports: the Service's ports, ``targetPort`` resolved against the pod's container
  ports (a number as is; a name by the container port of that name, the Service port skipped for
  a pod without it; unset: the Service's ``port``), named and protocolled as the Service port;
- the pod's address (``ip``, ``nodeName``, ``targetRef`` without the pod's resourceVersion, so
  a pod's status heartbeat does not rewrite the object) goes to ``addresses`` when its Ready
  condition is True (or the Service has ``publishNotReadyAddresses``), else to
  ``notReadyAddresses``;
- pods with the same ports share one subset (the real controller's ``RepackSubsets``), addresses
  sorted by IP.
The Endpoints object carries the Service's labels (plus ``service.kubernetes.io/headless`` for a
headless Service, as the real controller adds) and is written only when it changed; the Endpoints
of a Service that is gone are deleted.
"""

from __future__ import annotations

import asyncio

from fleet.k8s.client import PODS, ApiError
from fleet.testing.k8s.resources import ENDPOINTS, SERVICES
from fleet.testing.k8s.store import ObjectStore, parse_selector, selector_matches
from fleet.testing.k8s.workloads import sync_every

HEADLESS_LABEL = "service.kubernetes.io/headless"


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])  # fmt: skip


def _pod_ports(service: dict, pod: dict) -> tuple[tuple[str, int, str], ...]:
    """(name, port, protocol) of each Service port this pod serves, targetPort resolved."""
    declared = {p["name"]: p["containerPort"] for c in pod["spec"].get("containers") or []
                for p in c.get("ports") or [] if p.get("name")}  # fmt: skip
    out = []
    for sp in service["spec"].get("ports") or []:
        target = sp.get("targetPort", sp["port"])
        if isinstance(target, str) and not target.isdigit():
            if target not in declared:
                continue   # the real controller logs "Failed to find port" and leaves the port out for this pod
            target = declared[target]
        out.append((sp.get("name", ""), int(target), sp.get("protocol", "TCP")))
    return tuple(out)


def endpoints_for(service: dict, pods: list[dict]) -> dict:
    """The Endpoints object the endpoints controller writes for ``service`` over ``pods`` (those of
    its namespace; filtered here by its selector). Pure."""
    meta = service["metadata"]
    selector = ",".join(f"{k}={v}" for k, v in sorted(service["spec"]["selector"].items()))
    reqs = parse_selector(selector)
    publish_all = bool(service["spec"].get("publishNotReadyAddresses"))
    subsets: dict[tuple, dict[str, list]] = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip or pod["metadata"].get("deletionTimestamp"):
            continue
        if not selector_matches(reqs, pod["metadata"].get("labels") or {}):
            continue
        ports = _pod_ports(service, pod)
        if not ports:
            continue
        address = {"ip": ip, "nodeName": pod["spec"].get("nodeName"),
                   "targetRef": {"kind": "Pod", "namespace": meta["namespace"], "name": pod["metadata"]["name"],
                                 "uid": pod["metadata"].get("uid")}}  # fmt: skip
        kind = "addresses" if publish_all or _ready(pod) else "notReadyAddresses"
        subsets.setdefault(ports, {"addresses": [], "notReadyAddresses": []})[kind].append(address)
    out = []
    for ports, groups in sorted(subsets.items()):
        subset: dict = {k: sorted(v, key=lambda a: a["ip"]) for k, v in groups.items() if v}
        subset["ports"] = [{"name": n, "port": p, "protocol": proto} if n else {"port": p, "protocol": proto}
                           for n, p, proto in ports]  # fmt: skip
        out.append(subset)
    labels = dict(meta.get("labels") or {})
    if service["spec"].get("clusterIP") == "None":
        labels[HEADLESS_LABEL] = ""
    obj = {"apiVersion": "v1", "kind": "Endpoints",
           "metadata": {"name": meta["name"], "namespace": meta["namespace"], "labels": labels}}  # fmt: skip
    if out:
        obj["subsets"] = out
    return obj


class EndpointsController:
    """Keeps each selector Service's Endpoints in ``store`` (module docstring)."""

    def __init__(self, store: ObjectStore, period_s: float = 0.2) -> None:
        self.store = store
        self.period_s = period_s
        self.writes = 0

    async def run(self, stop: asyncio.Event) -> None:
        """`sync` every ``period_s`` until ``stop`` is set."""
        await sync_every(self.sync, self.period_s, stop)

    def sync(self) -> None:
        """One pass over every Service and every Endpoints object."""
        services = {(ns, n): o for (plural, ns, n), o in list(self.store.objects.items()) if plural == SERVICES.plural}
        pods: dict[str | None, list[dict]] = {}
        for (plural, ns, _n), o in list(self.store.objects.items()):
            if plural == PODS.plural:
                pods.setdefault(ns, []).append(o)
        for (ns, name), service in services.items():
            if (service.get("spec") or {}).get("selector"):
                self._write(ns, name, endpoints_for(service, pods.get(ns, [])))
        for (plural, ns, name), _o in list(self.store.objects.items()):
            if plural == ENDPOINTS.plural and (ns, name) not in services:
                try:
                    self.store.delete(ENDPOINTS, ns, name)
                except ApiError:
                    pass

    def _write(self, namespace: str | None, name: str, wanted: dict) -> None:
        current = self.store.objects.get((ENDPOINTS.plural, namespace, name))
        if current is None:
            self.store.create(ENDPOINTS, namespace, wanted)
            self.writes += 1
        elif (current.get("subsets"), current["metadata"].get("labels")) != (wanted.get("subsets"),
                                                                              wanted["metadata"]["labels"]):  # fmt: skip
            self.store.replace(ENDPOINTS, namespace, name, wanted)
            self.writes += 1
