"""Per-revision request records (router.stats.request_log) through the real proxy: TTFT and TPOT of
streamed replies only, failures counted, the window, the admin endpoint and the controller's
client (`fleet.controller.router_admin.RouterAdminClient.revision_samples`)."""

from __future__ import annotations

import aiohttp
import pytest

from fleet.controller.router_admin import RouterAdminClient, RouterAdminError
from router.http.app import create_app
from router.stats.request_log import RequestLog
from tests.support.router import FakeEngine, running_app

TOKEN = "t"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_request_log_window_ring_and_row_layout():
    log = RequestLog(capacity=3)
    for t in (1.0, 2.0, 3.0, 4.0):
        log.record(t, "v1", "e0", ttft_s=0.1, tpot_s=None, e2e_s=0.5, queue_time_s=0.0, failed=False)
    assert [r[2] for r in log.rows(4.0, 10.0)] == [2.0, 1.0, 0.0]      # oldest overwritten; ages
    assert log.rows(4.0, 1.5) == [["v1", "e0", 1.0, 0.1, None, 0.5, 0.0, False],
                                  ["v1", "e0", 0.0, 0.1, None, 0.5, 0.0, False]]
    with pytest.raises(ValueError):
        RequestLog(0)


async def test_the_proxy_records_each_request_by_revision_and_the_client_reads_them():
    async with FakeEngine("stable", chunks=5, event_interval_s=0.01) as stable, FakeEngine("canary", chunks=5, status=500) as canary:
        app = create_app(TOKEN)
        async with running_app(app) as base, aiohttp.ClientSession(base, timeout=aiohttp.ClientTimeout(10)) as c:
            doc = {"policy": "round-robin", "endpoints": [
                {"id": "s-0", "url": stable.url, "version": "v1@aaaa", "weight": 50},
                {"id": "c-0", "url": canary.url, "version": "v2@bbbb", "weight": 50}]}
            async with c.put("/admin/v1/pools/m", json=doc, headers=AUTH) as r:
                assert r.status == 200
            for stream in (True, True, False, False):
                async with c.post("/v1/completions", json={"model": "m", "prompt": "hi", "stream": stream}) as r:
                    await r.read()
            async with c.get("/admin/v1/revisions/m", params={"window_s": 60}, headers=AUTH) as r:
                assert r.status == 200
                rows = (await r.json())["rows"]
            async with c.get("/admin/v1/revisions/none", headers=AUTH) as r:
                assert r.status == 404
            async with c.get("/admin/v1/stats", headers=AUTH) as r:
                revisions = (await r.json())["models"]["m"]["revisions"]
            client = RouterAdminClient(base, TOKEN)
            try:
                samples = await client.revision_samples("m", 60.0)
                with pytest.raises(RouterAdminError, match="HTTP 404"):
                    await client.revision_samples("none", 60.0)
            finally:
                await client.aclose()
    # The canary's non-streamed 500 was retried on stable (router.request.proxy: a 5xx before anything was
    # sent): the canary's failure is a row, and so is the retry's success.
    assert len(rows) == 5 and len(samples) == 5
    by_version: dict[str, list] = {}
    for s in samples:
        by_version.setdefault(s.version, []).append(s)
    ok = by_version["v1@aaaa"]
    assert [s.error for s in ok] == [False, False, False] and all(s.endpoint == "s-0" for s in ok)
    streamed = [s for s in ok if s.ttft_s is not None]
    assert len(streamed) == 1                                  # the non-streamed reply has no TTFT
    assert streamed[0].tpot_s is not None and streamed[0].tpot_s >= 0 and streamed[0].e2e_s >= streamed[0].ttft_s
    assert all(s.e2e_s is not None and 0 <= s.age_s < 60 for s in ok)
    bad = by_version["v2@bbbb"]
    assert [s.error for s in bad] == [True, True] and all(s.ttft_s is None for s in bad)
    # The same per revision in the windowed statistics: TTFT and TPOT of the one streamed success.
    assert revisions["v1@aaaa"]["requests"] == 3 and revisions["v1@aaaa"]["errors"] == 0
    assert revisions["v1@aaaa"]["ttft_s"]["samples"] == 1 and revisions["v1@aaaa"]["tpot_s"]["samples"] == 1
    assert revisions["v1@aaaa"]["e2e_s"]["samples"] == 3
    assert revisions["v2@bbbb"]["errors"] == 2 and revisions["v2@bbbb"]["ttft_s"]["samples"] == 0
