"""Integration: the chart's InferenceDeployment CRD served by a REAL ``apiextensions-apiserver``
over a real etcd (fleet/testing/k8s/apiext.py), through Fleet's own `KubeClient` on the official
`kubernetes` client. Admission (schema, enums, patterns, CEL rules, defaults, pruning), the
status subresource, generation, resourceVersion conflicts, watch and finalizers are Kubernetes'
own code here, not a stand-in's.

The semantics Fleet's operator relies on (status subresource, generation, 409, watch,
finalizers, label selectors) run twice: on the real server and on the API-server stand-in
(fleet/testing/k8s/apiserver.py), so the stand-in cannot drift from the real thing unnoticed.
Admission runs on the real server only: the stand-in does no schema validation, defaulting or
pruning (docs/kubernetes.md).

Skips, saying why, when the real server cannot be built here (Debian unstable unreachable or
changed, no apt) or cannot start. `tests/run.sh` builds it before the tiers (``python -m
fleet.testing.k8s.apiext build``, bounded) and the build is cached; run alone, the first test
builds it (minutes). ``FLEET_APIEXT=skip`` switches the layer off.
"""

from __future__ import annotations

import asyncio
import copy
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from fleet.base.rules import walk_rules
from fleet.k8s.client import CRDS, INFERENCE_DEPLOYMENTS, ApiError, Conflict, KubeClient, NotFound, Resource
from fleet.k8s.crd import CHART_FILES, CRD_NAME, GROUP, KIND, PLURAL, VERSION, crd_document
from fleet.spec import DeploymentSpec, InferenceDeployment, SpecError, parse_document
from fleet.testing.k8s.apiext import BUILD_TIMEOUT_S, RealApiExtensions, Unavailable, build, built
from fleet.testing.k8s.apiserver import APIServerStandIn
from tests.support.helm import helm_binary, render
from tests.support.waits import async_wait_until

REPO = Path(__file__).resolve().parents[2]
NS = "fleet"
from tests.integration.test_operator_standin import CR  # noqa: E402 - the operator stand-in test's resource
# The first test may build the server (minutes) when tests/run.sh has not.
pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 120)


# ----- the servers ------------------------------------------------------------------------------


def chart_crd() -> dict:
    """The CRD as the chart renders it (`helm template`), or `fleet crd`'s when helm is missing
    (tests/unit/test_k8s_crd.py keeps the two the same)."""
    if helm_binary() is None:
        return crd_document()
    return next(d for d in render() if d["kind"] == "CustomResourceDefinition")


@pytest.fixture(scope="module")
def real_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealApiExtensions]:
    """The real API server with the chart's CRD installed and Established."""
    if os.environ.get("FLEET_APIEXT") == "skip":
        pytest.skip("FLEET_APIEXT=skip: the real apiextensions-apiserver layer is switched off")
    if (said := os.environ.get("FLEET_APIEXT_UNAVAILABLE")) and built() is None:
        pytest.skip(f"no real apiextensions-apiserver here (tests/run.sh's build step: {said})")
    try:
        binaries = build()
    except Unavailable as err:
        pytest.skip(f"no real apiextensions-apiserver here: {err}")
    try:
        server = RealApiExtensions(binaries, tmp_path_factory.mktemp("apiext")).__enter__()
    except Unavailable as err:
        pytest.skip(f"the real apiextensions-apiserver did not start: {err}")
    try:
        with ThreadPoolExecutor(1) as pool:   # its own loop: the first to ask may be inside one
            pool.submit(asyncio.run, _install_crd(server.client(), chart_crd())).result()
        yield server
    finally:
        server.__exit__(None, None, None)


async def _install_crd(kube: KubeClient, crd: dict) -> None:
    await kube.create(CRDS, None, crd)

    async def established() -> bool:
        conditions = ((await kube.get(CRDS, None, CRD_NAME)).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    await async_wait_until(established, timeout_s=30, what=f"CRD {CRD_NAME} Established")
    # Established is the CRD's condition; the endpoint answers a moment later.
    await async_wait_until(lambda: _lists(kube), timeout_s=30, what="the custom resource endpoint")


async def _lists(kube: KubeClient) -> bool:
    try:
        await kube.list(INFERENCE_DEPLOYMENTS, NS)
        return True
    except NotFound:
        return False


@pytest.fixture
async def real(real_server: RealApiExtensions) -> AsyncIterator[KubeClient]:
    kube = real_server.client()
    yield kube
    kube.close()


@pytest.fixture(params=["real", "standin"])
async def kube(request: pytest.FixtureRequest) -> AsyncIterator[KubeClient]:
    """`KubeClient` of the real server, then of the API-server stand-in: the same test on both."""
    if request.param == "real":
        client = request.getfixturevalue("real_server").client()
        yield client
        client.close()
        return
    standin = APIServerStandIn()
    await standin.start()
    client = KubeClient.for_host(standin.url)
    try:
        yield client
    finally:
        client.close()
        await standin.stop()


def resource(**spec_changes) -> dict:
    """`CR` under a fresh name, with ``spec_changes`` merged into its spec (top-level keys)."""
    body = copy.deepcopy(CR)
    body["metadata"]["name"] = f"t-{uuid.uuid4().hex[:8]}"
    body["spec"].update(spec_changes)
    return body


def name_of(obj: dict) -> str:
    return obj["metadata"]["name"]


# ----- the CRD and admission (real server only) ---------------------------------------------------


async def test_the_charts_crd_is_established_with_its_names(real):
    crd = await real.get(CRDS, None, CRD_NAME)
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions
    assert conditions.get("NonStructuralSchema") is None, "the real server finds the schema non-structural"
    assert crd["status"]["acceptedNames"]["shortNames"] == ["infd"]


async def test_a_valid_resource_is_admitted_and_defaulted_as_pydantic_defaults_it(real):
    created = await real.create(INFERENCE_DEPLOYMENTS, NS, resource())
    spec = created["spec"]
    # Defaults the schema gives, filled by the server where the parent object is present.
    assert spec["model"]["revision"] == "v1"
    assert spec["engine"]["imagePullPolicy"] == "IfNotPresent"
    assert spec["resources"]["tensorParallelSize"] == 1
    assert spec["warmup"]["enabled"] is True
    assert spec["warmup"]["requests"][0]["repeat"] == 1 and spec["warmup"]["requests"][0]["stream"] is False
    # An absent object is not made up (Kubernetes defaults fields of objects that exist): the
    # operator's pydantic parse fills those.
    assert "routing" not in spec and "autoscaling" not in spec
    # Every value the server holds is the value pydantic gives the same document.
    parsed = InferenceDeployment.model_validate(CR).model_dump(by_alias=True, mode="json")["spec"]
    assert _disagreements(spec, parsed) == []
    assert InferenceDeployment.model_validate({**created, "metadata": {"name": name_of(created)}})


def _disagreements(server: object, pydantic: object, path: str = "spec") -> list[str]:
    if isinstance(server, dict):
        return [d for k, v in server.items() for d in _disagreements(v, (pydantic or {}).get(k), f"{path}.{k}")]
    if isinstance(server, list):
        return [d for i, v in enumerate(server) for d in _disagreements(v, (pydantic or [None] * (i + 1))[i],
                                                                        f"{path}[{i}]")]  # fmt: skip
    return [] if server == pydantic else [f"{path}: server {server!r}, pydantic {pydantic!r}"]


def _example_resources() -> list[tuple[str, dict]]:
    out = []
    for path in sorted((REPO / "examples").rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if isinstance(doc, dict) and doc.get("kind") == "InferenceDeployment":
                out.append((str(path.relative_to(REPO)), doc))
    return out


async def test_every_example_resource_is_admitted(real):
    examples = _example_resources()
    assert len(examples) >= 3
    for where, doc in examples:
        body = copy.deepcopy(doc)
        body["metadata"] = {"name": f"ex-{uuid.uuid4().hex[:8]}"}
        try:
            created = await real.create(INFERENCE_DEPLOYMENTS, NS, body)
        except ApiError as err:
            pytest.fail(f"{where} refused by the real API server: {err}")
        assert created["spec"]["model"] == {**{"revision": "v1"}, **doc["spec"]["model"]}, where
        await real.delete(INFERENCE_DEPLOYMENTS, NS, name_of(created))


@pytest.mark.parametrize(("change", "field"), [
    ({"engine": {"kind": "nope"}}, "spec.engine.kind"),
    ({"routing": {"policy": "round-robin-ish"}}, "spec.routing.policy"),
    ({"replicas": {"min": 1, "max": "four"}}, "spec.replicas.max"),
    ({"replicas": {"min": -1, "max": 2}}, "spec.replicas.min"),
    ({"resources": {"accelerator": "gpu", "migProfile": "three-gigs"}}, "spec.resources.migProfile"),
    ({"model": {"source": "sim://h100-llama-8b"}}, "spec.model.name"),
    ({"engine": {"kind": "sim", "startupTimeoutSeconds": 0}}, "spec.engine.startupTimeoutSeconds"),
])  # fmt: skip
async def test_an_invalid_resource_is_refused_with_422_naming_the_field(real, change, field):
    with pytest.raises(ApiError) as refused:
        await real.create(INFERENCE_DEPLOYMENTS, NS, resource(**change))
    assert refused.value.status == 422 and refused.value.reason == "Invalid", refused.value
    assert field in refused.value.message, refused.value.message


async def test_a_status_write_is_checked_against_the_status_schema(real):
    created = await real.create(INFERENCE_DEPLOYMENTS, NS, resource())
    with pytest.raises(ApiError) as refused:
        await real.patch_status(INFERENCE_DEPLOYMENTS, NS, name_of(created),
                                {"status": {"conditions": [{"type": "Happy", "status": "True"}]}})  # fmt: skip
    assert refused.value.status == 422 and "status.conditions[0].type" in refused.value.message


async def test_unknown_fields_are_pruned_not_stored(real):
    body = resource()
    body["spec"]["engine"]["gpuMemoryUtilisation"] = 0.9   # a typo of a field that does not exist
    created = await real.create(INFERENCE_DEPLOYMENTS, NS, body)
    assert "gpuMemoryUtilisation" not in created["spec"]["engine"]


def _fleet_validate_says(change: dict) -> tuple[str, str]:
    """The field path and the reason of the one problem `fleet validate` finds in `CR` with
    ``change`` merged into its spec (what the API server must say too)."""
    body = copy.deepcopy(CR)
    body["spec"].update(copy.deepcopy(change))
    with pytest.raises(SpecError) as refused:
        parse_document(body)
    assert len(refused.value.problems) == 1, refused.value.problems
    path, _, reason = refused.value.problems[0].partition(": ")
    return path, reason


# Each `x-kubernetes-validations` rule of the CRD, keyed by its rule, with a spec change that
# breaks it and changes at its boundary that it admits: the examples the rule itself declares
# (fleet/base/rules.py), so a rule cannot reach the CRD without a case here.
CEL_CASES: dict[str, tuple[dict, tuple[dict, ...]]] = {
    rule.cel: (rule.breaks, rule.keeps) for _path, _model, rule in walk_rules(DeploymentSpec, "spec")
    if rule.cel is not None
}


def _cel_rules(node: object, path: str = "") -> list[tuple[str, str]]:
    if not isinstance(node, dict):
        return []
    found = [(path, r["rule"]) for r in node.get("x-kubernetes-validations", [])]
    for key, child in (node.get("properties") or {}).items():
        found += _cel_rules(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        found += _cel_rules(node["items"], f"{path}[]")
    return found


async def test_every_cel_rule_of_the_crd_refuses_with_fleet_validates_words(real):
    schema = chart_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = _cel_rules(schema)
    assert len(rules) == len(CEL_CASES) >= 22
    missing = [rule for _path, rule in rules if rule not in CEL_CASES]
    assert not missing, f"CEL rules without a case in CEL_CASES: {missing}"
    wrong = []
    for rule, (breaks, keeps) in CEL_CASES.items():
        path, reason = _fleet_validate_says(breaks)
        with pytest.raises(ApiError) as refused:
            await real.create(INFERENCE_DEPLOYMENTS, NS, resource(**copy.deepcopy(breaks)))
        said = refused.value.message
        # The server names the field and gives the same reason: `<path>: Invalid value: <reason>`.
        if refused.value.status != 422 or f"{path}: Invalid value: {reason}" not in said:
            wrong.append(f"{rule}\n  fleet validate: {path}: {reason}\n  API server:     {said}")
        for boundary in keeps:
            try:
                await real.create(INFERENCE_DEPLOYMENTS, NS, resource(**copy.deepcopy(boundary)))
            except ApiError as err:
                wrong.append(f"{rule}\n  refused its boundary {boundary}: {err.message}")
    assert not wrong, "\n".join(wrong)


async def test_the_crd_for_kubernetes_before_1_29_says_the_sentences_with_the_fields_named(real):
    """The chart's copy for 1.25-1.28 (no CEL format() there), installed under a group of its
    own beside the newest: established, and a refusal gives the sentence with each value's field
    in angle brackets."""
    crd = yaml.safe_load((REPO / "charts" / "fleet" / "files" / CHART_FILES[(1, 28)]).read_text())
    assert "messageExpression" not in yaml.safe_dump(crd)
    group = f"before-1-29.{GROUP}"
    crd["metadata"]["name"], crd["spec"]["group"] = f"{PLURAL}.{group}", group
    await real.create(CRDS, None, crd)
    old = Resource(group, VERSION, PLURAL, KIND)
    body = {**resource(replicas={"min": 3, "max": 2}), "apiVersion": f"{group}/{VERSION}"}

    async def refused() -> str:
        try:
            await real.create(old, NS, body)
        except NotFound:
            return ""   # the endpoint answers a moment after the CRD is created
        except ApiError as err:
            return err.message
        pytest.fail("the CRD for Kubernetes before 1.29 admitted min above max")

    said = await async_wait_until(refused, timeout_s=30, interval_s=0.2, what=f"{PLURAL}.{group} serving")
    assert "spec.replicas.min: Invalid value: must be <= spec.replicas.max (<min> > <max>)" in said, said


async def test_a_token_the_server_does_not_know_is_401_and_none_is_403(real_server):
    for token, status in (("not-the-token", 401), (None, 403)):
        kube = real_server.client(token)
        with pytest.raises(ApiError) as refused:
            await kube.list(INFERENCE_DEPLOYMENTS, NS)
        kube.close()
        assert refused.value.status == status


# ----- what the operator relies on, on both servers ---------------------------------------------


async def test_status_and_spec_writes_stay_apart_and_generation_counts_spec_changes(kube):
    created = await kube.create(INFERENCE_DEPLOYMENTS, NS, {**resource(), "status": {"readyReplicas": 9}})
    name = name_of(created)
    assert "status" not in created, "a create writes no status when the status subresource is on"
    assert created["metadata"]["generation"] == 1

    status = await kube.patch_status(INFERENCE_DEPLOYMENTS, NS, name,
                                     {"spec": {"replicas": {"max": 9}}, "status": {"readyReplicas": 1}})  # fmt: skip
    assert status["status"]["readyReplicas"] == 1
    assert status["spec"]["replicas"]["max"] == 4, "a status write changed spec"
    assert status["metadata"]["generation"] == 1, "a status write counted as a spec change"

    patched = await kube.patch(INFERENCE_DEPLOYMENTS, NS, name,
                               {"spec": {"replicas": {"max": 6}}, "status": {"readyReplicas": 7}})  # fmt: skip
    assert patched["spec"]["replicas"]["max"] == 6
    assert patched["status"]["readyReplicas"] == 1, "a main-resource write changed status"
    assert patched["metadata"]["generation"] == 2

    relabelled = await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"metadata": {"labels": {"team": "a"}}})
    assert relabelled["metadata"]["generation"] == 2, "a metadata write counted as a spec change"

    body = copy.deepcopy(relabelled)
    body["spec"]["replicas"]["max"] = 5
    body["status"] = {"readyReplicas": 3}
    replaced = await kube.replace(INFERENCE_DEPLOYMENTS, NS, name, body)
    assert replaced["spec"]["replicas"]["max"] == 5 and replaced["status"]["readyReplicas"] == 1
    assert replaced["metadata"]["generation"] == 3


async def test_a_stale_resource_version_is_a_409_conflict(kube):
    created = await kube.create(INFERENCE_DEPLOYMENTS, NS, resource())
    name = name_of(created)
    await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"spec": {"replicas": {"max": 3}}})
    stale = copy.deepcopy(created)
    stale["spec"]["replicas"]["max"] = 2
    with pytest.raises(Conflict) as refused:
        await kube.replace(INFERENCE_DEPLOYMENTS, NS, name, stale)
    assert refused.value.status == 409 and refused.value.reason == "Conflict"
    rv = created["metadata"]["resourceVersion"]
    with pytest.raises(Conflict):
        await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"metadata": {"resourceVersion": rv}, "spec": {"replicas": {"max": 2}}})
    with pytest.raises(Conflict):
        await kube.patch_status(INFERENCE_DEPLOYMENTS, NS, name,
                                {"metadata": {"resourceVersion": rv}, "status": {"readyReplicas": 1}})  # fmt: skip
    with pytest.raises(Conflict) as taken:
        await kube.create(INFERENCE_DEPLOYMENTS, NS, {**resource(), "metadata": {"name": name}})
    assert taken.value.reason == "AlreadyExists"
    current = await kube.get(INFERENCE_DEPLOYMENTS, NS, name)
    assert current["spec"]["replicas"]["max"] == 3


async def test_watch_delivers_added_modified_deleted_in_order(kube):
    _, rv = await kube.list(INFERENCE_DEPLOYMENTS, NS)
    name = name_of(resource())
    seen: list[tuple[str, int]] = []

    async def follow() -> None:
        async for event in kube.watch(INFERENCE_DEPLOYMENTS, NS, rv, timeout_s=30):
            if event.type != "BOOKMARK" and name_of(event.object) == name:
                seen.append((event.type, event.object["spec"]["replicas"]["max"]))
                if event.type == "DELETED":
                    return

    watcher = asyncio.create_task(follow())
    await kube.create(INFERENCE_DEPLOYMENTS, NS, {**resource(), "metadata": {"name": name}})
    await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"spec": {"replicas": {"max": 2}}})
    await kube.delete(INFERENCE_DEPLOYMENTS, NS, name)
    await asyncio.wait_for(watcher, timeout=30)
    assert seen == [("ADDED", 4), ("MODIFIED", 2), ("DELETED", 2)]


async def test_a_finalizer_holds_a_delete_until_it_is_removed(kube):
    body = resource()
    body["metadata"]["finalizers"] = ["fleet.inference.dev/drain"]
    name = name_of(await kube.create(INFERENCE_DEPLOYMENTS, NS, body))
    await kube.delete(INFERENCE_DEPLOYMENTS, NS, name)
    held = await kube.get(INFERENCE_DEPLOYMENTS, NS, name)
    assert held["metadata"].get("deletionTimestamp"), "a delete of an object with a finalizer marks it"
    # A spec change is still accepted while deleting (the operator drains then lets go).
    with_spec = await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"spec": {"replicas": {"max": 3}}})
    assert with_spec["spec"]["replicas"]["max"] == 3
    await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"metadata": {"finalizers": None}})

    async def gone() -> bool:
        try:
            await kube.get(INFERENCE_DEPLOYMENTS, NS, name)
            return False
        except NotFound:
            return True

    await async_wait_until(gone, timeout_s=10, what=f"{name} deleted once its finalizer went")


async def test_list_filters_by_label_selector(kube):
    a, b = resource(), resource()
    a["metadata"]["labels"] = {"team": "search", "tier": "gold"}
    b["metadata"]["labels"] = {"team": "ads"}
    await kube.create(INFERENCE_DEPLOYMENTS, NS, a)
    await kube.create(INFERENCE_DEPLOYMENTS, NS, b)
    for selector, want in (("team=search", {name_of(a)}), ("team in (search,ads)", {name_of(a), name_of(b)}),
                           ("team,!tier", {name_of(b)}), ("team!=search,team", {name_of(b)})):  # fmt: skip
        items, _ = await kube.list(INFERENCE_DEPLOYMENTS, NS, selector)
        assert {name_of(o) for o in items} & {name_of(a), name_of(b)} == want, selector


async def test_writes_the_real_server_refuses_are_refused(kube):
    """Where the stand-in once said yes and the real server says no."""
    with_rv = resource()
    with_rv["metadata"]["resourceVersion"] = "123"
    with pytest.raises(ApiError) as refused:
        await kube.create(INFERENCE_DEPLOYMENTS, NS, with_rv)
    assert refused.value.status == 500 and "resourceVersion should not be set" in refused.value.message

    created = await kube.create(INFERENCE_DEPLOYMENTS, NS, resource())
    unconditional = copy.deepcopy(created)
    del unconditional["metadata"]["resourceVersion"]
    with pytest.raises(ApiError) as refused:
        await kube.replace(INFERENCE_DEPLOYMENTS, NS, name_of(created), unconditional)
    assert refused.value.status == 422 and "metadata.resourceVersion" in refused.value.message

    held = resource()
    held["metadata"]["finalizers"] = ["fleet.inference.dev/drain"]
    name = name_of(await kube.create(INFERENCE_DEPLOYMENTS, NS, held))
    await kube.delete(INFERENCE_DEPLOYMENTS, NS, name)
    marked = await kube.get(INFERENCE_DEPLOYMENTS, NS, name)
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 0
    with pytest.raises(ApiError) as refused:
        await kube.patch(INFERENCE_DEPLOYMENTS, NS, name,
                         {"metadata": {"finalizers": ["fleet.inference.dev/drain", "fleet.inference.dev/late"]}})  # fmt: skip
    assert refused.value.status == 422 and "metadata.finalizers" in refused.value.message
    await kube.patch(INFERENCE_DEPLOYMENTS, NS, name, {"metadata": {"finalizers": None}})


async def test_a_watch_from_no_version_starts_with_what_is_there(kube):
    """resourceVersion "": one ADDED per object there now, no replay of its history."""
    gone, kept = resource(), resource()
    await kube.create(INFERENCE_DEPLOYMENTS, NS, gone)
    await kube.patch(INFERENCE_DEPLOYMENTS, NS, name_of(gone), {"spec": {"replicas": {"max": 2}}})
    await kube.delete(INFERENCE_DEPLOYMENTS, NS, name_of(gone))
    await kube.create(INFERENCE_DEPLOYMENTS, NS, kept)
    await kube.patch(INFERENCE_DEPLOYMENTS, NS, name_of(kept), {"spec": {"replicas": {"max": 3}}})
    items, _ = await kube.list(INFERENCE_DEPLOYMENTS, NS)
    seen: list[tuple[str, str]] = []

    async def follow() -> None:
        async for event in kube.watch(INFERENCE_DEPLOYMENTS, NS, "", timeout_s=30):
            if event.type != "BOOKMARK":
                seen.append((event.type, name_of(event.object)))
            if len(seen) == len(items):
                return

    await asyncio.wait_for(follow(), timeout=30)
    assert sorted(seen) == sorted(("ADDED", name_of(o)) for o in items)
