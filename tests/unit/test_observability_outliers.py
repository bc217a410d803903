"""`fleet status`'s notes on ejected and stalling replicas (fleet.observability.outliers), from a
real router's `GET /admin/v1/pools`."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.observability.outliers import outlier_notes, read_outlier_notes
from router.http.app import create_app
from router.pools.outlier import Outcome
from router.pools.spec import PoolSpec
from tests.support.router import dead_endpoint, running_app

TOKEN = "test-admin-token"


def test_notes_name_ejected_and_stalling_endpoints_only() -> None:
    pools = {"m": {"endpoints": [
        {"id": "chat-0", "ejected": True, "ejected_for_s": 27.4, "ejection_reason": "stall", "ejections_total": 2,
         "stalls_total": 5, "consecutive_stalls": 0},
        {"id": "chat-1", "ejected": False, "consecutive_stalls": 1},
        {"id": "chat-2", "ejected": False, "consecutive_stalls": 0},
        {"id": "old-router-endpoint", "in_flight": 0},
    ]}, "broken": "not a pool"}  # fmt: skip
    assert outlier_notes(pools) == {
        "chat-0": "ejected by the router for 27 s more: no first token within the deadline (ejection 2, "
                  "5 stall(s) in all)",
        "chat-1": "stalling: 1 first-token timeout(s) in a row",
    }  # fmt: skip


@pytest.mark.asyncio
async def test_read_from_a_live_router_and_nothing_when_it_cannot_be_asked() -> None:
    app = create_app(TOKEN, clock=time.perf_counter)
    async with running_app(app) as base:
        spec = PoolSpec.model_validate({"endpoints": [{"id": "chat-0", "url": "http://127.0.0.1:1"},
                                                      {"id": "chat-1", "url": "http://127.0.0.1:2"}]})  # fmt: skip
        pool = app.pools.put("chat-model", spec)
        now_s = time.perf_counter()
        assert not pool.record_outcome(pool.endpoints[0], Outcome.STALL, now_s)
        assert pool.record_outcome(pool.endpoints[0], Outcome.STALL, now_s)
        notes = await asyncio.to_thread(read_outlier_notes, base, TOKEN)
        assert notes["chat-0"].startswith("ejected by the router for 30 s more: no first token within the deadline")
        assert "chat-1" not in notes
        assert await asyncio.to_thread(read_outlier_notes, base, "wrong-token") == {}
    sock, url = dead_endpoint()
    try:
        assert await asyncio.to_thread(read_outlier_notes, url, TOKEN) == {}
    finally:
        sock.close()
