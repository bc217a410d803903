"""The router admin token Secret (fleet/k8s/admin_token.py), on the fake client: made once when
missing, the winner's read after a lost create race (409 AlreadyExists), an existing one read and
never written, a user's missing Secret an error naming it, and the environment the chart sets."""

from __future__ import annotations

import asyncio
import base64

import pytest

from fleet.k8s.admin_token import SECRET_LABELS, AdminTokenError, AdminTokenSource, ensure_admin_token
from fleet.k8s.client import SECRETS, ApiError, Conflict
from tests.support.fake_kube import FakeKube

NS = "fleet"
NAME = "fleet-router-admin"


def _secret(data: dict[str, str], name: str = NAME) -> dict:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS}, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}  # fmt: skip


class RivalCreatesFirst(FakeKube):
    """Another operator's create lands between this one's get (NotFound) and its create."""

    def __init__(self, rival_token: str) -> None:
        super().__init__()
        self.rival_token = rival_token

    async def create(self, res, namespace, body):
        if res is SECRETS and not self.store.objects.get((SECRETS.plural, namespace, body["metadata"]["name"])):
            self.store.create(SECRETS, namespace, _secret({"token": self.rival_token}))
        return await super().create(res, namespace, body)


async def test_a_missing_secret_is_made_once_and_read_back():
    kube = FakeKube()
    token = await ensure_admin_token(kube, NS, NAME, new_token=lambda: "first-token")
    assert token == "first-token"
    stored = kube.store.get(SECRETS, NS, NAME)
    assert base64.b64decode(stored["data"]["token"]).decode() == "first-token"
    assert stored["type"] == "Opaque" and stored["metadata"]["labels"] == SECRET_LABELS
    assert kube.calls["get"] == 1 and kube.calls["create"] == 1
    # a restart (or the router pods' secretKeyRef) sees the same token; nothing is written again
    rv = stored["metadata"]["resourceVersion"]
    assert await ensure_admin_token(kube, NS, NAME, new_token=lambda: "second-token") == "first-token"
    assert kube.calls["create"] == 1 and kube.store.get(SECRETS, NS, NAME)["metadata"]["resourceVersion"] == rv


async def test_the_default_token_is_random_and_url_safe():
    kube = FakeKube()
    token = await ensure_admin_token(kube, NS, NAME)
    other = await ensure_admin_token(FakeKube(), NS, NAME)
    assert len(token) == 43 and token != other   # secrets.token_urlsafe(32): 256 bits
    assert set(token) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


async def test_a_lost_create_race_reads_the_winners_token():
    kube = RivalCreatesFirst("rival-token")
    token = await ensure_admin_token(kube, NS, NAME, new_token=lambda: "mine")
    assert token == "rival-token"
    assert kube.calls["get"] == 2 and kube.calls["create"] == 1   # get: NotFound; create: 409; get again
    assert base64.b64decode(kube.store.get(SECRETS, NS, NAME)["data"]["token"]).decode() == "rival-token"


class SlowAnswers(FakeKube):
    """Each answer reaches its caller after the other tasks had a turn (as over a network)."""

    async def get(self, res, namespace, name):
        try:
            return await super().get(res, namespace, name)
        finally:
            await asyncio.sleep(0)


async def test_two_operators_starting_together_agree():
    kube = SlowAnswers()
    tokens = await asyncio.gather(*(ensure_admin_token(kube, NS, NAME) for _ in range(2)))
    assert tokens[0] == tokens[1]
    assert kube.calls["create"] == 2 and kube.calls["get"] == 3   # both saw NotFound; the loser read the winner's


async def test_an_existing_secret_is_read_and_never_written():
    kube = FakeKube()
    kube.store.create(SECRETS, NS, _secret({"token": "theirs", "other": "x"}))
    assert await ensure_admin_token(kube, NS, NAME) == "theirs"
    assert kube.calls["create"] == 0 and kube.calls["replace"] == 0 and kube.calls["patch"] == 0


async def test_an_existing_secret_under_another_key():
    kube = FakeKube()
    kube.store.create(SECRETS, NS, _secret({"admin": "theirs"}, name="mine"))
    assert await ensure_admin_token(kube, NS, "mine", "admin", create=False) == "theirs"


async def test_a_missing_existing_secret_is_an_error_naming_it_and_is_not_made():
    kube = FakeKube()
    with pytest.raises(AdminTokenError, match=r"Secret fleet/mine \(router.adminToken.existingSecret\) does not exist"):
        await ensure_admin_token(kube, NS, "mine", create=False)
    assert kube.calls["create"] == 0 and not kube.store.objects


@pytest.mark.parametrize("data,why", [
    ({"other": "x"}, "has no key 'token'"),
    ({"token": ""}, "has no key 'token'"),
    ({"token": "abc\n"}, "trailing newline"),   # kubectl create secret --from-file of an echo'd file
    ({"token": "a b"}, "whitespace"),
    ({"token": "tökén"}, "not base64 of ASCII"),
])
async def test_an_unusable_token_is_an_error_naming_secret_and_key(data, why):
    kube = FakeKube()
    kube.store.create(SECRETS, NS, _secret(data))
    with pytest.raises(AdminTokenError, match=why) as err:
        await ensure_admin_token(kube, NS, NAME)
    assert f"{NS}/{NAME}" in str(err.value)


async def test_a_secret_with_bad_base64_is_an_error():
    kube = FakeKube()
    kube.store.create(SECRETS, NS, {**_secret({}), "data": {"token": "not base64!"}})
    with pytest.raises(AdminTokenError, match="not base64"):
        await ensure_admin_token(kube, NS, NAME)


async def test_other_refusals_reach_the_caller():
    kube = FakeKube()
    kube.fail_next["get"] = ApiError(403, "Forbidden", 'secrets "fleet-router-admin" is forbidden')
    with pytest.raises(ApiError) as err:
        await ensure_admin_token(kube, NS, NAME)
    assert err.value.status == 403
    kube.fail_next["create"] = Conflict(409, "Conflict", "not a name clash")
    with pytest.raises(Conflict):
        await ensure_admin_token(kube, NS, NAME)


# ----- the environment (charts/fleet/templates/operator-deployment.yaml) ---------------------------


async def test_an_explicit_token_wins_and_reads_no_secret():
    source = AdminTokenSource.from_env({"FLEET_ROUTER_ADMIN_TOKEN": "t", "FLEET_ROUTER_ADMIN_SECRET": NAME})
    kube = FakeKube()
    assert await source.resolve(kube, NS) == "t"
    assert sum(kube.calls.values()) == 0


async def test_the_chart_environment_names_the_secret():
    source = AdminTokenSource.from_env({"FLEET_ROUTER_ADMIN_SECRET": NAME, "FLEET_ROUTER_ADMIN_SECRET_KEY": "token",
                                        "FLEET_ROUTER_ADMIN_SECRET_CREATE": "true"})  # fmt: skip
    assert source == AdminTokenSource(secret=NAME, key="token", create=True)
    kube = FakeKube()
    token = await source.resolve(kube, NS)
    assert kube.calls["create"] == 1 and await source.resolve(kube, NS) == token
    user = AdminTokenSource.from_env({"FLEET_ROUTER_ADMIN_SECRET": "mine", "FLEET_ROUTER_ADMIN_SECRET_CREATE": "false"})
    assert user == AdminTokenSource(secret="mine", key="token", create=False)
    with pytest.raises(AdminTokenError, match="fleet/mine"):
        await user.resolve(kube, NS)


@pytest.mark.parametrize("env,why", [
    ({}, "neither FLEET_ROUTER_ADMIN_TOKEN nor FLEET_ROUTER_ADMIN_SECRET"),
    ({"FLEET_ROUTER_ADMIN_TOKEN": ""}, "neither"),
    ({"FLEET_ROUTER_ADMIN_SECRET": NAME, "FLEET_ROUTER_ADMIN_SECRET_CREATE": "yes"}, "true or false"),
])
def test_a_bad_environment_is_an_error(env, why):
    with pytest.raises(AdminTokenError, match=why):
        AdminTokenSource.from_env(env)


async def test_the_secret_the_operator_makes_is_owned_by_its_service_account():
    """Uninstalling the release deletes the ServiceAccount; the garbage collector then deletes the
    Secret (the fake cascades owner references as the API server's collector does)."""
    from fleet.k8s.client import SERVICE_ACCOUNTS

    kube = FakeKube()
    sa = kube.store.create(SERVICE_ACCOUNTS, NS, {"metadata": {"name": "fleet-operator"}})
    source = AdminTokenSource(secret=NAME, owner_service_account="fleet-operator")
    token = await source.resolve(kube, NS)
    secret = kube.store.get(SECRETS, NS, NAME)
    assert secret["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "ServiceAccount",
                                                      "name": "fleet-operator", "uid": sa["metadata"]["uid"],
                                                      "blockOwnerDeletion": False}]  # fmt: skip
    assert base64.b64decode(secret["data"]["token"]).decode() == token
    kube.store.delete(SERVICE_ACCOUNTS, NS, "fleet-operator")
    assert (SECRETS.plural, NS, NAME) not in kube.store.objects


async def test_an_unreadable_service_account_still_makes_an_unowned_secret():
    kube = FakeKube()   # no ServiceAccount: NotFound
    token = await AdminTokenSource(secret=NAME, owner_service_account="gone").resolve(kube, NS)
    secret = kube.store.get(SECRETS, NS, NAME)
    assert "ownerReferences" not in secret["metadata"] and token
