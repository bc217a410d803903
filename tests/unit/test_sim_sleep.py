"""The engine simulator's vLLM sleep mode: `POST /sleep`, `POST /wake_up`, `GET /is_sleeping`, a
sleeping replica refusing inference with 503, and the wake time scaled from llm-d's figure."""

from __future__ import annotations

import asyncio
import time

import pytest

from fleet.enginesim.__main__ import options_from_args
from fleet.enginesim.profiles import get_profile
from fleet.enginesim.runner import OptionsError, SimEngineOptions
from fleet.enginesim.sleep import LLMD_WAKE_BYTES, LLMD_WAKE_S, SleepState, parse_level, wake_time_s
from tests.unit.test_sim_server import replica

WAKE_S = 0.2


def test_wake_time_scales_llm_d_figure_by_weight_bytes():
    assert wake_time_s(LLMD_WAKE_BYTES) == pytest.approx(LLMD_WAKE_S)
    assert wake_time_s(0) == 0.0
    # Llama 3 8B in BF16 (16.06 GB on one GPU): ~0.70 s; 70B at TP=4 (35.3 GB per GPU): ~1.54 s.
    assert wake_time_s(get_profile("h100-llama-8b").weight_bytes_per_gpu) == pytest.approx(0.701, abs=0.001)
    assert wake_time_s(get_profile("h100x4-llama-70b").weight_bytes_per_gpu) == pytest.approx(1.541, abs=0.001)
    with pytest.raises(ValueError, match="weight_bytes_per_gpu"):
        wake_time_s(-1)


@pytest.mark.parametrize("raw,level", [(None, 1), ("", 1), ("1", 1)])
def test_level_defaults_to_one(raw, level):
    assert parse_level(raw) == level


@pytest.mark.parametrize("raw,match", [("2", "discards the weights"), ("3", "must be 1 or 2"), ("x", "must be 1 or 2")])
def test_other_levels_are_refused_naming_the_parameter(raw, match):
    with pytest.raises(ValueError, match=f"^level: .*{match}"):
        parse_level(raw)


def test_sleep_state_counts_and_ignores_a_second_sleep():
    s = SleepState()
    s.sleep(1, 10.0)
    s.sleep(1, 11.0)
    assert s.asleep and s.slept_at_s == 10.0 and s.sleeps == 1
    s.woke()
    assert not s.asleep and s.wakes == 1 and s.to_dict()["is_sleeping"] is False


def test_options_carry_sleep_mode_and_default_the_wake_time_from_the_profile():
    opts, _ = options_from_args(["--profile", "h100-llama-8b", "--enable-sleep-mode"])
    (one,) = opts.replica_settings()
    assert one.sleep_mode and one.wake_s == pytest.approx(0.701, abs=0.001)
    opts, _ = options_from_args(["--enable-sleep-mode", "--wake-s", "0.05"])
    assert opts.replica_settings()[0].wake_s == 0.05
    with pytest.raises(OptionsError, match="--wake-s"):
        SimEngineOptions(wake_s=-1.0).replica_settings()


@pytest.mark.asyncio
async def test_sleep_endpoints_are_absent_without_sleep_mode():
    async with replica() as (r, c):
        async with c.post("/sleep") as resp:
            assert resp.status == 404
        async with c.get("/is_sleeping") as resp:
            assert resp.status == 404


@pytest.mark.asyncio
async def test_a_sleeping_replica_refuses_inference_and_serves_again_after_wake_up():
    async with replica(sleep_mode=True, wake_s=WAKE_S) as (r, c):
        async with c.get("/is_sleeping") as resp:
            assert await resp.json() == {"is_sleeping": False}
        async with c.post("/sleep", params={"level": "1"}) as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with c.get("/is_sleeping") as resp:
            assert await resp.json() == {"is_sleeping": True}
        async with c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 503
            err = (await resp.json())["error"]
        assert err["code"] == 503 and "sleeping" in err["message"]
        async with c.get("/v1/models") as resp:       # weight-free endpoints keep working
            assert resp.status == 200
        async with c.get("/health") as resp:
            assert resp.status == 200
        t0 = time.monotonic()
        async with c.post("/wake_up") as resp:
            assert resp.status == 200
        assert time.monotonic() - t0 >= WAKE_S         # answered once the weights are back
        async with c.get("/is_sleeping") as resp:
            assert await resp.json() == {"is_sleeping": False}
        async with c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200
        async with c.get("/sim/state") as resp:
            assert (await resp.json())["sleep"] == {"is_sleeping": False, "level": 0, "waking": False,
                                                    "sleeps": 1, "wakes": 1}


@pytest.mark.asyncio
async def test_concurrent_wake_ups_share_one_wake_and_a_bad_level_is_a_400():
    async with replica(sleep_mode=True, wake_s=WAKE_S) as (r, c):
        async with c.post("/sleep", params={"level": "7"}) as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        assert err["param"] == "level"
        async with c.post("/sleep") as resp:
            assert resp.status == 200

        async def wake() -> int:
            async with c.post("/wake_up") as resp:
                return resp.status

        assert await asyncio.gather(wake(), wake()) == [200, 200]
        assert r.sleep.wakes == 1 and not r.sleep.asleep
        async with c.post("/wake_up") as resp:          # awake already: a no-op
            assert resp.status == 200


@pytest.mark.asyncio
async def test_sleep_aborts_requests_in_flight():
    async with replica(sleep_mode=True) as (r, c):
        body = {"prompt": "a b c", "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with c.post("/v1/completions", json=body) as resp:
            await resp.content.readline()                  # streaming has started
            async with c.post("/sleep") as s:
                assert s.status == 200
            text = (await resp.read()).decode()
        assert "error" in text and "sleep" in text
        assert r.model.stats().num_running == 0
