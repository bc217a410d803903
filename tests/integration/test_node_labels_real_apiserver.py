"""Integration: the node agent's facts patch on a REAL kube-apiserver 1.20.2 (fleet/testing/k8s/kube.py),
and the API-server stand-in refusing labels in the real server's words.

- The NVLink domains of an NVLink-pairs node, as `fleet.k8s.node_facts` writes them (``0-1_2-3``),
  are accepted by the real server's label validation and read back as the same domains; the
  spelling with ``;`` is refused (422) there, which is why the agent does not write it.
- For the same refused patches, the stand-in (fleet/testing/k8s/apiserver.py) answers with the
  same status, reason and message as the real server, so the cluster in a box fails where a
  real cluster would.

Skips, saying why, where the control plane is not built (`tests/run.sh` builds it:
``python -m fleet.testing.k8s.kube build``) or does not start; ``FLEET_KUBE=skip`` switches it off.
"""

from __future__ import annotations

from collections.abc import Iterator

import aiohttp
import pytest

from fleet.inventory.gfd import node_from_k8s
from fleet.inventory.nvml import node_from_nvml
from fleet.k8s.client import NODES, ApiError
from fleet.k8s.node_facts import NVLINK_DOMAINS_LABEL, NodeFactsPublisher, node_facts
from fleet.testing.fake_nvml import nvlink_pairs_4gpu
from fleet.testing.k8s.apiserver import APIServerStandIn
from fleet.testing.k8s.kube import BUILD_TIMEOUT_S, RealControlPlane
from fleet.testing.k8s.nodes import node
from tests.support.real_kube import control_plane as start_control_plane

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 300)   # the first test may build the control plane
NODE = "gpu-pairs"


@pytest.fixture(scope="module")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealControlPlane]:
    yield from start_control_plane(tmp_path_factory.mktemp("kube"))


REFUSED = [
    {"metadata": {"labels": {NVLINK_DOMAINS_LABEL: "0-1;2-3"}}},      # the spelling with ';' and ','
    {"metadata": {"labels": {NVLINK_DOMAINS_LABEL: "0," + "1" * 63}}},  # too long, and a ','
    {"metadata": {"labels": {"fleet.inference.dev/nvlink;domains": "0-7"}}},
    {"metadata": {"labels": {"Fleet.dev/x": "y"}}},
]


async def _standin_answers(patches: list[dict]) -> list[tuple[int, str, str]]:
    api = APIServerStandIn()
    await api.start()
    api.store.create(NODES, None, node(NODE, gpus=4))
    out = []
    try:
        async with aiohttp.ClientSession() as http:
            for patch in patches:
                async with http.patch(f"{api.url}/api/v1/nodes/{NODE}", json=patch,
                                      headers={"Content-Type": "application/merge-patch+json"}) as r:  # fmt: skip
                    body = await r.json()
                out.append((r.status, body.get("reason", ""), body.get("message", "")))
    finally:
        await api.stop()
    return out


async def test_the_agents_nvlink_label_is_accepted_and_the_stand_in_refuses_as_the_real_server(control_plane):
    kube = control_plane.client()
    await kube.create(NODES, None, node(NODE, gpus=4))
    domains = node_from_nvml(nvlink_pairs_4gpu(), NODE).nvlink_domains
    facts = node_facts({"quarantined": [], "health_checks": True}, [], {}, ["hf://org/m@main"], domains)
    assert facts.nvlink_domains == "0-1_2-3"
    assert await NodeFactsPublisher(kube, NODE).publish(facts)   # the real server's validation passes it
    obj = await kube.get(NODES, None, NODE)
    assert obj["metadata"]["labels"][NVLINK_DOMAINS_LABEL] == "0-1_2-3"
    assert node_from_k8s(obj).nvlink_domains == ((0, 1), (2, 3))

    real = []
    for patch in REFUSED:
        with pytest.raises(ApiError) as err:
            await kube.patch(NODES, None, NODE, patch)
        real.append((err.value.status, err.value.reason, err.value.message))
    assert real[0][:2] == (422, "Invalid") and 'Invalid value: "0-1;2-3"' in real[0][2], real[0]
    assert await _standin_answers(REFUSED) == real
    # nothing of a refused patch was written
    assert (await kube.get(NODES, None, NODE))["metadata"]["labels"][NVLINK_DOMAINS_LABEL] == "0-1_2-3"
