"""Model facts and per-GPU memory (fleet.models): real config.json files of well-known
architectures (tests/data/model_configs/), checked against published parameter counts and
against what vLLM 0.32 (CPU build) printed for the tiny generated model."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fleet.engines import tinymodel
from fleet.models import EngineArgError, EngineMemorySettings, MemoryNeed, facts_from_config, tp_problem
from fleet.models.advise import COMMON_GPU_PRODUCTS, advise, cheapest, common_product, mig_memory_mib
from fleet.models.facts import GIB, MIB, ModelConfigError, valid_tp_sizes
from fleet.models.read import ModelSourceError, facts_from_dir, read_model_facts

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "model_configs"
H100_MIB = 81559   # NVML memory.total of an H100 80GB HBM3 (fleet/testing/data/h100-80gb-hbm3.json)


def facts(name: str):
    return facts_from_config(json.loads((CONFIGS / f"{name}.json").read_text()), name)


# Published sizes: Llama 3.1 model cards (8.03B, 70.6B), Qwen2.5-7B (7.61B), Mixtral 8x7B (46.7B),
# Qwen3-30B-A3B (30.5B), DeepSeek-V3 (671B without its MTP module), Mistral Small 3.1 (24B with
# its 0.4B vision encoder, not counted here), Llava 1.5 7B's Vicuna (Llama 2 7B: 6.74B).
@pytest.mark.parametrize("name, billions", [
    ("llama-3.1-8b-instruct", 8.03), ("llama-3.1-70b-instruct", 70.55), ("qwen2.5-7b-instruct", 7.61),
    ("mixtral-8x7b-instruct-v0.1", 46.70), ("qwen3-30b-a3b", 30.53), ("deepseek-v3", 671.0),
    ("mistral-small-3.1-24b-instruct-2503", 23.57), ("llava-1.5-7b-hf", 6.74), ("mistral-7b-v0.1", 7.24),
    ("gemma-3-27b-it", 27.0),   # 27.4B with its 0.4B SigLIP encoder; text_config filled from transformers' defaults
])
def test_parameter_counts_match_the_published_ones(name, billions):
    assert facts(name).parameters / 1e9 == pytest.approx(billions, rel=0.005)


@pytest.mark.parametrize("name, tp, kv_bytes_per_token", [
    # layers x KV heads per GPU x (K + V head size) x 2 bytes (bf16)
    ("llama-3.1-8b-instruct", 1, 32 * 8 * 256 * 2),         # 128 KiB: GQA, 8 KV heads
    ("llama-3.1-8b-instruct", 2, 32 * 4 * 256 * 2),         # split over TP
    ("llama-3.1-70b-instruct", 8, 80 * 1 * 256 * 2),
    ("qwen2.5-7b-instruct", 4, 28 * 1 * 256 * 2),           # 4 KV heads over 4 GPUs
    ("qwen3-30b-a3b", 8, 48 * 1 * 256 * 2),                 # 4 KV heads, TP 8: replicated, max(1, 4 // 8)
    ("deepseek-v3", 1, 61 * 1 * 576 * 2),                   # MLA: one 512 + 64 latent, no V
    ("deepseek-v3", 8, 61 * 1 * 576 * 2),                   # ... on every rank, not split
    ("mistral-small-3.1-24b-instruct-2503", 1, 40 * 8 * 256 * 2),   # nested text_config
])
def test_kv_bytes_per_token_split_over_tp_as_vllm_splits_it(name, tp, kv_bytes_per_token):
    assert MemoryNeed(facts(name), tensor_parallel_size=tp).kv_bytes_per_token == kv_bytes_per_token


def test_matches_what_vllm_cpu_printed_for_the_tiny_model():
    # vLLM 0.32.0 (CPU) serving `fleet make-tiny-model` with --max-model-len 1024 and
    # VLLM_CPU_KVCACHE_SPACE=1 printed (docs/placement.md, "Checked against vLLM"):
    #   Explicitly set (1.0/11.84) GiB for KV cache on node 0.
    #   CPU KV cache size: 524,288 tokens, Maximum concurrency for 1,024 tokens per request: 512.00x
    # The CPU backend's block size is 128 (vllm/platforms/cpu.py).
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048,
              "torch_dtype": "bfloat16", "tie_word_embeddings": False, **tinymodel._MODEL_SHAPE}
    need = MemoryNeed(facts_from_config(config), EngineMemorySettings(block_size=128, max_model_len=1024))
    assert need.kv_bytes_per_token == 2048
    blocks, tokens, concurrency = need.capacity_of(1 * GIB)
    assert (blocks, tokens, concurrency) == (4096, 524_288, 512.0)


def test_llama_70b_does_not_fit_one_h100_nor_a_mig_slice_and_says_how_much():
    need = MemoryNeed(facts("llama-3.1-70b-instruct"), EngineMemorySettings(max_model_len=8192))
    problem = need.fits(H100_MIB)
    assert problem is not None
    assert "needs 139.33 GiB per GPU at TP=1 (weights 131.41 GiB" in problem
    assert "73.28 GiB available (81559 MiB x gpu_memory_utilization 0.92)" in problem
    assert "the weights alone do not fit" in problem
    assert need.fits(mig_memory_mib("NVIDIA H100 80GB HBM3", H100_MIB, "3g.40gb")) is not None
    assert need.at_tp(4).fits(H100_MIB) is None
    assert need.at_tp(4).concurrency(H100_MIB) == pytest.approx(55.2, abs=0.1)


def test_a_long_context_names_the_longest_that_fits():
    need = MemoryNeed(facts("llama-3.1-8b-instruct"))   # max_model_len: the model's 131,072
    l4 = common_product("NVIDIA L4")
    problem = need.fits(l4.memory_mib)
    assert "one 131,072-token sequence 16.00 GiB" in problem and "tokens of context fit (--max-model-len)" in problem
    longest = need.longest_context(l4.memory_mib)
    assert 0 < longest < 131_072 and longest % 16 == 0
    shorter = MemoryNeed(need.facts, EngineMemorySettings(max_model_len=longest))
    assert shorter.fits(l4.memory_mib) is None
    assert MemoryNeed(need.facts, EngineMemorySettings(max_model_len=longest + 16)).fits(l4.memory_mib) is not None


def test_overheads_and_settings_change_the_sums():
    f = facts("llama-3.1-8b-instruct")
    base = MemoryNeed(f, EngineMemorySettings(max_model_len=8192))
    eager = MemoryNeed(f, EngineMemorySettings(max_model_len=8192, enforce_eager=True))
    assert base.overhead_bytes(H100_MIB) - eager.overhead_bytes(H100_MIB) == GIB   # no CUDA graph reserve
    fp8 = MemoryNeed(f, EngineMemorySettings(max_model_len=8192, kv_cache_dtype="fp8"))
    assert fp8.kv_bytes_per_token == base.kv_bytes_per_token / 2
    low = MemoryNeed(f, EngineMemorySettings(max_model_len=8192, gpu_memory_utilization=0.5))
    assert low.concurrency(H100_MIB) < base.concurrency(H100_MIB)
    assert base.weight_bytes == f.weight_bytes and base.at_tp(2).weight_bytes == f.weight_bytes // 2


def test_engine_args_are_read_and_bad_values_named():
    s = EngineMemorySettings.from_engine_args(
        ["--max-model-len", "32k", "--gpu-memory-utilization=0.85", "--enforce-eager", "--kv-cache-dtype", "fp8",
         "--block-size", "32", "--other", "x"])
    assert (s.max_model_len, s.gpu_memory_utilization, s.enforce_eager, s.kv_cache_dtype, s.block_size) == (
        32_000, 0.85, True, "fp8", 32)
    assert EngineMemorySettings.from_engine_args([]) == EngineMemorySettings()
    with pytest.raises(EngineArgError, match="--gpu-memory-utilization '1.5': must be in"):
        EngineMemorySettings.from_engine_args(["--gpu-memory-utilization", "1.5"])
    with pytest.raises(EngineArgError, match="--max-model-len 'long'"):
        EngineMemorySettings.from_engine_args(["--max-model-len", "long"])


def test_tp_must_divide_the_attention_heads_and_pair_with_the_kv_heads():
    qwen = facts("qwen2.5-7b-instruct")                     # 28 heads, 4 KV heads
    assert tp_problem(qwen, 8) == ("tensorParallelSize 8 does not divide the model's 28 attention heads "
                                   "(vLLM requires heads % TP == 0; try 1, 2, 4)")
    assert valid_tp_sizes(qwen) == [1, 2, 4]
    assert "does not divide the model's 64 attention heads" in tp_problem(facts("llama-3.1-70b-instruct"), 3)
    assert tp_problem(facts("qwen3-30b-a3b"), 8) is None     # 32 heads; TP 8 replicates the 4 KV heads
    assert tp_problem(facts("deepseek-v3"), 8) is None


def test_config_errors_name_the_field():
    with pytest.raises(ModelConfigError, match=r"m config.json num_hidden_layers: required"):
        facts_from_config({"hidden_size": 8, "num_attention_heads": 2, "vocab_size": 4}, "m config.json")
    with pytest.raises(ModelConfigError, match=r"num_attention_heads: expected a non-negative integer"):
        facts_from_config({"hidden_size": 8, "num_hidden_layers": 2, "num_attention_heads": "x", "vocab_size": 4})


def _safetensors(path: Path, tensors: dict[str, tuple[str, list[int], int]]) -> None:
    """A safetensors file: header with each tensor's dtype, shape and data offsets, then zeros."""
    header, offset = {}, 0
    for name, (dtype, shape, nbytes) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * offset)


def test_weights_come_from_safetensors_headers_or_the_index(tmp_path):
    (tmp_path / "config.json").write_text((CONFIGS / "qwen2.5-7b-instruct.json").read_text())
    assert facts_from_dir(tmp_path).weight_source == "config.json"
    _safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": ("BF16", [4, 8], 64), "b": ("F32", [2], 8)})
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", {"c": ("BF16", [1000], 2000)})
    f = facts_from_dir(tmp_path)
    assert (f.weight_bytes, f.weight_source) == (2072, "safetensors headers")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": 15_231_233_024}, "weight_map": {}}))
    f = facts_from_dir(tmp_path)
    assert (f.weight_bytes, f.weight_source) == (15_231_233_024, "safetensors index")
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ModelSourceError, match="has no metadata.total_size"):
        facts_from_dir(tmp_path)


def test_sources_fleet_does_not_read_and_missing_configs(tmp_path):
    assert read_model_facts("sim://h100-llama-8b") is None
    with pytest.raises(ModelSourceError, match="no config.json"):
        read_model_facts(str(tmp_path))


def test_advice_lists_shapes_and_the_cheapest_for_a_target():
    need = MemoryNeed(facts("llama-3.1-8b-instruct"), EngineMemorySettings(max_model_len=8192))
    rows = advise(need)
    h100 = {r.label: r for r in rows if r.product == "NVIDIA H100 80GB HBM3"}
    assert {"TP=1", "TP=2", "TP=4", "TP=8", "MIG 3g.40gb", "MIG 1g.10gb"} <= set(h100)
    assert h100["TP=1"].fits and h100["MIG 3g.40gb"].fits and not h100["MIG 1g.10gb"].fits
    assert h100["MIG 1g.10gb"].verdict == "weights do not fit"
    assert h100["MIG 3g.40gb"].gpus == pytest.approx(3 / 7)
    # By GPUs: one MIG 1g.20gb... does not fit; the cheapest for 1 sequence is the smallest slice that fits.
    best = cheapest(rows, 1)
    assert best.fits and best.gpus <= 3 / 7
    # With prices, only priced products compete, and 40 sequences need ceil(40 / floor(concurrency)) replicas.
    priced = advise(need, COMMON_GPU_PRODUCTS, {"NVIDIA H100 80GB HBM3": 3.0, "NVIDIA L4": 0.8})
    best = cheapest(priced, 40)
    assert best.product in ("NVIDIA H100 80GB HBM3", "NVIDIA L4")
    assert best.cost_for(40) == min(r.cost_for(40) for r in priced if r.fits and r.price_per_hour and r.concurrency >= 1)


def test_mig_memory_uses_nvml_sizes_or_the_profile_name():
    assert mig_memory_mib("NVIDIA H100 80GB HBM3", H100_MIB, "3g.40gb") == 40448   # measured (fleet.inventory.mig)
    assert mig_memory_mib("NVIDIA A100-SXM4-40GB", 40960, "3g.20gb") == 20 * 1000 ** 3 // MIB
    assert mig_memory_mib("NVIDIA L4", 23034, "1g.10gb") is None


def test_sliding_window_layers_hold_their_window_not_the_context():
    # Gemma 3: 5 of every 6 layers attend through a 1,024-token window (vLLM's SlidingWindowSpec:
    # window - 1 + two batches of in-flight tokens, in blocks, plus one).
    gemma = facts("gemma-3-27b-it")
    assert (gemma.layers, gemma.sliding_layers, gemma.sliding_window) == (62, 52, 1024)
    need = MemoryNeed(gemma)                                          # its 131,072-token context
    page = 16 * 16 * 256 * 2                                          # block x KV heads x (K + V) x bf16
    assert need.sliding_blocks_per_sequence == -(-(1023 + 2 * 8192) // 16) + 1
    assert need.sequence_kv_bytes == (10 * 8192 + 52 * need.sliding_blocks_per_sequence) * page + 62 * page
    full = MemoryNeed(facts_from_config({**json.loads((CONFIGS / "gemma-3-27b-it.json").read_text()),
                                         "text_config": {**json.loads((CONFIGS / "gemma-3-27b-it.json").read_text())
                                                         ["text_config"], "sliding_window": None}}))
    assert need.sequence_kv_bytes < full.sequence_kv_bytes / 3
    mistral = facts("mistral-7b-v0.1")                                # every layer: a 4,096 window
    assert mistral.sliding_layers == 32
    assert MemoryNeed(mistral).sequence_kv_bytes == (32 * (-(-(4095 + 16384) // 16) + 1) + 32) * 16 * 8 * 256 * 2
    assert facts("qwen2.5-7b-instruct").sliding_layers == 0          # use_sliding_window: false


def test_kv_cache_estimate_against_what_vllm_measured_on_an_h100():
    # vLLM's own log for `vllm serve meta-llama/Meta-Llama-3-8B` on an H100 (vllm-project/vllm
    # pull request #10511, vLLM 0.6.5): total_gpu_memory 79.22GiB, gpu_memory_utilization 0.90,
    # model weights take 14.96GiB, non_torch_memory 1.79GiB, PyTorch activation peak memory
    # 1.26GiB, available_kv_cache_memory 53.29GiB (CUDA graphs were not counted then: eager here).
    need = MemoryNeed(facts("llama-3.1-8b-instruct"),   # Llama 3 8B's shapes; 3.1 changed only RoPE scaling
                      EngineMemorySettings(max_model_len=8192, gpu_memory_utilization=0.90, enforce_eager=True))
    device_mib = round(79.22 * 1024)
    assert need.weight_bytes / GIB == pytest.approx(14.96, abs=0.01)
    kv = need.kv_cache_bytes(device_mib) / GIB
    assert 0.95 * 53.29 <= kv <= 53.29    # within 5 %, and never more than vLLM found
