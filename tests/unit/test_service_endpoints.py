"""A Service's ready addresses read through its Endpoints (fleet/k8s/service_endpoints.py) over the
in-repo fake of the cluster wrapper (tests/support/fake_kube.py): the ready addresses on a port, a
missing Endpoints object as no address, a 403 logged once with the rule to grant, the namespace
and target parsing, and a router pod (fleet/k8s/routerpod.py) connecting to the endpoint picker at
the address its Service's Endpoints name, and following it when it moves."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from fleet.k8s.client import ApiError
from fleet.k8s.routerpod import serve_router_pod
from fleet.k8s.service_endpoints import (
    ENDPOINTS,
    EndpointsAddresses,
    EndpointsSourceError,
    ServiceLocator,
    parse_endpoints_target,
    pod_namespace,
    ready_addresses,
)
from router.picker.service import PickerService
from tests.support.fake_kube import FakeKube
from tests.support.waits import async_wait_until

NS, SERVICE, PORT = "fleet", "fleet-picker", 8090


def _endpoints(ready: list[str], not_ready: list[str] = (), port: int = PORT) -> dict:
    """An Endpoints object as the endpoints controller writes it for the chart's picker Service."""
    return {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": SERVICE, "namespace": NS},
            "subsets": [{"addresses": [{"ip": ip, "targetRef": {"kind": "Pod", "name": f"p-{ip}"}} for ip in ready],
                         "notReadyAddresses": [{"ip": ip} for ip in not_ready],
                         "ports": [{"name": "picker", "port": port, "protocol": "TCP"}]}]}  # fmt: skip


def test_ready_addresses_are_those_of_subsets_with_the_port() -> None:
    obj = _endpoints(["10.0.0.1", "10.0.0.2"], not_ready=["10.0.0.3"])
    obj["subsets"].append({"addresses": [{"ip": "10.0.0.9"}], "ports": [{"name": "picker", "port": 9999}]})
    obj["subsets"].append({"addresses": [{"ip": "10.0.0.2"}, {"ip": "10.0.0.4"}],
                           "ports": [{"name": "x", "port": 1}, {"name": "picker", "port": PORT}]})  # fmt: skip
    assert ready_addresses(obj, PORT) == ["10.0.0.1", "10.0.0.2", "10.0.0.4"]
    assert ready_addresses(obj, 9999) == ["10.0.0.9"]
    assert ready_addresses({"metadata": {"name": SERVICE}}, PORT) == []   # no subsets: no Ready pod


async def test_the_locator_follows_the_services_ready_address() -> None:
    kube = FakeKube()
    locate = ServiceLocator(EndpointsAddresses(kube, NS), SERVICE, PORT)
    assert await locate() is None   # no Service (no Endpoints) yet: no picker, not a failure
    kube.store.create(ENDPOINTS, NS, _endpoints([], not_ready=["10.0.0.1"]))
    assert await locate() is None   # its pod is not Ready
    kube.store.replace(ENDPOINTS, NS, SERVICE, _endpoints(["10.0.0.1"], not_ready=["10.0.0.2"]))
    assert await locate() == ("10.0.0.1", PORT)
    kube.store.replace(ENDPOINTS, NS, SERVICE, _endpoints(["10.0.0.2"], not_ready=["10.0.0.1"]))   # failover
    assert await locate() == ("10.0.0.2", PORT)
    assert kube.calls["get"] == 4 and kube.calls["list"] == kube.calls["watch"] == 0   # one named GET a call


async def test_a_403_is_logged_once_with_the_rule(caplog: pytest.LogCaptureFixture) -> None:
    kube = FakeKube()
    kube.store.create(ENDPOINTS, NS, _endpoints(["10.0.0.1"]))
    source = EndpointsAddresses(kube, NS)
    refused = ApiError(403, "Forbidden", f'endpoints "{SERVICE}" is forbidden: User '
                                         f'"system:serviceaccount:{NS}:fleet-router" cannot get resource "endpoints"')
    caplog.set_level(logging.WARNING)
    for _ in range(3):   # the Role stays missing for three rounds
        kube.fail_next["get"] = refused
        with pytest.raises(EndpointsSourceError, match="403"):
            await source(SERVICE, PORT)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in caplog.records]
    rule = ('{apiGroups: [""], resources: ["endpoints"], verbs: ["get"], resourceNames: ["fleet-picker"]} '
            'in a Role of namespace "fleet"')
    assert rule in errors[0].getMessage() and "cannot get resource" in errors[0].getMessage()
    assert await source(SERVICE, PORT) == ["10.0.0.1"]   # granted again
    kube.fail_next["get"] = refused
    with pytest.raises(EndpointsSourceError):
        await source(SERVICE, PORT)
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 2   # a new refusal: logged again


async def test_other_failures_are_source_errors() -> None:
    kube = FakeKube()
    source = EndpointsAddresses(kube, NS)
    kube.fail_next["get"] = ApiError(500, "InternalError", "etcd timed out")
    with pytest.raises(EndpointsSourceError, match="etcd timed out"):
        await source(SERVICE, PORT)
    kube.fail_next["get"] = RuntimeError("MaxRetryError: connection refused")   # the client's transport errors
    with pytest.raises(EndpointsSourceError, match="connection refused"):
        await source(SERVICE, PORT)
    assert issubclass(EndpointsSourceError, OSError)   # what the picker client takes as "keep the last address"


@pytest.mark.parametrize(("target", "parsed"), [("fleet-picker:8090", ("fleet-picker", 8090)),
                                                (" p:1 ", ("p", 1))])  # fmt: skip
def test_parse_endpoints_target(target: str, parsed: tuple[str, int]) -> None:
    assert parse_endpoints_target(target) == parsed


@pytest.mark.parametrize(("target", "why"), [("fleet-picker", "SERVICE:PORT"), (":8090", "SERVICE:PORT"),
                                             ("picker.fleet.svc:8090", "DNS-1123 label"), ("Picker:1", "DNS-1123"),
                                             ("picker:0", "1-65535"), ("picker:grpc", "1-65535")])  # fmt: skip
def test_bad_endpoints_targets_name_the_flag_and_the_reason(target: str, why: str) -> None:
    with pytest.raises(ValueError, match="--picker-endpoints") as err:
        parse_endpoints_target(target)
    assert why in str(err.value)


def test_the_namespace_is_pod_namespace_else_the_service_accounts_file(tmp_path) -> None:
    sa_file = tmp_path / "namespace"
    sa_file.write_text("from-sa\n")
    assert pod_namespace({"POD_NAMESPACE": "from-env"}, sa_file) == "from-env"
    assert pod_namespace({}, sa_file) == "from-sa"
    with pytest.raises(ValueError, match="--lease: no namespace: POD_NAMESPACE is not set and .* is not readable"):
        pod_namespace({}, tmp_path / "absent", flag="--lease")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_router_pod_connects_to_the_picker_its_services_endpoints_name(monkeypatch) -> None:
    """`serve_router_pod` with ``picker_endpoints`` reads the Endpoints with the client it is given
    (in a pod: the service account's) in $POD_NAMESPACE and connects to the ready address; when
    the Endpoints move to another picker (an HA failover; the old one still listening), the
    router follows within `DEFAULT_LOCATE_INTERVAL_S`. The two pickers listen on 127.0.0.1 and
    127.0.0.2 (Linux routes 127/8 to lo) on the same port, as two picker pods would."""
    monkeypatch.setenv("POD_NAMESPACE", NS)
    kube = FakeKube()
    first, second = PickerService(), PickerService()
    await first.start("127.0.0.1", 0)
    try:
        await second.start("127.0.0.2", first.port)
    except OSError:
        await first.close()
        pytest.skip("127.0.0.2 is not routed to lo on this machine")
    port, admin_port = _free_port(), _free_port()
    kube.store.create(ENDPOINTS, NS, _endpoints(["127.0.0.1"], not_ready=["127.0.0.2"], port=first.port))
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop, kube=kube,
                                                picker_endpoints=(SERVICE, first.port)))  # fmt: skip
    try:
        await async_wait_until(lambda: first.metrics.facts.routers() == 1, 20, interval_s=0.05,
                               what="the router pod connected to the ready picker")  # fmt: skip
        assert second.metrics.facts.routers() == 0
        kube.store.replace(ENDPOINTS, NS, SERVICE, _endpoints(["127.0.0.2"], not_ready=["127.0.0.1"], port=first.port))
        await async_wait_until(lambda: second.metrics.facts.routers() == 1 and first.metrics.facts.routers() == 0,
                               20, interval_s=0.05, what="the router pod moved to the new ready picker")  # fmt: skip
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await first.close()
        await second.close()
    with pytest.raises(ValueError, match="give one"):
        await serve_router_pod("127.0.0.1", port, admin_port, "tok", picker=("x", 1), picker_endpoints=("x", 1))


def test_router_pod_refuses_a_bad_picker_endpoints_target(monkeypatch) -> None:
    from typer.testing import CliRunner

    from fleet.cli import app

    monkeypatch.setenv("FLEET_ROUTER_ADMIN_TOKEN", "tok")
    result = CliRunner().invoke(app, ["router-pod", "--picker-endpoints", "fleet-picker.fleet.svc:8090"])
    assert result.exit_code == 2 and "--picker-endpoints must be SERVICE:PORT" in result.output
