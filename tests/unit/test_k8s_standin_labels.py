"""The API-server stand-in refuses the labels a real API server refuses, in its words
(fleet/testing/k8s/validation.py, fleet/testing/k8s/apiserver.py): the NVLink-domain label's
``0-1;2-3`` is 422 Invalid naming ``metadata.labels``, on create, update and merge patch; legal
keys and values, and a patch deleting a label, go through. The expected words are apimachinery's
(``IsValidLabelValue``, ``IsQualifiedName``, ``NewInvalid``) as kube-apiserver 1.20 prints them,
with `RegexError`'s two spaces before each "or"."""

from __future__ import annotations

import aiohttp
import pytest

from fleet.k8s.client import NODES, PODS
from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.nodes import node
from fleet.testing.k8s.validation import label_value_errors, qualified_name_errors

VALUE_RULE = ("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and "
              "must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', "
              "regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')")  # fmt: skip
NAME_RULE = ("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
             "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
             "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')")  # fmt: skip
MERGE = {"Content-Type": "application/merge-patch+json"}


def test_the_rules_in_the_real_servers_words():
    assert label_value_errors("0-1;2-3") == [VALUE_RULE]
    assert label_value_errors("0-1_2-3") == [] and label_value_errors("") == [] and label_value_errors("none") == []
    assert label_value_errors("x" * 64) == ["must be no more than 63 characters"]
    assert label_value_errors("-a") == [VALUE_RULE]
    assert qualified_name_errors("fleet.inference.dev/nvlink-domains") == []
    assert qualified_name_errors("fleet.inference.dev/nvlink;domains") == [NAME_RULE]
    assert qualified_name_errors("Fleet.dev/x") == [
        "prefix part a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', "
        "and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is "
        "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"]
    assert qualified_name_errors("/x") == ["prefix part must be non-empty"]
    assert qualified_name_errors("a/b/c")[0].startswith("a qualified name must consist of")
    assert qualified_name_errors("k" * 64) == ["name part must be no more than 63 characters"]
    assert qualified_name_errors(f"{'a' * 254}/k")[0] == "prefix part must be no more than 253 characters"


async def test_the_stand_in_refuses_an_illegal_label_value_as_the_real_server_does():
    api = APIServerStandIn()
    await api.start()
    api.store.create(NODES, None, node("gpu-a", gpus=4))
    url = f"{api.url}/api/v1/nodes/gpu-a"

    def nvlink_label() -> str:
        return api.store.get(NODES, None, "gpu-a")["metadata"]["labels"]["fleet.inference.dev/nvlink-domains"]

    try:
        async with aiohttp.ClientSession() as http:
            patch = {"metadata": {"labels": {"fleet.inference.dev/nvlink-domains": "0-1;2-3"}}}
            async with http.patch(url, json=patch, headers=MERGE) as r:
                status, body = r.status, await r.json()
            assert status == 422 and body["reason"] == "Invalid" and body["code"] == 422
            assert body["message"] == (f'Node "gpu-a" is invalid: metadata.labels: Invalid value: "0-1;2-3": '
                                       f'{VALUE_RULE}')
            assert body["details"]["causes"] == [{"reason": "FieldValueInvalid", "field": "metadata.labels",
                                                  "message": f'Invalid value: "0-1;2-3": {VALUE_RULE}'}]  # fmt: skip
            # the whole patch is refused: the node keeps what it had
            assert nvlink_label() == "0-3"

            patch = {"metadata": {"labels": {"fleet.inference.dev/nvlink-domains": "0-1_2-3", "stale": None},
                                  "annotations": {"fleet.inference.dev/cached": "hf://org/m@main,s3://b/k"}}}
            async with http.patch(url, json=patch, headers=MERGE) as r:
                assert r.status == 200, await r.text()
            assert nvlink_label() == "0-1_2-3"

            # two problems at once: a bad key and a value too long, listed as the real server lists them
            patch = {"metadata": {"labels": {"a;b": "ok", "long": "v" * 64}}}
            async with http.patch(url, json=patch, headers=MERGE) as r:
                status, body = r.status, await r.json()
            assert status == 422
            assert body["message"] == ('Node "gpu-a" is invalid: [metadata.labels: Invalid value: "a;b": '
                                       f'{NAME_RULE}, metadata.labels: Invalid value: "{"v" * 64}": must be no more '
                                       'than 63 characters]')  # fmt: skip

            # create and update (PUT) are checked too
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"x": "a,b"}},
                   "spec": {"containers": [{"name": "c", "image": "i"}]}}
            async with http.post(f"{api.url}/api/v1/namespaces/fleet/pods", json=pod) as r:
                status, body = r.status, await r.json()
            assert status == 422
            assert body["message"].startswith('Pod "p" is invalid: metadata.labels: Invalid value: "a,b"')
            assert not api.store.list(PODS, "fleet", None)[0]
            current = api.store.get(NODES, None, "gpu-a")
            current["metadata"]["labels"]["nvidia.com/gpu.product"] = "NVIDIA H100 80GB HBM3"
            async with http.put(url, json=current) as r:
                status, body = r.status, await r.json()
            assert status == 422 and 'Invalid value: "NVIDIA H100 80GB HBM3"' in body["message"]
    finally:
        await api.stop()


@pytest.mark.parametrize("value", ["0-7", "0-1_2-3", "0.2-3_5", "none", ""])
def test_the_agents_spellings_are_legal(value):
    assert label_value_errors(value) == []
