"""Integration: the router admin token Secret (fleet/k8s/admin_token.py) through the real
`kubernetes` client and the real `fleet operator` process, against the HTTP STAND-IN for the API
server (fleet/testing/k8s/apiserver.py; not a cluster). The operator started as the chart starts
it (FLEET_ROUTER_ADMIN_SECRET, no token in its environment) makes the Secret once; a restarted
one reads the same token; with a user's Secret (create false) that is missing it exits 2 naming it.
The chart's own Role, enforced by the stand-in's RBAC, admits exactly what the operator asks."""

from __future__ import annotations

import base64
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.k8s.admin_token import AdminTokenError, ensure_admin_token
from fleet.k8s.client import SECRETS, ApiError, Conflict, KubeClient
from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.rbac import Authorizer
from fleet.testing.k8s.resources import by_kind
from tests.support.helm import helm_binary, render
from tests.support.waits import async_wait_until

REPO = Path(__file__).resolve().parents[2]
NS = "fleet"
NAME = "fleet-router-admin"
pytestmark = pytest.mark.timeout(120)


def _operator(tmp: Path, kubeconfig: Path, identity: str, **env: str) -> tuple[subprocess.Popen, Path]:
    log_path = tmp / f"operator-{identity}.log"
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEET_ROUTER_ADMIN")}
    env = {**base, "KUBECONFIG": str(kubeconfig), "FLEET_NAMESPACE": NS, "POD_NAME": identity,
           "FLEET_ROUTER_SELECTOR": "none", "FLEET_ENGINE_IMAGE": "fleet:standin", "FLEET_LOG_LEVEL": "INFO",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-m", "fleet.cli", "operator", "--metrics-port", "0", "--tick-s", "0.3"],
                            env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    return proc, log_path


async def _stop(proc: subprocess.Popen) -> int:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    await async_wait_until(lambda: proc.poll() is not None, timeout_s=30, what="the operator to exit")
    return proc.returncode


async def test_the_secret_through_the_real_client():
    api = APIServerStandIn()
    await api.start()
    kube = KubeClient.for_host(api.url)
    try:
        token = await ensure_admin_token(kube, NS, NAME)
        assert len(token) == 43 and await ensure_admin_token(kube, NS, NAME) == token
        stored = api.store.get(SECRETS, NS, NAME)
        assert base64.b64decode(stored["data"]["token"]).decode() == token
        # what a lost race answers over HTTP: 409 with reason AlreadyExists (ensure reads then)
        with pytest.raises(Conflict) as err:
            await kube.create(SECRETS, NS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": NAME}})
        assert err.value.reason == "AlreadyExists"
        with pytest.raises(AdminTokenError, match="fleet/absent"):
            await ensure_admin_token(kube, NS, "absent", create=False)
    finally:
        kube.close()
        await api.stop()


async def test_the_operator_makes_the_secret_once_and_a_restart_reads_it(tmp_path):
    api = APIServerStandIn()
    await api.start()
    kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")
    chart_env = {"FLEET_ROUTER_ADMIN_SECRET": NAME, "FLEET_ROUTER_ADMIN_SECRET_KEY": "token",
                 "FLEET_ROUTER_ADMIN_SECRET_CREATE": "true"}  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        first, log_a = _operator(tmp_path, kubeconfig, "op-a", **chart_env)
        procs.append(first)
        made = await async_wait_until(lambda: api.store.objects.get((SECRETS.plural, NS, NAME)), timeout_s=60,
                                      what="the operator to make the Secret", explain=log_a.read_text)  # fmt: skip
        rv = made["metadata"]["resourceVersion"]
        await async_wait_until(lambda: "watching namespace" in log_a.read_text(), timeout_s=60,
                               what="the first operator to start", explain=log_a.read_text)  # fmt: skip
        assert "router admin token" not in log_a.read_text()   # no error logged
        assert await _stop(first) == 0
        second, log_b = _operator(tmp_path, kubeconfig, "op-b", **chart_env)
        procs.append(second)
        await async_wait_until(lambda: "watching namespace" in log_b.read_text(), timeout_s=60,
                               what="the second operator to start", explain=log_b.read_text)  # fmt: skip
        assert second.poll() is None
        assert api.store.get(SECRETS, NS, NAME)["metadata"]["resourceVersion"] == rv   # read, not rewritten
        assert await _stop(second) == 0
        # a user's Secret (router.adminToken.existingSecret) that does not exist: exit 2, named
        third, log_c = _operator(tmp_path, kubeconfig, "op-c", FLEET_ROUTER_ADMIN_SECRET="mine",
                                 FLEET_ROUTER_ADMIN_SECRET_CREATE="false")  # fmt: skip
        procs.append(third)
        await async_wait_until(lambda: third.poll() is not None, timeout_s=60, what="the operator to give up",
                               explain=log_c.read_text)  # fmt: skip
        assert third.returncode == 2
        assert "Secret fleet/mine (router.adminToken.existingSecret) does not exist" in log_c.read_text()
        assert (SECRETS.plural, NS, "mine") not in api.store.objects
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        await api.stop()


@pytest.mark.skipif(helm_binary() is None, reason="helm not installed: run `bash .ci/helm.sh`")
@pytest.mark.parametrize("existing", ["", "my-admin"])
async def test_the_charts_role_admits_what_the_operator_asks_and_no_other_secret(existing):
    extra = ("--set", f"router.adminToken.existingSecret={existing}") if existing else ()
    api = APIServerStandIn()
    api.authorizer = Authorizer(api.store)
    for obj in render(extra=extra):
        if obj["kind"] in ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"):
            api.store.create(by_kind(obj["apiVersion"], obj["kind"]), obj["metadata"].get("namespace"), obj)
    name = existing or NAME
    if existing:   # the user's Secret, made before the release
        api.store.create(SECRETS, NS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
                                       "data": {"token": base64.b64encode(b"users-token").decode()}})  # fmt: skip
    api.store.create(SECRETS, NS, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "someone-elses"},
                                   "data": {"token": base64.b64encode(b"x").decode()}})  # fmt: skip
    await api.start()
    kube = KubeClient.for_host(api.url, api.authorizer.service_account_token(NS, "fleet-operator"))
    try:
        token = await ensure_admin_token(kube, NS, name, create=not existing)
        assert token == ("users-token" if existing else base64.b64decode(
            api.store.get(SECRETS, NS, NAME)["data"]["token"]).decode())  # fmt: skip
        assert api.authorizer.denied == []
        for call in (kube.get(SECRETS, NS, "someone-elses"), kube.list(SECRETS, NS)):
            with pytest.raises(ApiError) as err:
                await call
            assert err.value.status == 403
        assert len(api.authorizer.denied) == 2
    finally:
        kube.close()
        await api.stop()
