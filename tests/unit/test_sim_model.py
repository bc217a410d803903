"""fleet.enginesim.model: the engine simulator's scheduler, in virtual time (no clock, no sockets).

Costs are chosen so virtual times are easy to read: a step costs 1 s plus 0.01 s per token
unless a test says otherwise.
"""

from __future__ import annotations

import pytest

from fleet.enginesim.cost import StepCost, StepFeatures
from fleet.enginesim.kvcache import BlockPool, block_hashes
from fleet.enginesim.model import Arrival, EngineConfig, EngineModel, run_virtual

UNIT = StepCost(fixed_s=1.0, per_token_s=0.01)


def config(**kw) -> EngineConfig:
    base = dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_gpu_blocks=256, max_model_len=256)
    return EngineConfig(**{**base, **kw})


def prompt(n: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n))


def steps_until_idle(model: EngineModel, t: float = 0.0) -> list:
    out = []
    while model.has_work():
        r = model.step(t)
        out.append(r)
        t = r.end_s
    return out


# ----- batching --------------------------------------------------------------------------

def test_batch_is_capped_by_max_num_seqs():
    m = EngineModel(config(max_num_seqs=2), UNIT)
    for i in range(5):
        m.add_request(f"r{i}", prompt(4, 100 * i), 3, 0.0)
    first = m.step(0.0)
    assert set(first.scheduled) == {"r0", "r1"}
    assert (m.num_running, m.num_waiting) == (2, 3)
    done = [fr.request_id for r in steps_until_idle(m, first.end_s) for fr in r.finished]
    assert sorted(done) == [f"r{i}" for i in range(5)]


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget():
    m = EngineModel(config(max_num_batched_tokens=32), UNIT)
    m.add_request("a", prompt(100), 2, 0.0)
    steps = steps_until_idle(m)
    assert [s.scheduled["a"] for s in steps] == [32, 32, 32, 4, 1]
    assert [s.emitted.get("a") for s in steps] == [None, None, None, 0, 1]
    # Virtual time: each step costs 1 s + 0.01 s per token; the first token exists at the end of step 4.
    fr = steps[-1].finished[0]
    assert fr.ttft_s == pytest.approx(4 * 1.0 + 0.01 * 100)
    assert fr.e2e_s == pytest.approx(fr.ttft_s + 1.01)


def test_running_decodes_go_first_and_a_new_prefill_takes_the_rest_of_the_budget():
    m = EngineModel(config(max_num_batched_tokens=16), UNIT)
    m.add_request("old", prompt(8), 10, 0.0)
    s1 = m.step(0.0)                                   # prefill of "old", first token
    m.add_request("new", prompt(40, 5000), 2, s1.end_s)
    s2 = m.step(s1.end_s)
    assert s2.scheduled == {"old": 1, "new": 15}       # decode first, then a 15-token chunk
    assert s2.features == StepFeatures(num_tokens=16, num_seqs=2, decode_context_tokens=9,
                                       prefill_attention_pairs=15 * 8.0)


def test_a_request_arriving_during_a_step_waits_for_the_next_one():
    m = EngineModel(config(), UNIT)
    done = run_virtual(m, [Arrival(0.0, "a", prompt(8), 3), Arrival(0.5, "b", prompt(8, 9000), 1)])
    b = next(fr for fr in done if fr.request_id == "b")
    assert b.first_scheduled_s == pytest.approx(1.08)  # end of "a"'s prefill step (1 s + 8 tokens)
    assert b.queue_s == pytest.approx(0.58)


# ----- KV-cache capacity -----------------------------------------------------------------

def test_requests_wait_when_the_kv_cache_is_full_and_run_when_it_frees():
    # 10 blocks of 4 tokens = 40 tokens; each request needs 8 blocks for its 30-token prompt.
    m = EngineModel(config(num_gpu_blocks=10, max_model_len=40), UNIT)
    m.add_request("a", prompt(30), 2, 0.0)
    m.add_request("b", prompt(30, 7000), 2, 0.0)
    s = m.step(0.0)
    assert set(s.scheduled) == {"a"}
    assert (m.num_running, m.num_waiting) == (1, 1)
    assert m.stats().kv_cache_usage == pytest.approx(0.8)
    order = [fr.request_id for r in steps_until_idle(m, s.end_s) for fr in r.finished]
    assert order == ["a", "b"]
    assert m.stats().num_preemptions == 0


def test_running_requests_are_preempted_when_blocks_run_out_and_still_finish():
    # Both prompts fit (4 blocks each of 10), but growing to 16 + 12 tokens needs 7 blocks each.
    m = EngineModel(config(num_gpu_blocks=10, max_model_len=40), UNIT)
    m.add_request("a", prompt(16), 12, 0.0)
    m.add_request("b", prompt(16, 7000), 12, 0.0)
    steps = steps_until_idle(m)
    preempted = [rid for s in steps for rid in s.preempted]
    assert preempted and preempted[0] == "b"           # the last running request goes first (FCFS)
    finished = {fr.request_id: fr for s in steps for fr in s.finished}
    assert {k: v.num_output_tokens for k, v in finished.items()} == {"a": 12, "b": 12}
    assert finished["b"].num_preemptions >= 1
    assert m.stats().num_preemptions == len(preempted)
    assert m.pool.num_free == 10                        # nothing leaked


def test_prompt_plus_output_longer_than_max_model_len_is_refused():
    m = EngineModel(config(max_model_len=32), UNIT)
    with pytest.raises(ValueError, match="max_model_len 32"):
        m.add_request("a", prompt(30), 3, 0.0)


def test_a_kv_cache_smaller_than_one_request_is_refused_like_vllm():
    with pytest.raises(ValueError, match="cannot hold one request"):
        EngineConfig(block_size=16, num_gpu_blocks=4, max_model_len=128)


# ----- prefix caching --------------------------------------------------------------------

def test_a_repeated_prompt_hits_the_prefix_cache_and_its_ttft_is_lower():
    m = EngineModel(config(max_num_batched_tokens=256), StepCost(fixed_s=0.01, per_token_s=0.001))
    long_prompt = prompt(64)
    cold = run_virtual(m, [Arrival(0.0, "cold", long_prompt, 4)])[0]
    warm = run_virtual(m, [Arrival(10.0, "warm", long_prompt, 4)], start_s=10.0)[0]
    assert cold.num_cached_prompt_tokens == 0
    assert warm.num_cached_prompt_tokens == 60         # full blocks, at most prompt - 1 tokens
    assert warm.ttft_s < cold.ttft_s
    assert warm.ttft_s == pytest.approx(0.01 + 0.001 * 4)  # only 4 tokens computed
    st = m.stats()
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (128, 60)


def test_a_shared_prefix_hits_only_up_to_where_the_prompts_differ():
    m = EngineModel(config(), UNIT)
    run_virtual(m, [Arrival(0.0, "a", prompt(32), 1)])
    other = prompt(16) + prompt(16, 9000)
    fr = run_virtual(m, [Arrival(5.0, "b", other, 1)], start_s=5.0)[0]
    assert fr.num_cached_prompt_tokens == 16


def test_generated_tokens_enter_the_cache_so_a_follow_up_turn_hits_them():
    m = EngineModel(config(), UNIT)
    reply = prompt(8, 50_000)
    m.add_request("turn1", prompt(8), 8, 0.0, output_token_ids=reply)
    steps_until_idle(m)
    fr = run_virtual(m, [Arrival(100.0, "turn2", prompt(8) + reply + prompt(4, 60_000), 1)], start_s=100.0)[0]
    assert fr.num_cached_prompt_tokens == 12            # 15 computed tokens of turn 1 = 3 full blocks


def test_cached_blocks_are_evicted_least_recently_used_first():
    m = EngineModel(config(num_gpu_blocks=16, max_model_len=64), UNIT)
    run_virtual(m, [Arrival(0.0, "a", prompt(32), 1)])
    # Three other prompts of 32 tokens (8 blocks each) push "a"'s blocks out of the free queue.
    for i in range(3):
        run_virtual(m, [Arrival(10.0 * (i + 1), f"x{i}", prompt(32, 10_000 * (i + 1)), 1)], start_s=10.0 * (i + 1))
    fr = run_virtual(m, [Arrival(100.0, "a2", prompt(32), 1)], start_s=100.0)[0]
    assert fr.num_cached_prompt_tokens == 0


def test_block_hashes_chain_so_equal_hashes_mean_equal_prefixes():
    h1 = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    h2 = block_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(h1) == 2 and h1[1] != h2[1]              # same second block, different parent
    assert block_hashes([1, 2, 3, 4, 5], 4) == h1[:1]  # a partial block has no hash


def test_block_pool_counts_shared_blocks_once_and_frees_tails_first():
    pool = BlockPool(4)
    a = pool.allocate(2)
    for b, h in zip(a, (11, 12)):
        pool.cache(b, h)
    pool.touch(pool.lookup([11, 12], 2))               # a second request shares both blocks
    assert pool.num_free == 2
    pool.free(a)
    assert pool.num_free == 2                          # still held by the sharer
    pool.free(a)
    assert pool.num_free == 4 and pool.usage() == 0.0
    fresh = pool.allocate(3)                           # the two untouched blocks, then the tail (12)
    assert a[1] in fresh and a[0] not in fresh
    assert pool.lookup([11, 12], 2) == [a[0]]


# ----- time, determinism, faults ---------------------------------------------------------

def arrivals() -> list[Arrival]:
    return [Arrival(0.05 * i, f"r{i}", prompt(10 + 3 * (i % 10), 100 * i), 5 + i % 4) for i in range(30)]


def test_the_model_is_deterministic():
    def run():
        m = EngineModel(config(max_num_seqs=6, num_gpu_blocks=20, max_model_len=64), UNIT)
        return run_virtual(m, arrivals()), m.stats()

    (a, stats_a), (b, stats_b) = run(), run()
    assert a == b and stats_a == stats_b
    assert len(a) == 30 and stats_a.num_preemptions > 0  # a busy run: queueing and preemption


def test_steps_cannot_overlap_in_time():
    m = EngineModel(config(), UNIT)
    m.add_request("a", prompt(8), 3, 0.0)
    s = m.step(0.0)
    with pytest.raises(ValueError, match="before the previous one ended"):
        m.step(s.end_s - 0.5)


def test_slowdown_multiplies_every_step():
    fast = run_virtual(EngineModel(config(), UNIT), arrivals())
    slow = run_virtual(EngineModel(config(), UNIT, slowdown=3.0), [
        Arrival(a.at_s * 3, a.request_id, a.prompt_token_ids, a.max_output_tokens) for a in arrivals()])
    by_id = {fr.request_id: fr for fr in slow}
    for fr in fast:
        assert by_id[fr.request_id].e2e_s == pytest.approx(3 * fr.e2e_s)


def test_abort_frees_the_blocks_and_reports_the_request():
    m = EngineModel(config(), UNIT)
    m.add_request("a", prompt(40), 50, 0.0)
    m.step(0.0)
    fr = m.abort("a", 5.0)
    assert fr is not None and fr.finish_reason == "abort"
    assert m.pool.num_free == m.config.num_gpu_blocks and not m.has_work()
    assert m.abort("a", 6.0) is None


def test_weights_floor_makes_small_steps_cost_the_same():
    cost = StepCost(weights_floor_s=0.007, per_token_s=1e-4)
    assert cost.duration_s(StepFeatures(num_tokens=1, num_seqs=1)) == pytest.approx(0.007)
    assert cost.duration_s(StepFeatures(num_tokens=50, num_seqs=50)) == pytest.approx(0.007)
    assert cost.duration_s(StepFeatures(num_tokens=1000, num_seqs=1)) == pytest.approx(0.1)
    assert cost.duration_s(StepFeatures()) == 0.0


def test_admission_delay_holds_a_new_request_back_before_the_scheduler_sees_it():
    m = EngineModel(config(), StepCost(fixed_s=1.0, admission_s=0.25))
    m.add_request("a", prompt(8), 2, 0.0)
    assert m.has_work() and m.num_waiting == 0 and m.next_ready_s() == 0.25
    empty = m.step(0.0)
    assert not empty.scheduled and empty.duration_s == 0.0
    fr = run_virtual(m, [])[0]
    assert fr.first_scheduled_s == pytest.approx(0.25)
    assert fr.ttft_s == pytest.approx(1.25)            # admission + one step
    assert fr.queue_s == pytest.approx(0.25)
