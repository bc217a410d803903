"""The autoscaler keeps its policies' arrival history across restarts (fleet/controller/arrival_history.py,
fleet/k8s/arrival_history.py): a new loop primes each policy from the saved document, in the
controller's own clock; it saves every HISTORY_SAVE_S in wall-clock time; bad documents are
refused naming the field; the operator keeps the document in a ConfigMap it owns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.controller.arrival_history import HISTORY_SAVE_S, FileHistoryStore, History, HistoryError, decode, encode
from fleet.k8s.arrival_history import DATA_KEY, ConfigMapHistoryStore
from fleet.k8s.client import CONFIGMAPS, SERVICE_ACCOUNTS
from tests.support.fake_kube import FakeKube
from tests.unit.test_autoscaler_wiring import Fleet

FORECAST = {"forecast": {"binSeconds": 10, "seasonBins": 40, "refitSeconds": 60}}   # 3 seasons kept: 1,200 s
WALL_OFFSET_S = 1_700_000_000.0   # wall clock = the controller's (monotonic) clock + this


class MemoryStore:
    def __init__(self, saved: History | None = None) -> None:
        self.saved = saved or {}
        self.saves = 0

    async def load(self) -> History:
        return {k: list(v) for k, v in self.saved.items()}

    async def save(self, history: History) -> None:
        self.saves += 1
        self.saved = history


@pytest.fixture(autouse=True)
def _vllm(vllm_installed):  # vLLM counts as installed (tests/conftest.py)
    yield


async def test_a_new_loop_primes_the_forecast_and_saves_it_in_wall_clock_time(tmp_path: Path) -> None:
    now_wall = 1000.0 + WALL_OFFSET_S   # Harness clocks start at 1000 s
    saved = {"chat": [(now_wall - 80 + 10 * i, 1.0 + i) for i in range(8)], "gone": [(now_wall - 50, 9.0)]}
    store = MemoryStore(saved)
    h = Fleet(tmp_path, policy="standby", engine={"kind": "sim"}, standby={"maxReplicas": 1}, autoscaling=FORECAST)
    h.loop = type(h.loop)(h.c, router=h.pools, engine_api=h.engines, clock=h.clock, history=store,
                          wall_clock=lambda: h.clock() + WALL_OFFSET_S)  # fmt: skip
    h.offer(0.2, in_flight=2)
    await h.run(2)
    policy = h.loop.scaled["chat"].policy
    primed = [(t, r) for t, r in policy.history() if t < 1000.0]
    assert primed == [(920.0 + 10 * i, 1.0 + i) for i in range(8)]      # the saved bins, on the loop's clock
    assert store.saves == 0
    await h.run(HISTORY_SAVE_S)
    assert store.saves == 1
    rows = store.saved["chat"]
    assert rows[:8] == [(t + WALL_OFFSET_S, r) for t, r in primed]     # back in wall-clock time
    assert rows[-1][0] > now_wall and rows[-1][1] > 0                   # and what it has seen since
    assert set(store.saved) == {"chat"}                                  # a deployment no longer here is dropped


async def test_an_unreadable_history_starts_the_forecast_empty(tmp_path: Path, caplog) -> None:
    class Broken(MemoryStore):
        async def load(self) -> History:
            raise HistoryError("arrival-history.json: version: expected 1")

    h = Fleet(tmp_path, policy="standby", engine={"kind": "sim"}, standby={"maxReplicas": 1}, autoscaling=FORECAST)
    h.loop = type(h.loop)(h.c, router=h.pools, engine_api=h.engines, clock=h.clock, history=Broken(),
                          on_decision=lambda n, d: h.decisions.append(d))  # fmt: skip
    await h.run(2)
    assert h.decisions                                                  # the loop decides on
    assert "arrival history not restored" in caplog.text and "version: expected 1" in caplog.text
    assert h.loop.scaled["chat"].primed and all(t >= 1000.0 for t, _ in h.loop.scaled["chat"].policy.history())


async def test_the_file_store_round_trips_and_refuses_bad_documents(tmp_path: Path) -> None:
    store = FileHistoryStore(tmp_path / "arrival-history.json")
    assert await store.load() == {}
    history = {"chat": [(1_700_000_000.0, 2.5), (1_700_001_800.0, 0.0)]}
    await store.save(history)
    assert await store.load() == history
    assert not list(tmp_path.glob(".*.tmp"))
    for doc, field in (("[]", "version"), ('{"version": 1}', "deployments"),
                       ('{"version": 1, "deployments": {"chat": [[1, -2]]}}', "deployments.chat[0]"),
                       ('{"version": 1, "deployments": {"chat": [["t", 2]]}}', "deployments.chat[0]"),
                       ('{"version": 1, "deployments": {"chat": 3}}', "deployments.chat")):  # fmt: skip
        with pytest.raises(HistoryError, match=rf"arrival-history.json: {field.replace('[', '.').replace(']', '.')}"):
            decode(doc, "arrival-history.json")
    assert json.loads(encode(history))["deployments"]["chat"][0] == [1_700_000_000.0, 2.5]


async def test_the_operator_keeps_it_in_a_configmap_its_service_account_owns() -> None:
    kube = FakeKube()
    sa = kube.store.create(SERVICE_ACCOUNTS, "fleet", {"metadata": {"name": "fleet-operator", "namespace": "fleet"}})
    store = ConfigMapHistoryStore(kube, "fleet", "fleet-operator-arrival-history", "fleet-operator")
    assert await store.load() == {}
    await store.save({"chat": [(1.0, 2.0)]})
    cm = await kube.get(CONFIGMAPS, "fleet", "fleet-operator-arrival-history")
    assert cm["metadata"]["ownerReferences"][0]["uid"] == sa["metadata"]["uid"]
    await store.save({"chat": [(1.0, 2.0), (2.0, 3.0)]})                 # replaced in place
    assert await store.load() == {"chat": [(1.0, 2.0), (2.0, 3.0)]}
    cm = await kube.get(CONFIGMAPS, "fleet", "fleet-operator-arrival-history")
    await kube.replace(CONFIGMAPS, "fleet", cm["metadata"]["name"], {**cm, "data": {DATA_KEY: "{"}})
    with pytest.raises(HistoryError, match="ConfigMap fleet/fleet-operator-arrival-history history.json: not JSON"):
        await store.load()
