"""Integration: router pods find each other through the chart's router-peers Service's Endpoints
on a REAL Kubernetes 1.20.2 control plane (fleet/testing/k8s/kube.py).

Real here: kube-apiserver (RBAC, Node authorization and NodeRestriction, service-account tokens,
the Endpoints object's validation), kube-controller-manager's endpoints controller (it writes the
Endpoints from the Service's selector and the pods' Ready condition and IP) and token controller
(the router's service-account token), and the chart's objects as `helm template` renders them for
1.20: the router-peers Service, the router's ServiceAccount, Role and RoleBinding, the router
pods' template. Stand-ins: the node is HOLLOW (fleet/testing/k8s/hollow.py), so nothing runs the
pods: the test writes their status (Running, Ready, a pod IP) AS THE NODE (``system:node:NAME``,
as a kubelet does), and runs Fleet's peer source (fleet/k8s/peer_endpoints.py) in this process
with the router's service-account token, through the router's own `PeerDiscovery`.

Skips, saying why, where the control plane is not built (`tests/run.sh` builds it:
``python -m fleet.testing.k8s.kube build``) or does not start; ``FLEET_KUBE=skip`` switches it off.
"""

from __future__ import annotations

import base64
import copy
import logging
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from fleet.k8s.client import PODS, ApiError
from fleet.k8s.peer_endpoints import ENDPOINTS, EndpointsPeers, PeerSourceError
from fleet.testing.k8s.hollow import HollowNodes
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.resources import SECRETS, SERVICE_ACCOUNTS
from router.signals.peer_discovery import DiscoveryMetrics, PeerDiscovery
from tests.support.helm import render
from tests.support.real_kube import control_plane as start_control_plane
from tests.support.waits import async_wait_until

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)   # the first test may build the control plane
NODE, NS, SERVICE, ADMIN_PORT = "router-node", "fleet", "fleet-router-peers", 9090
POD_IPS = {"fleet-router-a": "10.244.1.11", "fleet-router-b": "10.244.1.12"}


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"), nodes=(NODE,))


def _chart() -> dict[tuple[str, str], dict]:
    """The chart's objects as rendered for 1.20, by (kind, name)."""
    return {(d["kind"], d["metadata"]["name"]): d for d in render(kube_version="1.20.2")}


def _router_pod(chart: dict, name: str) -> dict:
    """A router pod as the chart's Deployment makes it (its template), bound to the hollow node."""
    template = copy.deepcopy(chart[("Deployment", "fleet-router")]["spec"]["template"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "name": name},
            "spec": {**template["spec"], "nodeName": NODE}}


def _running(ip: str, ready: bool) -> dict:
    """A pod status as a kubelet writes it for a started pod."""
    flag = "True" if ready else "False"
    return {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "10.0.0.1",
                       "conditions": [{"type": t, "status": s} for t, s in (
                           ("Initialized", "True"), ("Ready", flag), ("ContainersReady", flag),
                           ("PodScheduled", "True"))]}}  # fmt: skip


async def test_router_pods_find_each_other_through_the_real_endpoints(control_plane, caplog):
    """The real endpoints controller fills the chart's router-peers Endpoints with the Ready router
    pods' IPs; Fleet's Endpoints peer source, with the router's service-account token, finds the
    other pod (its own IP left out), drops a pod turned unready, and is refused 403 without the
    chart's Role (logged once with the rule to grant, the last set kept)."""
    chart = _chart()
    kube = control_plane.client()
    as_node = control_plane.client(control_plane.tokens[f"system:node:{NODE}"])
    router_kube = None
    nodes = {NODE: node(NODE, cpu=16, labels={"kubernetes.io/os": "linux"})}
    try:
        with HollowNodes(control_plane, nodes, interval_s=5.0):
            await kube.create(control_plane.resource("v1", "Namespace"), None,
                              {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})  # fmt: skip
            await kube.create(SERVICE_ACCOUNTS, NS, chart[("ServiceAccount", "fleet-router")])
            await kube.create(control_plane.resource("v1", "Service"), NS, chart[("Service", SERVICE)])

            async def router_token() -> str | None:   # minted by the controller-manager's token controller
                secrets = (await kube.get(SERVICE_ACCOUNTS, NS, "fleet-router")).get("secrets") or []
                if not secrets:
                    return None
                return base64.b64decode((await kube.get(SECRETS, NS, secrets[0]["name"]))["data"]["token"]).decode()

            token = await async_wait_until(router_token, 60, interval_s=0.2, explain=control_plane.explain,
                                           what="the fleet-router ServiceAccount's token")  # fmt: skip
            router_kube = control_plane.client(token)
            for name, ip in POD_IPS.items():
                await kube.create(PODS, NS, _router_pod(chart, name))
                await as_node.patch_status(PODS, NS, name, _running(ip, ready=True))   # the node's own pods

            source = EndpointsPeers(router_kube, NS)
            with pytest.raises(PeerSourceError, match="403"):   # no Role yet: refused by the real RBAC
                await source(SERVICE, ADMIN_PORT)
            assert source.refused
            rbac = "rbac.authorization.k8s.io/v1"
            await kube.create(control_plane.resource(rbac, "Role"), NS, chart[("Role", "fleet-router")])
            await kube.create(control_plane.resource(rbac, "RoleBinding"), NS, chart[("RoleBinding", "fleet-router")])

            registry = CollectorRegistry()
            discovery = PeerDiscovery(SERVICE, ADMIN_PORT, [POD_IPS["fleet-router-a"]], lambda _: None,
                                      DiscoveryMetrics(registry), resolve=source)  # fmt: skip
            endpoints: dict = {}

            async def found(want: list[str]) -> bool:
                try:
                    endpoints.update(await kube.get(ENDPOINTS, NS, SERVICE))
                except ApiError:
                    pass
                return await discovery.resolve_once() == want

            other = [f"http://{POD_IPS['fleet-router-b']}:{ADMIN_PORT}"]
            await async_wait_until(lambda: found(other), 60, interval_s=0.5, what="router a's peer set: router b",
                                   explain=lambda: f"{endpoints}\n{control_plane.explain()}")  # fmt: skip
            (subset,) = endpoints["subsets"]   # what the real controller wrote: both Ready pods, the admin port
            assert sorted(a["ip"] for a in subset["addresses"]) == sorted(POD_IPS.values())
            assert subset["ports"] == [{"name": "admin", "port": ADMIN_PORT, "protocol": "TCP"}]

            # router b unready: the real controller moves it to notReadyAddresses, a's set empties
            await as_node.patch_status(PODS, NS, "fleet-router-b", _running(POD_IPS["fleet-router-b"], ready=False))
            await async_wait_until(lambda: found([]), 60, interval_s=0.5, what="router b out of a's peer set",
                                   explain=lambda: f"{endpoints}\n{control_plane.explain()}")  # fmt: skip
            await as_node.patch_status(PODS, NS, "fleet-router-b", _running(POD_IPS["fleet-router-b"], ready=True))
            await async_wait_until(lambda: found(other), 60, interval_s=0.5, what="router b back in a's peer set",
                                   explain=lambda: f"{endpoints}\n{control_plane.explain()}")  # fmt: skip

            # the RoleBinding gone: refused (403), logged once with the rule, the last set kept
            caplog.set_level(logging.WARNING)
            caplog.clear()   # the refusal before the Role existed was logged then
            await kube.delete(control_plane.resource(rbac, "RoleBinding"), NS, "fleet-router")

            async def refused() -> bool:
                return await discovery.resolve_once() == other and source.refused

            await async_wait_until(refused, 60, interval_s=0.5, what="the Endpoints read refused without the Role")
            await discovery.resolve_once()
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and 'resourceNames: ["fleet-router-peers"]' in errors[0], errors
            assert "forbidden" in errors[0] and discovery.peers == other
    finally:
        for c in (kube, as_node, router_kube):
            if c is not None:
                c.close()
