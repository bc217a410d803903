"""Peer routers found through a Service's Endpoints (fleet/k8s/peer_endpoints.py) over the in-repo
fake of the cluster wrapper (tests/support/fake_kube.py): the ready addresses on the peers' port,
a missing Endpoints object as no peers, a 403 logged once with the rule to grant and the last set
kept, the namespace and target parsing, and a router pod (fleet/k8s/routerpod.py) sending to the
peer its Service's Endpoints name."""

from __future__ import annotations

import asyncio
import logging
import socket

import httpx
import pytest
from prometheus_client import CollectorRegistry

from fleet.k8s.client import ApiError
from fleet.k8s.peer_endpoints import (
    ENDPOINTS,
    EndpointsPeers,
    PeerSourceError,
    parse_endpoints_target,
    pod_namespace,
    ready_addresses,
)
from fleet.k8s.routerpod import serve_router_pod
from router.signals.peer_discovery import DiscoveryMetrics, NoRecords, PeerDiscovery
from tests.support.fake_kube import FakeKube
from tests.support.waits import async_wait_until

NS, SERVICE, PORT = "fleet", "fleet-router-peers", 9090


def _endpoints(ready: list[str], not_ready: list[str] = (), port: int = PORT) -> dict:
    """An Endpoints object as the endpoints controller writes it for the chart's peers Service."""
    return {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": SERVICE, "namespace": NS},
            "subsets": [{"addresses": [{"ip": ip, "targetRef": {"kind": "Pod", "name": f"r-{ip}"}} for ip in ready],
                         "notReadyAddresses": [{"ip": ip} for ip in not_ready],
                         "ports": [{"name": "admin", "port": port, "protocol": "TCP"}]}]}  # fmt: skip


def test_ready_addresses_are_those_of_subsets_with_the_peers_port() -> None:
    obj = _endpoints(["10.0.0.1", "10.0.0.2"], not_ready=["10.0.0.3"])
    obj["subsets"].append({"addresses": [{"ip": "10.0.0.9"}], "ports": [{"name": "admin", "port": 9999}]})
    obj["subsets"].append({"addresses": [{"ip": "10.0.0.2"}, {"ip": "10.0.0.4"}],
                           "ports": [{"name": "x", "port": 1}, {"name": "admin", "port": PORT}]})  # fmt: skip
    assert ready_addresses(obj, PORT) == ["10.0.0.1", "10.0.0.2", "10.0.0.4"]
    assert ready_addresses(obj, 9999) == ["10.0.0.9"]
    assert ready_addresses({"metadata": {"name": SERVICE}}, PORT) == []   # no subsets: no Ready pod


async def test_the_source_reads_the_endpoints_and_discovery_leaves_this_router_out() -> None:
    kube = FakeKube()
    source = EndpointsPeers(kube, NS)
    with pytest.raises(NoRecords):   # no Service (no Endpoints) yet: no peers, not a failure
        await source(SERVICE, PORT)
    kube.store.create(ENDPOINTS, NS, _endpoints(["10.0.0.1", "10.0.0.2"], not_ready=["10.0.0.3"]))
    assert await source(SERVICE, PORT) == ["10.0.0.1", "10.0.0.2"]
    changes: list[list[str]] = []
    discovery = PeerDiscovery(SERVICE, PORT, ["10.0.0.1"], changes.append, DiscoveryMetrics(CollectorRegistry()),
                              resolve=source, clock=lambda: 0.0)  # fmt: skip
    assert await discovery.resolve_once() == ["http://10.0.0.2:9090"]
    kube.store.replace(ENDPOINTS, NS, SERVICE, _endpoints(["10.0.0.1", "10.0.0.3"], not_ready=["10.0.0.2"]))
    assert await discovery.resolve_once() == ["http://10.0.0.3:9090"]   # .2 unready, .3 Ready
    kube.store.delete(ENDPOINTS, NS, SERVICE)
    assert await discovery.resolve_once() == []
    assert changes == [["http://10.0.0.2:9090"], ["http://10.0.0.3:9090"], []]
    assert kube.calls["get"] == 5 and kube.calls["list"] == kube.calls["watch"] == 0   # one named GET a round


async def test_a_403_is_logged_once_with_the_rule_and_the_last_set_is_kept(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube()
    kube.store.create(ENDPOINTS, NS, _endpoints(["10.0.0.1", "10.0.0.2"]))
    registry = CollectorRegistry()
    discovery = PeerDiscovery(SERVICE, PORT, ["10.0.0.1"], lambda _: None, DiscoveryMetrics(registry),
                              resolve=EndpointsPeers(kube, NS), clock=lambda: 0.0)  # fmt: skip
    assert await discovery.resolve_once() == ["http://10.0.0.2:9090"]
    refused = ApiError(403, "Forbidden", f'endpoints "{SERVICE}" is forbidden: User '
                                         f'"system:serviceaccount:{NS}:fleet-router" cannot get resource "endpoints"')
    caplog.set_level(logging.WARNING)
    for _ in range(3):   # the Role stays missing for three rounds
        kube.fail_next["get"] = refused
        assert await discovery.resolve_once() == ["http://10.0.0.2:9090"]   # kept
    assert registry.get_sample_value("fleet_router_peer_dns_errors_total") == 3
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    rule = ('{apiGroups: [""], resources: ["endpoints"], verbs: ["get"], resourceNames: ["fleet-router-peers"]} '
            'in a Role of namespace "fleet"')
    assert rule in errors[0].getMessage() and "cannot get resource" in errors[0].getMessage()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1   # the discovery's, once
    kube.store.replace(ENDPOINTS, NS, SERVICE, _endpoints(["10.0.0.1", "10.0.0.4"]))
    assert await discovery.resolve_once() == ["http://10.0.0.4:9090"]   # granted again: followed again
    kube.fail_next["get"] = refused
    assert await discovery.resolve_once() == ["http://10.0.0.4:9090"]
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2   # a new refusal: logged again


async def test_other_failures_keep_the_last_set() -> None:
    kube = FakeKube()
    source = EndpointsPeers(kube, NS)
    kube.fail_next["get"] = ApiError(500, "InternalError", "etcd timed out")
    with pytest.raises(PeerSourceError, match="etcd timed out"):
        await source(SERVICE, PORT)
    kube.fail_next["get"] = RuntimeError("MaxRetryError: connection refused")   # the client's transport errors
    with pytest.raises(PeerSourceError, match="connection refused"):
        await source(SERVICE, PORT)


@pytest.mark.parametrize(("target", "parsed"), [("fleet-router-peers:9090", ("fleet-router-peers", 9090)),
                                                (" r:1 ", ("r", 1))])  # fmt: skip
def test_parse_endpoints_target(target: str, parsed: tuple[str, int]) -> None:
    assert parse_endpoints_target(target) == parsed


@pytest.mark.parametrize(("target", "why"), [("fleet-router-peers", "SERVICE:PORT"), (":9090", "SERVICE:PORT"),
                                             ("peers.fleet.svc:9090", "DNS-1123 label"), ("Peers:1", "DNS-1123"),
                                             ("peers:0", "1-65535"), ("peers:admin", "1-65535")])  # fmt: skip
def test_bad_endpoints_targets_name_the_flag_and_the_reason(target: str, why: str) -> None:
    with pytest.raises(ValueError, match="--peers-endpoints") as err:
        parse_endpoints_target(target)
    assert why in str(err.value)


def test_the_namespace_is_pod_namespace_else_the_service_accounts_file(tmp_path) -> None:
    sa_file = tmp_path / "namespace"
    sa_file.write_text("from-sa\n")
    assert pod_namespace({"POD_NAMESPACE": "from-env"}, sa_file) == "from-env"
    assert pod_namespace({}, sa_file) == "from-sa"
    with pytest.raises(ValueError, match="POD_NAMESPACE is not set and .* is not readable"):
        pod_namespace({}, tmp_path / "absent")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_router_pod_sends_to_the_peer_its_services_endpoints_name(monkeypatch) -> None:
    """`serve_router_pod` with ``peers_endpoints`` reads the Endpoints with the client it is given
    (in a pod: the service account's) in $POD_NAMESPACE, its own pod IP left out (the pod says it
    is 127.0.0.2; the other address, 127.0.0.1, is its own admin port here, as no other process
    may listen in the unit tier: it posts to itself, which its id makes it ignore)."""
    monkeypatch.setenv("POD_NAMESPACE", NS)
    kube = FakeKube()
    port, admin_port = _free_port(), _free_port()
    kube.store.create(ENDPOINTS, NS, _endpoints(["127.0.0.2", "127.0.0.1"], port=admin_port))
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop, pod_ip="127.0.0.2",
                                                peers_endpoints=(SERVICE, admin_port), kube=kube))  # fmt: skip
    async with httpx.AsyncClient(timeout=5) as c:

        async def peers() -> dict | None:
            r = await c.get(f"http://127.0.0.1:{admin_port}/admin/v1/peers", headers={"Authorization": "Bearer tok"})
            return r.json() if r.status_code == 200 else None

        state = await async_wait_until(peers, 20, interval_s=0.05, what="the router pod to start",
                                       ignoring=(httpx.TransportError,))
        assert state["targets"] == [f"http://127.0.0.1:{admin_port}"]
    stop.set()
    await asyncio.wait_for(task, 20)
    with pytest.raises(ValueError, match="give one"):
        await serve_router_pod("127.0.0.1", port, admin_port, "tok", peers_dns=("x", 1), peers_endpoints=("x", 1))


def test_router_pod_refuses_a_bad_peers_endpoints_target(monkeypatch) -> None:
    from typer.testing import CliRunner

    from fleet.cli import app

    monkeypatch.setenv("FLEET_ROUTER_ADMIN_TOKEN", "tok")
    result = CliRunner().invoke(app, ["router-pod", "--peers-endpoints", "fleet-router-peers.fleet.svc:9090"])
    assert result.exit_code == 2 and "--peers-endpoints must be SERVICE:PORT" in result.output
