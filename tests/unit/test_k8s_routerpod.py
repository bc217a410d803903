"""`fleet router-pod` (fleet/k8s/routerpod.py): the OpenAI API on one port, the admin API on
another only; both served by one router app (one pool table)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from fleet.k8s.routerpod import PublicOnly, serve_router_pod
from tests.support.waits import async_wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_public_wrapper_hides_the_admin_api():
    calls = []

    async def app(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=PublicOnly(app)), base_url="http://r") as c:
        assert (await c.get("/admin/v1/pools")).status_code == 404
        assert (await c.get("/admin")).status_code == 404
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/administrator")).status_code == 200   # only the /admin tree
    assert calls == ["/health", "/administrator"]


async def test_router_pod_serves_admin_on_its_own_port_only():
    port, admin_port = _free_port(), _free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop))
    auth = {"Authorization": "Bearer tok"}
    async with httpx.AsyncClient(timeout=5) as c:

        async def healthy() -> bool:
            return (await c.get(f"http://127.0.0.1:{port}/health")).status_code == 200

        await async_wait_until(healthy, 20, interval_s=0.05, what="the router pod to start",
                               ignoring=(httpx.TransportError,))
        pool = {"endpoints": [{"id": "e1", "url": "http://127.0.0.1:1"}]}
        assert (await c.put(f"http://127.0.0.1:{port}/admin/v1/pools/m", json=pool, headers=auth)).status_code == 404
        r = await c.put(f"http://127.0.0.1:{admin_port}/admin/v1/pools/m", json=pool, headers=auth)
        assert r.status_code in (200, 204), r.text
        models = (await c.get(f"http://127.0.0.1:{port}/v1/models")).json()   # same pool table, public side
        assert [m["id"] for m in models["data"]] == ["m"]
    stop.set()
    await asyncio.wait_for(task, 20)


async def test_equal_ports_are_refused():
    with pytest.raises(ValueError, match="admin-port"):
        await serve_router_pod("127.0.0.1", 8080, 8080, "t")


def test_router_pod_refuses_a_bad_peers_dns_target(monkeypatch):
    from typer.testing import CliRunner

    from fleet.cli import app

    monkeypatch.setenv("FLEET_ROUTER_ADMIN_TOKEN", "tok")
    result = CliRunner().invoke(app, ["router-pod", "--peers-dns", "fleet-router-peers"])   # no port
    assert result.exit_code == 2 and "NAME:PORT" in result.output


async def test_router_pod_finds_its_peers_by_name():
    """The chart's arguments reach the router app: its peers are what the name resolves to, its
    own pod IP left out (`localhost` is 127.0.0.1 here; the pod says it is 127.0.0.2, so it finds
    its own admin port and posts to itself, which its id makes it ignore)."""
    port, admin_port = _free_port(), _free_port()
    stop = asyncio.Event()
    task = asyncio.create_task(serve_router_pod("127.0.0.1", port, admin_port, "tok", stop=stop,
                                                peers_dns=("localhost", admin_port), pod_ip="127.0.0.2",
                                                router_id="fleet-router-abc"))  # fmt: skip
    async with httpx.AsyncClient(timeout=5) as c:

        async def peers() -> httpx.Response | None:
            r = await c.get(f"http://127.0.0.1:{admin_port}/admin/v1/peers", headers={"Authorization": "Bearer tok"})
            return r if r.status_code == 200 else None

        r = await async_wait_until(peers, 20, interval_s=0.05, what="the router pod to start",
                                   ignoring=(httpx.TransportError,))
        assert r.json()["router"] == "fleet-router-abc" and r.json()["targets"] == [f"http://127.0.0.1:{admin_port}"]
    # the peers' load datagrams are received on UDP at the admin port's number (router/signals/peer_datagram.py)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp, pytest.raises(OSError):
        udp.bind(("127.0.0.1", admin_port))
    stop.set()
    await asyncio.wait_for(task, 20)
