"""Profiles of the engine SIMULATOR: what hardware and model a simulated replica stands for.

Owns `Profile` (scheduler limits and KV capacity as an `EngineConfig`, the per-step
`StepCost`, a typical start-up time) and the registry of named profiles. Used by
`fleet.enginesim.server`, the `fleet sim-engine` command and `engine.kind: sim`. Pure data.

Profiles and where their numbers come from (comments at each number give the arithmetic;
`Profile.notes` says what is an estimate; docs/simulator.md has the tables):

- ``cpu-tiny-llama``: fitted by loadtests/calibrate_sim.py to real vLLM 0.32.0 (CPU build) on
  this workplace's 2-core machine. Fit error: TTFT 15.4% and TPOT 11.6% mean relative error
  in-sample (20 cells), 14.1% and 16.1% on 4 held-out cells.
- ``h100-llama-8b`` (Llama 3 8B, BF16, 1x H100 80GB SXM) and ``h100x4-llama-70b`` (Llama 3 70B,
  BF16, TP=4 on 4x H100 SXM):
  [1] Lambda Labs, "vllm-benchmark" (github.com/LambdaLabsML/vllm-benchmark), result files
      results/prompt_10/1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json and
      results/prompt_10/4xH100-80GB-SXM/Meta-Llama-3-70B-Instruct_tp4_len2048.json (vLLM 0.6.0,
      2024-09-07): decode step time and prefill rate.
  [2] NVIDIA H100 Tensor Core GPU data sheet: 3.35 TB/s HBM3 (SXM5 80GB), for the KV-read
      cost per context token, scaled by the bandwidth efficiency implied by [1].
  [3] Meta Llama 3 model configs (8B: 32 layers, 8 KV heads of 128; 70B: 80 layers, 8 KV heads
      of 128; hidden 4096 / 8192): KV bytes per token and attention FLOPs per query-key pair.
  [4] vLLM 0.32 source, vllm/engine/arg_utils.py: default max_num_batched_tokens (8192) and
      max_num_seqs (1024) for >= 70 GiB GPUs other than A100 in the OpenAI server; CUDA block
      size 16.
  [5] Cross-checks only, not used in the numbers: the vLLM v0.6.0 performance post
      (blog.vllm.ai/2024/09/05/perf-update.html: "Llama3 8B can generate 1 token every 13 ms under
      light load" before v0.6.0) and NVIDIA NIM's LLM benchmarking page
      (docs.nvidia.com/nim/benchmarking/llm, TensorRT-LLM: Llama-3.1-8B ITL 4.6 ms at concurrency
      1). Newer stacks are faster than [1]; the GPU profiles are conservative for vLLM >= 0.7.
  KV capacities are ESTIMATES from [2]-[3] and vLLM's 0.9 memory utilisation (+-10%). The step
  form (a roofline-style sum) follows Sarathi-Serve (Agrawal et al., OSDI 2024) and DistServe
  (Zhong et al., OSDI 2024); see fleet/enginesim/cost.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from fleet.enginesim.cost import StepCost
from fleet.enginesim.model import EngineConfig


@dataclass(frozen=True)
class Profile:
    """A named simulated replica.

    Attributes:
        name: registry key, e.g. ``h100-llama-8b``.
        model: the model it stands for (the default served model name).
        hardware: what one replica runs on, in words.
        config: scheduler limits and KV capacity.
        cost: per-step time.
        typical_startup_s: how long the real engine takes from launch to /health (a hint for
            ``--startup-delay-s``; the simulator starts at once unless told otherwise).
        notes: sources of every number, and which are estimates.
        weight_bytes_per_gpu: bytes of weights one GPU holds (what a level-1 sleep moves to CPU
            memory and a wake brings back: `fleet.enginesim.sleep.wake_time_s`); 0 unknown.
    """

    name: str
    model: str
    hardware: str
    config: EngineConfig
    cost: StepCost
    typical_startup_s: float
    notes: str
    weight_bytes_per_gpu: int = 0

    def with_overrides(self, **config_overrides: object) -> Profile:
        """A copy with some `EngineConfig` fields replaced (None values are ignored).

        Raises:
            ValueError: an override makes the config invalid (e.g. KV smaller than max_model_len).
        """
        changes = {k: v for k, v in config_overrides.items() if v is not None}
        return replace(self, config=replace(self.config, **changes)) if changes else self


_PROFILES: dict[str, Profile] = {}


def register(profile: Profile) -> Profile:
    if profile.name in _PROFILES:
        raise ValueError(f"profile {profile.name!r} is already registered")
    _PROFILES[profile.name] = profile
    return profile


def profile_names() -> list[str]:
    return sorted(_PROFILES)


def get_profile(name: str) -> Profile:
    """The profile called ``name``. Raises KeyError listing the known names."""
    try:
        return _PROFILES[name]
    except KeyError:
        raise KeyError(f"unknown simulator profile {name!r}; known: {', '.join(profile_names())}") from None


DEFAULT_PROFILE = "cpu-tiny-llama"

# --------------------------------------------------------------------------------------------
# cpu-tiny-llama: fitted to real vLLM 0.32.0 (CPU build) on this workplace's 2-core machine.
# --------------------------------------------------------------------------------------------
register(Profile(
    name="cpu-tiny-llama",
    model="tiny-llama",
    hardware="2 CPU cores (AMD EPYC), vLLM 0.32.0 CPU build, --enforce-eager",
    config=EngineConfig(
        # vLLM 0.32 defaults on the CPU platform for the OpenAI server (engine/arg_utils.py:
        # 2048 batched tokens, 128 sequences); block size 128 and 4096 blocks as reported by
        # the real server's vllm:cache_config_info with VLLM_CPU_KVCACHE_SPACE=1 (1 GiB);
        # max_model_len as in examples/quickstart.yaml.
        max_num_seqs=128, max_num_batched_tokens=2048, block_size=128, num_gpu_blocks=4096,
        max_model_len=1024,
    ),
    # Fitted by loadtests/calibrate_sim.py (2026-11-23, 2 shared cores, vLLM 0.32.0 CPU build,
    # 20 cells of prompt 8..960 tokens x batch 1..64, 32 output tokens, 3 runs each; TTFT and
    # TPOT from vLLM's own histograms); measurements and fit in
    # loadtests/results/calibrate-cpu-tiny-llama.json.
    cost=StepCost(
        fixed_s=1.910e-3, per_seq_s=1.280e-5, per_decode_ctx_s=3.848e-7, per_prefill_pair_s=1.061e-8,
        per_token_s=2.230e-5, admission_s=4.042e-3,
    ),
    # docs/vllm-on-cpu.md: 32 s from start to /health with --enforce-eager (21-40 s here).
    typical_startup_s=32.0,
    notes=(
        "Fit error (mean |relative error| over cells): in-sample TTFT 15.4% (max 39.8%), TPOT 11.6% "
        "(max 22.6%) over 20 cells; held-out cells (128x8, 384x32, 32x128, 700x2) TTFT 14.1% (max 24.8%), "
        "TPOT 16.1% (max 25.2%). Prefix cache, 960-token prompt sent twice: TTFT 35.0 -> 8.7 ms measured, "
        "32.3 -> 8.0 ms simulated. A step is ~2 ms of Python overhead plus ~22 us per token: the model is "
        "tiny, so this profile is about vLLM's scheduler and frontend on a CPU, not about a model's compute."
    ),
))

# --------------------------------------------------------------------------------------------
# GPU profiles: from published measurements and the hardware's data sheet.
# --------------------------------------------------------------------------------------------
_H100_HBM_BYTES_PER_S = 3.35e12      # NVIDIA H100 SXM5 80GB data sheet: 3.35 TB/s HBM3

register(Profile(
    name="h100-llama-8b",
    model="meta-llama/Meta-Llama-3-8B-Instruct",
    hardware="1x NVIDIA H100 80GB SXM, BF16, vLLM",
    config=EngineConfig(
        # vLLM defaults for GPUs with >= 70 GiB that are not A100 (vllm/engine/arg_utils.py,
        # OpenAI server): 8192 batched tokens, 1024 sequences; CUDA block size 16;
        # max_model_len 8192 (Llama 3's context).
        max_num_seqs=1024, max_num_batched_tokens=8192, block_size=16, max_model_len=8192,
        # ESTIMATE (+-10%): 0.9 x 79.6 GiB - 14.96 GiB weights (8.03e9 params x 2 B) - ~4 GiB
        # activations/graphs = ~52.7 GiB for KV at 128 KiB per token (32 layers x 2 x 8 KV heads
        # x 128 dims x 2 B) = ~432k tokens = 27,000 blocks of 16.
        num_gpu_blocks=27_000,
    ),
    cost=StepCost(
        # Lambda Labs' vLLM benchmark (github.com/LambdaLabsML/vllm-benchmark, results/prompt_10/
        # 1xH100-80GB-SXM/Meta-Llama-3-8B-Instruct_tp1_len2048.json, vLLM 0.6.0, 2024-09-07,
        # 10 ShareGPT prompts at once, multi-step scheduling of 10 steps): median ITL 72.3 ms per
        # 10 steps -> 7.2 ms per decode step at batch <= 10; mean TTFT 62.4 ms for 1,369 prompt
        # tokens in one batch -> 45.6 us per prefill token (an upper estimate: it includes the
        # frontend's overhead).
        weights_floor_s=0.0072,
        per_token_s=45.6e-6,
        # Derived: KV bytes per context token / (HBM bandwidth x the efficiency the weights
        # stream at: 4.8 ms ideal for 16.06 GB at 3.35 TB/s vs 7.2 ms measured = 0.67).
        per_decode_ctx_s=131_072 / (_H100_HBM_BYTES_PER_S * 0.67),
        # Derived: causal attention FLOPs per query-key pair (4 x 32 layers x 4096) at the
        # effective prefill rate above (16.06 GFLOP per token per 45.6 us = 352 TFLOP/s).
        per_prefill_pair_s=4 * 32 * 4096 / 352e12,
    ),
    # docs/anchors.md: one pod's cold start 52 s with node-local weights (110 s without).
    typical_startup_s=52.0,
    weight_bytes_per_gpu=16_060_000_000,   # 8.03e9 params x 2 B (BF16)
    notes=(
        "Decode step and prefill rate measured with vLLM 0.6.0 (Lambda Labs, 2024-09); newer vLLM "
        "(V1 engine, CUDA graphs, async scheduling) and TensorRT-LLM are faster: NVIDIA's NIM "
        "benchmark (docs.nvidia.com/nim/benchmarking/llm, Llama-3.1-8B, NIM 1.8.0) reports 4.6 ms ITL "
        "at concurrency 1 and 7.6 ms at 100. KV capacity is an estimate from the model's shape. "
        "No per-sequence overhead is modelled (no source separates it)."
    ),
))

register(Profile(
    name="h100x4-llama-70b",
    model="meta-llama/Meta-Llama-3-70B-Instruct",
    hardware="4x NVIDIA H100 80GB SXM (NVLink), tensor parallel 4, BF16, vLLM",
    config=EngineConfig(
        max_num_seqs=1024, max_num_batched_tokens=8192, block_size=16, max_model_len=8192,
        # ESTIMATE (+-10%): per GPU 0.9 x 79.6 GiB - 32.9 GiB weights (70.6e9 x 2 B / 4) - ~4 GiB
        # = ~34.8 GiB for KV at 80 KiB per token per GPU (80 layers x 2 x 8 KV heads / 4 x 128 x
        # 2 B) = ~456k tokens = 28,500 blocks of 16.
        num_gpu_blocks=28_500,
    ),
    cost=StepCost(
        # Lambda Labs' vLLM benchmark (results/prompt_10/4xH100-80GB-SXM/
        # Meta-Llama-3-70B-Instruct_tp4_len2048.json, vLLM 0.6.0, 2024-09-07): median ITL
        # 175.0 ms per 10 steps -> 17.5 ms per decode step; TTFT 140.6 ms (median) for 1,369
        # prompt tokens in one batch -> 102.7 us per prefill token (upper estimate).
        weights_floor_s=0.0175,
        per_token_s=102.7e-6,
        # Derived: 81,920 B of KV per token per GPU / (3.35 TB/s x 0.60, the efficiency implied
        # by 35.3 GB of weights per GPU in 17.5 ms, all-reduce included).
        per_decode_ctx_s=81_920 / (_H100_HBM_BYTES_PER_S * 0.60),
        # Derived: 4 x 80 layers x 8192 FLOP per pair at 141 GFLOP per token per 102.7 us.
        per_prefill_pair_s=4 * 80 * 8192 / (141.1e9 / 102.7e-6),
    ),
    # docs/anchors.md: "a 4-GPU model load can take about 10 minutes".
    typical_startup_s=600.0,
    weight_bytes_per_gpu=35_300_000_000,   # 70.6e9 params x 2 B (BF16) / 4 GPUs
    notes=(
        "Measured with vLLM 0.6.0 (Lambda Labs, 2024-09); NVIDIA's NIM benchmark page (TensorRT-LLM, "
        "NIM 1.3.0) reports 13.2 ms ITL at concurrency 1 for Llama-3.1-70B, so newer stacks are faster. "
        "KV capacity is an estimate."
    ),
))
