"""The in-repo fake of the cluster wrapper keeps the API server semantics Fleet relies on
(fleet/testing/k8s/store.py): if it did not, the backend and operator tests above it would prove little."""

from __future__ import annotations

import asyncio

import pytest

from fleet.k8s.client import INFERENCE_DEPLOYMENTS, PODS, Conflict, Gone, NotFound
from tests.support.fake_kube import FakeKube, forbid_raw_client
from tests.support.waits import async_wait_until
from fleet.testing.k8s.store import ObjectStore, merge_patch, parse_selector, selector_matches

NS = "ns"


def _pod(name, **labels):
    return {"metadata": {"name": name, "labels": labels}, "spec": {"nodeName": "n1", "containers": []}}


async def test_resource_version_and_conflicts():
    kube = FakeKube()
    a = await kube.create(PODS, NS, _pod("a"))
    with pytest.raises(Conflict) as err:
        await kube.create(PODS, NS, _pod("a"))
    assert err.value.reason == "AlreadyExists"
    b = await kube.patch(PODS, NS, "a", {"metadata": {"labels": {"x": "1"}}})
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"])
    with pytest.raises(Conflict):   # a write based on the old version
        await kube.replace(PODS, NS, "a", a)
    same = await kube.patch(PODS, NS, "a", {"metadata": {"labels": {"x": "1"}}})
    assert same["metadata"]["resourceVersion"] == b["metadata"]["resourceVersion"]   # no-op: no new version
    with pytest.raises(NotFound):
        await kube.get(PODS, NS, "nope")


async def test_status_subresource_and_generation():
    kube = FakeKube()
    obj = await kube.create(INFERENCE_DEPLOYMENTS, NS, {"metadata": {"name": "d"}, "spec": {"a": 1}, "status": {"x": 1}})
    assert "status" not in obj and obj["metadata"]["generation"] == 1
    obj = await kube.patch_status(INFERENCE_DEPLOYMENTS, NS, "d", {"status": {"observedGeneration": 1}})
    assert obj["status"] == {"observedGeneration": 1} and obj["metadata"]["generation"] == 1
    obj = await kube.patch(INFERENCE_DEPLOYMENTS, NS, "d", {"spec": {"a": 2}, "status": {"observedGeneration": 9}})
    assert obj["metadata"]["generation"] == 2 and obj["status"] == {"observedGeneration": 1}


def test_label_selectors():
    labels = {"app": "x", "tier": "web"}
    assert selector_matches(parse_selector("app=x,tier in (web, db),!gone,tier"), labels)
    assert not selector_matches(parse_selector("app!=x"), labels)
    assert not selector_matches(parse_selector("tier notin (web)"), labels)
    store = ObjectStore()
    store.create(PODS, NS, _pod("a", app="x"))
    store.create(PODS, NS, _pod("b", app="y"))
    store.create(PODS, "other", _pod("c", app="x"))
    assert [p["metadata"]["name"] for p in store.list(PODS, NS, "app=x")[0]] == ["a"]
    assert sorted(p["metadata"]["name"] for p in store.list(PODS, None, "app=x")[0]) == ["a", "c"]


async def test_watch_replays_after_a_version_filters_and_bookmarks():
    kube = FakeKube()
    await kube.create(PODS, NS, _pod("a", app="x"))
    _, rv = await kube.list(PODS, NS)
    await kube.create(PODS, NS, _pod("b", app="x"))
    await kube.create(PODS, NS, _pod("c", app="y"))
    await kube.delete(PODS, NS, "b", grace_period_s=0)
    seen = []
    async for ev in kube.watch(PODS, NS, rv, label_selector="app=x", timeout_s=0.2):
        seen.append((ev.type, ev.object["metadata"].get("name")))
    assert seen == [("ADDED", "b"), ("DELETED", "b"), ("BOOKMARK", None)]


async def test_watch_delivers_live_events():
    kube = FakeKube()
    _, rv = await kube.list(PODS, NS)
    got = []

    async def consume():
        async for ev in kube.watch(PODS, NS, rv, timeout_s=5):
            got.append(ev.type)
            if len(got) == 2:
                return

    task = asyncio.create_task(consume())
    await async_wait_until(lambda: kube.store.watchers, 10, what="the watch to be open")   # events from now on are live
    await kube.create(PODS, NS, _pod("a"))
    await kube.patch(PODS, NS, "a", {"metadata": {"labels": {"y": "1"}}})
    await asyncio.wait_for(task, 5)
    assert got == ["ADDED", "MODIFIED"]


def test_too_old_version_is_gone():
    store = ObjectStore(history=3)
    for i in range(6):
        store.create(PODS, NS, _pod(f"p{i}"))
    with pytest.raises(Gone):
        store.subscribe(PODS, NS, "1", None)


def test_graceful_delete_and_owner_cascade():
    store = ObjectStore()
    owner = store.create(INFERENCE_DEPLOYMENTS, NS, {"metadata": {"name": "d"}, "spec": {}})
    pod = _pod("p")
    pod["metadata"]["ownerReferences"] = [{"uid": owner["metadata"]["uid"], "name": "d"}]
    store.create(PODS, NS, pod)
    store.delete(INFERENCE_DEPLOYMENTS, NS, "d")
    assert store.get(PODS, NS, "p")["metadata"]["deletionTimestamp"]   # graceful: the kubelet finishes it
    store.finish_delete(PODS, NS, "p")
    assert store.list(PODS, NS, None)[0] == []


def test_merge_patch_rfc7386():
    assert merge_patch({"a": 1, "b": {"c": 2, "d": 3}}, {"b": {"c": None, "e": 4}, "f": [1]}) == {
        "a": 1, "b": {"d": 3, "e": 4}, "f": [1]}


def test_raw_client_is_refused(monkeypatch):
    forbid_raw_client(monkeypatch)
    from fleet.k8s.client import KubeClient

    client = KubeClient.for_host("http://127.0.0.1:1")
    with pytest.raises(AssertionError, match="raw kubernetes client"):
        asyncio.run(client.list(PODS, NS))


def test_the_stand_in_serves_the_core_kinds_a_chart_holds():
    """Secrets (the router admin token), ConfigMaps and ServiceAccounts: namespaced core v1, as
    the API server serves them (the HTTP stand-in routes by these: fleet/testing/k8s/apiserver.py)."""
    from fleet.k8s.client import SECRETS
    from fleet.testing.k8s.apiserver import _BY_PATH
    from fleet.testing.k8s.resources import CONFIGMAPS, SERVICE_ACCOUNTS

    store = ObjectStore()
    for res, kind in ((SECRETS, "Secret"), (CONFIGMAPS, "ConfigMap"), (SERVICE_ACCOUNTS, "ServiceAccount")):
        assert _BY_PATH[("", "v1", res.plural)] is res and res.kind == kind and res.namespaced
        assert res.path(NS, "x") == f"/api/v1/namespaces/{NS}/{res.plural}/x"
        store.create(res, NS, {"metadata": {"name": "x"}})
        assert store.get(res, NS, "x")["metadata"]["namespace"] == NS
        with pytest.raises(NotFound):
            store.get(res, "other", "x")
