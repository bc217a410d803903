"""The shared load signal: vLLM's load gauges parsed, the estimate of what other routers sent,
kv-aware reading it while fresh, and the poller that feeds it (router.signals.engine_load,
router.signals.engine_poll, router.pools.policies.KvAware)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from router.pools.endpoint import EndpointState
from router.signals.engine_load import EngineLoad, EngineLoadError, EngineLoadView, parse_engine_load
from router.signals.engine_poll import EnginePoller, PollFailed
from router.pools.policies import KvAware
from router.kv.prompt_blocks import route_request
from tests.support.waits import async_wait_until

DATA = Path(__file__).resolve().parents[1] / "data"


def test_parses_a_real_vllm_scrape() -> None:
    idle = parse_engine_load((DATA / "vllm-0.32-metrics.txt").read_text())
    assert (idle.waiting, idle.running, idle.kv_cache_usage) == (0.0, 0.0, 0.0)
    busy = parse_engine_load((DATA / "vllm-0.32-metrics-busy.txt").read_text())
    assert (busy.waiting, busy.running) == (11.0, 2.0)
    assert busy.prefill_tokens is None and busy.prefilling is None


def test_sums_engines_maxes_usage_and_filters_by_model() -> None:
    text = "\n".join([
        "# TYPE vllm:num_requests_waiting gauge",
        'vllm:num_requests_waiting{engine="0",model_name="m"} 2',
        'vllm:num_requests_waiting{engine="1",model_name="m"} 3',
        'vllm:num_requests_waiting{engine="0",model_name="other"} 50',
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 4',
        'vllm:num_requests_running{engine="1",model_name="m"} 1',
        "# TYPE vllm:kv_cache_usage_perc gauge",
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
        'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75',
        "# TYPE vllm:num_requests_waiting_by_reason gauge",
        'vllm:num_requests_waiting_by_reason{engine="0",model_name="m",reason="capacity"} 99',
    ])  # fmt: skip
    load = parse_engine_load(text, model_name="m")
    assert (load.waiting, load.running, load.kv_cache_usage) == (5.0, 5.0, 0.75)
    assert parse_engine_load(text).waiting == 55.0


@pytest.mark.parametrize("text", ["not { prometheus", "# TYPE x gauge\nx 1\n", ""])
def test_a_text_without_the_gauges_is_an_error(text: str) -> None:
    with pytest.raises(EngineLoadError):
        parse_engine_load(text)


def endpoint(id: str = "e0", in_flight: int = 0, prefilling: int = 0, prefill_tokens: int = 0) -> EndpointState:
    e = EndpointState(id, f"http://{id}")
    e.in_flight, e.prefilling, e.prefill_tokens = in_flight, prefilling, prefill_tokens
    return e


def test_others_are_the_engines_requests_less_this_routers() -> None:
    view = EngineLoadView(max_age_s=1.0)   # "mix": the others' requests look like this router's own
    e = endpoint(in_flight=4, prefilling=2, prefill_tokens=4000)
    for _ in range(100):                   # the EWMAs settle on 1/2 prefilling, 1,000 tokens per request
        view.observe(e, EngineLoad(waiting=4, running=6), now_s=10.0)
    assert view.prefilling_share == pytest.approx(0.5) and view.tokens_per_request == pytest.approx(1000)
    assert e.others_in_flight == 6
    assert e.others_prefilling == 3
    assert e.others_prefill_tokens == pytest.approx(6000)
    assert e.others_until_s == 11.0
    view.observe(e, EngineLoad(waiting=0, running=1), now_s=10.1)   # the engine lags this router's dispatch
    assert (e.others_in_flight, e.others_prefilling, e.others_prefill_tokens) == (0, 0, 0.0)


def test_the_waiting_estimate_splits_the_others_by_the_engines_waiting_share() -> None:
    view = EngineLoadView(estimate="waiting")
    e = endpoint(in_flight=3, prefilling=2, prefill_tokens=4000)
    for _ in range(100):
        view.observe(e, EngineLoad(waiting=4, running=6), now_s=0.0)
    assert e.others_in_flight == 7
    assert e.others_prefilling == round(7 * 4 / 10)
    assert e.others_prefill_tokens == pytest.approx(e.others_prefilling * 2000.0)


def test_an_engine_reporting_its_prefill_queue_is_taken_at_its_word() -> None:
    view = EngineLoadView()
    e = endpoint(in_flight=2, prefilling=1, prefill_tokens=1000)
    view.observe(e, EngineLoad(waiting=3, running=3, prefill_tokens=9000, prefilling=4), now_s=0.0)
    assert (e.others_in_flight, e.others_prefilling, e.others_prefill_tokens) == (4, 3, 8000.0)


def test_forget_and_bad_arguments() -> None:
    view = EngineLoadView()
    e = endpoint(in_flight=1, prefilling=1, prefill_tokens=300)
    view.observe(e, EngineLoad(waiting=5, running=0), now_s=0.0)
    assert e.others_in_flight == 4
    view.forget(e)
    assert (e.others_in_flight, e.others_prefill_tokens, e.others_until_s) == (0, 0.0, 0.0)
    with pytest.raises(ValueError):
        EngineLoadView(max_age_s=0)
    with pytest.raises(ValueError):
        EngineLoadView(estimate="guess")


def test_kv_aware_counts_the_others_load_while_it_is_fresh() -> None:
    request = route_request({"prompt": list(range(2048)), "max_tokens": 4}, None)
    a, b = endpoint("a"), endpoint("b")
    b.others_in_flight, b.others_prefilling, b.others_prefill_tokens, b.others_until_s = 5, 5, 50_000.0, 5.0
    a.others_in_flight, a.others_prefilling, a.others_prefill_tokens, a.others_until_s = 1, 1, 2_000.0, 5.0
    assert KvAware().choose([a, b], request, now_s=1.0) is a
    a.others_until_s = 0.5   # a's estimate is stale: only b's load counts now
    a.others_prefill_tokens = b.others_prefill_tokens = 0.0
    b.others_prefill_tokens = 50_000.0
    assert KvAware().choose([a, b], request, now_s=1.0) is a
    b.others_until_s = 0.5   # both stale: as if nobody else routed (the rendezvous key decides)
    chosen = {KvAware().choose([a, b], request, now_s=1.0).id for _ in range(3)}
    assert len(chosen) == 1


def test_the_load_bound_counts_the_others_requests() -> None:
    a, b = endpoint("a"), endpoint("b")
    a.others_in_flight, a.others_until_s = 10, 9.0   # a holds 10 of the 11 requests in flight
    policy = KvAware()
    hits = {policy.choose([a, b], route_request({"prompt": [i] * 200, "max_tokens": 1}, None), 0.0).id
            for i in range(20)}  # fmt: skip
    assert hits == {"b"}


# ----- the poller ------------------------------------------------------------------------

BUSY = "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4\n" \
       "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 6\n"


class FakeFetch:
    def __init__(self, answers: dict[str, str | PollFailed]) -> None:
        self.answers = answers
        self.urls: list[str] = []

    async def __call__(self, url: str) -> str:
        self.urls.append(url)
        answer = self.answers[url]
        if isinstance(answer, PollFailed):
            raise answer
        return answer


def sample_value(registry: CollectorRegistry, name: str, labels: dict[str, str] | None = None) -> float | None:
    return registry.get_sample_value(name, labels or {})


def test_a_poll_round_feeds_every_endpoint_and_counts_failures() -> None:
    good, down, junk = endpoint("good"), endpoint("down"), endpoint("junk")
    good.in_flight = 2
    fetch = FakeFetch({"http://good/metrics": BUSY, "http://down/metrics": PollFailed("connect", "refused"),
                       "http://junk/metrics": "hello"})  # fmt: skip
    registry = CollectorRegistry()
    now = [100.0]
    poller = EnginePoller(lambda: {"m": (good, down, junk)}, lambda: now[0], registry, fetch=fetch,
                          interval_s=0.1, max_age_s=1.0)  # fmt: skip
    asyncio.run(poller.poll_once())
    assert sorted(fetch.urls) == ["http://down/metrics", "http://good/metrics", "http://junk/metrics"]
    assert good.others_in_flight == 8 and good.others_until_s == 101.0
    assert down.others_until_s == 0.0 and junk.others_until_s == 0.0
    assert sample_value(registry, "fleet_router_engine_load_polls_total") == 1
    assert sample_value(registry, "fleet_router_engine_load_poll_errors_total", {"reason": "connect"}) == 1
    assert sample_value(registry, "fleet_router_engine_load_poll_errors_total", {"reason": "parse"}) == 1
    assert sample_value(registry, "fleet_router_engine_load_age_seconds", {"model": "m"}) == float("inf")
    fetch.answers["http://down/metrics"] = fetch.answers["http://junk/metrics"] = BUSY
    now[0] = 100.5
    asyncio.run(poller.poll_once())
    now[0] = 100.75
    assert sample_value(registry, "fleet_router_engine_load_age_seconds", {"model": "m"}) == pytest.approx(0.25)


def test_the_poller_runs_until_closed() -> None:
    e = endpoint("e")
    fetch = FakeFetch({"http://e/metrics": BUSY})

    async def main() -> None:
        poller = EnginePoller(lambda: {"m": (e,)}, lambda: 0.0, CollectorRegistry(), fetch=fetch, interval_s=0.01)
        await poller.start()
        await async_wait_until(lambda: len(fetch.urls) >= 3, 10, what="three polls")
        await poller.close()
        polled = len(fetch.urls)
        await asyncio.sleep(0.03)      # three poll intervals: the case under test is that no poll comes
        assert len(fetch.urls) == polled >= 3

    asyncio.run(main())
    assert e.others_in_flight == 10
    with pytest.raises(ValueError):
        EnginePoller(dict, lambda: 0.0, CollectorRegistry(), fetch=fetch, interval_s=0)


def test_an_engine_that_never_answers_holds_up_no_other_endpoints_samples() -> None:
    """The stalled engine's /metrics hangs (the real fetcher gives up after its timeout, this one
    never does): the other endpoint is still polled every round, and the stalled one is never
    polled twice at once."""
    good, stalled = endpoint("good"), endpoint("stalled")
    fetch = FakeFetch({"http://good/metrics": BUSY})

    async def main() -> None:
        hung = asyncio.Event()

        async def poll(url: str) -> str:
            if "stalled" in url:
                fetch.urls.append(url)
                await hung.wait()
            return await fetch(url)

        poller = EnginePoller(lambda: {"m": (good, stalled)}, lambda: 0.0, CollectorRegistry(), fetch=poll,
                              interval_s=0.01)  # fmt: skip
        await poller.start()
        await async_wait_until(lambda: fetch.urls.count("http://good/metrics") >= 5, 10,
                               what="five polls of the good endpoint")
        await poller.close()                              # cancels the hung poll
        assert fetch.urls.count("http://stalled/metrics") == 1

    asyncio.run(main())


def test_only_pools_whose_policy_reads_the_load_are_polled() -> None:
    from router.http.app import create_app
    from router.pools.spec import PoolSpec

    app = create_app("token", engine_load_interval_s=0.25)
    assert app.poller is not None and app.poller.interval_s == 0.25
    assert create_app("token").poller is None
    endpoints = [{"id": "e0", "url": "http://127.0.0.1:9"}]
    app.pools.put("kv", PoolSpec.model_validate({"policy": "kv-aware", "endpoints": endpoints}))
    app.pools.put("rr", PoolSpec.model_validate({"policy": "round-robin", "endpoints": endpoints}))
    assert list(app.pools.load_endpoints()) == ["kv"]
