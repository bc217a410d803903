"""How much GPU memory one replica of a model needs, per device, the way vLLM accounts it.

Owns `EngineMemorySettings` (the engine arguments that change the sums: ``--gpu-memory-utilization``,
``--max-model-len``, ``--kv-cache-dtype``, ``--dtype``, ``--block-size``, ``--enforce-eager``,
``--max-num-seqs``, ``--max-num-batched-tokens``, ``--quantization``; read from ``spec.engine.args``) and
`MemoryNeed` (a model at a tensor parallel size: per-GPU weights, KV bytes per token, the
engine's overheads; `fits` a device or says why not, `concurrency` on a device;
`max_len_problem`: a ``--max-model-len`` vLLM refuses for the model, whatever the device). Pure.
Used by `fleet validate`, `fleet plan --advise` (`fleet.models.advise`) and placement's memory
filter (`fleet.placement.shapes.PlacementRequest.memory`; placement refuses every replica of a
need with a `max_len_problem`: `fleet.placement.strategies.PlacementStrategy.place_replicas`).

vLLM's accounting (vLLM 0.32, the version Fleet installs; file paths in the vllm package):

- ``v1/worker/utils.py`` ``request_memory``: the engine takes ``total x gpu_memory_utilization``
  of the device (``config/cache.py``: default 0.92; 0.9 before 0.2x);
- ``v1/worker/gpu_worker.py`` ``determine_available_memory``: KV cache memory = that budget minus
  the non-KV memory a profiling forward pass measures (weights, the activation peak of
  ``max_num_batched_tokens`` tokens and a ``max_num_seqs`` sampler pass, non-torch allocations:
  CUDA context, NCCL) minus the CUDA-graph memory it profiles (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``,
  on by default; none with ``--enforce-eager``);
- ``v1/kv_cache_interface.py`` ``AttentionSpec.page_size_bytes``: a block of ``block_size`` tokens
  of one layer holds ``block_size x kv_heads_per_gpu x (head_size + head_size_v) x dtype`` bytes;
  ``config/model.py`` ``get_num_kv_heads``: ``max(1, kv_heads // TP)`` per GPU (MLA: 1, on every
  rank); ``FullAttentionSpec.max_memory_usage_bytes``: a request of ``max_model_len`` takes
  ``ceil(max_model_len / block_size)`` blocks of every layer;
- ``v1/core/kv_cache_utils.py``: ``num_blocks = available // (page x layers)``;
  ``check_enough_kv_cache_memory`` refuses to start when one ``max_model_len`` request (plus the
  null block the pool holds back) does not fit (the "max seq len ... larger than the available KV
  cache memory" start-up failure); the start-up log's "Maximum concurrency for N tokens per
  request" is ``num_blocks / blocks per request``.

vLLM measures the activation peak, non-torch and CUDA-graph memory at start-up; Fleet cannot, so
it uses an estimate (`EngineMemorySettings.overhead_bytes`, docs/placement.md says how it is made).
The weights and the KV cache are exact sums: the weights at the bytes vLLM loads them as (a
quantized checkpoint's own, or ``--quantization``'s online format: `fleet.models.quant`), the
KV cache at ``--kv-cache-dtype`` (``config/cache.py`` ``CacheDType``: the fp8 kinds 1 byte per
element, ``auto`` the model's dtype).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

from fleet.models.facts import DTYPE_BYTES, GIB, MIB, ModelFacts, tp_problem
from fleet.models.maxlen import allows_long_max_len, max_model_len_problem
from fleet.models.quant import online_weight_bytes

DEFAULT_GPU_MEMORY_UTILIZATION = 0.92
"""vLLM 0.32's ``CacheConfig.gpu_memory_utilization`` default (vllm/config/cache.py)."""
DEFAULT_BLOCK_SIZE = 16
"""vLLM's ``CacheConfig.DEFAULT_BLOCK_SIZE`` on GPUs (the CPU backend uses 128)."""

NON_TORCH_BYTES = 512 * MIB
"""Allowance for memory outside PyTorch's allocator on one GPU (CUDA context, cuBLAS workspace);
vLLM measures it as ``non_torch_increase`` at start-up."""
NON_TORCH_TP_BYTES = 512 * MIB
"""Added per GPU when TP > 1: NCCL and custom all-reduce buffers."""
CUDA_GRAPH_BYTES = 1 * GIB
"""Allowance for CUDA graph capture (vLLM profiles it and takes it from the KV cache unless
``--enforce-eager``); vLLM logs 0.3-1.5 GiB for dense 7B-70B models."""

SAMPLER_BYTES_PER_LOGIT = 32
"""Bytes the sampler's profiling pass holds per sequence and vocabulary entry (see
`MemoryNeed.overhead_bytes`): 4 (logits) + 4 + 8 (sorted values and indices) + 4 + 4
(probabilities, cumulative sum) + masks and copies."""

_FLAGS = {
    "--gpu-memory-utilization": "gpu_memory_utilization", "--max-model-len": "max_model_len",
    "--kv-cache-dtype": "kv_cache_dtype", "--dtype": "dtype", "--block-size": "block_size",
    "--max-num-seqs": "max_num_seqs", "--max-num-batched-tokens": "max_num_batched_tokens",
    "--quantization": "quantization", "-q": "quantization",
}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgGtT]?)$")
_DECIMAL = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4}
_BINARY = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}


class EngineArgError(ValueError):
    """An engine argument Fleet reads for memory sizing has a value vLLM would refuse."""


@dataclass(frozen=True)
class EngineMemorySettings:
    """The vLLM arguments that change how much memory a replica needs; None: vLLM's default.
    ``allow_long_max_model_len``: the engine's environment sets ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``
    (`fleet.models.maxlen.allows_long_max_len`): a ``--max-model-len`` above the model's maximum
    is taken."""

    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None          # None: the model's maximum (ModelFacts.model_max_len)
    kv_cache_dtype: str = "auto"              # auto: the model's dtype
    dtype: str = "auto"
    block_size: int = DEFAULT_BLOCK_SIZE
    enforce_eager: bool = False
    max_num_seqs: int | None = None           # None: vLLM's default for the device
    max_num_batched_tokens: int | None = None
    quantization: str | None = None           # None: the checkpoint's own format
    allow_long_max_model_len: bool = False

    @classmethod
    def from_engine_args(cls, args: list[str] | tuple[str, ...],
                         env: Mapping[str, str] | None = None) -> EngineMemorySettings:
        """Read ``spec.engine.args`` (``--flag value`` or ``--flag=value``; others ignored) and
        ``spec.engine.env`` (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``).

        Raises EngineArgError naming the flag for a value that is not a number where one is
        needed, or out of vLLM's range (``--gpu-memory-utilization`` in (0, 1]).
        """
        values: dict[str, object] = {}
        i = 0
        args = list(args)
        while i < len(args):
            flag, eq, value = args[i].partition("=")
            if flag == "--enforce-eager":
                values["enforce_eager"] = True
            elif flag in _FLAGS and (eq or i + 1 < len(args)):
                if not eq:
                    i += 1
                    value = args[i]
                values[_FLAGS[flag]] = _parse(flag, value)
            i += 1
        return cls(**values, allow_long_max_model_len=allows_long_max_len(env))   # type: ignore[arg-type]

    def context(self, facts: ModelFacts) -> int:
        """Tokens of one sequence: ``--max-model-len``, else vLLM's default for the model
        (``ModelFacts.model_max_len.default``)."""
        if self.max_model_len and self.max_model_len > 0:
            return self.max_model_len
        return facts.model_max_len.default

    def batch_limits(self, device_memory_mib: int) -> tuple[int, int]:
        """(max_num_seqs, max_num_batched_tokens) vLLM's OpenAI server uses on this device when
        unset: 1024 / 8192 on GPUs of 70 GiB or more, else 256 / 2048
        (vllm/engine/arg_utils.py ``_set_default_max_num_seqs_and_batched_tokens_args``; A100s
        of 80 GB get the small defaults there, by name, which a memory size cannot tell)."""
        big = device_memory_mib >= 70 * 1024
        seqs = self.max_num_seqs or (1024 if big else 256)
        tokens = self.max_num_batched_tokens or (8192 if big else 2048)
        return seqs, tokens


def _parse(flag: str, value: str) -> object:
    if flag in ("--kv-cache-dtype", "--dtype", "--quantization", "-q"):
        return value
    if flag == "--max-model-len" and value.strip().lower() in ("-1", "auto"):
        return None   # vLLM fits the length to the memory: the model's maximum is the need
    if flag == "--gpu-memory-utilization":
        try:
            v = float(value)
        except ValueError:
            raise EngineArgError(f"{flag} {value!r}: not a number") from None
        if not 0 < v <= 1:
            raise EngineArgError(f"{flag} {value!r}: must be in (0, 1]")
        return v
    m = _SIZE.match(value.strip())
    if not m:
        raise EngineArgError(f"{flag} {value!r}: not a whole number")
    suffix = m.group(2)   # vllm/utils/argparse_utils.py human_readable_int: 1k = 1000, 1K = 1024
    n = float(m.group(1)) * (_BINARY[suffix] if suffix in _BINARY else _DECIMAL[suffix.lower()])
    if n < 1 or n != int(n):
        raise EngineArgError(f"{flag} {value!r}: must be a positive whole number")
    return int(n)


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class MemoryNeed:
    """One replica of ``facts`` at ``tensor_parallel_size``, per GPU, under ``settings``.

    All byte figures are per GPU. ``fits`` and ``concurrency`` take the memory of one device as
    NVML reports it (a whole GPU's ``memory_mib``, or a MIG instance's).
    """

    facts: ModelFacts
    settings: EngineMemorySettings = EngineMemorySettings()
    tensor_parallel_size: int = 1

    def at_tp(self, tensor_parallel_size: int) -> MemoryNeed:
        return replace(self, tensor_parallel_size=tensor_parallel_size)

    @property
    def context_tokens(self) -> int:
        return self.settings.context(self.facts)

    @property
    def max_len_problem(self) -> str | None:
        """Why vLLM refuses this replica's ``--max-model-len`` for the model, on any device (above
        the model's maximum: `fleet.models.maxlen.max_model_len_problem`), or None."""
        return max_model_len_problem(self.facts.model_max_len, self.settings.max_model_len,
                                     self.settings.allow_long_max_model_len)

    @property
    def loaded_weight_bytes(self) -> int:
        """The whole model's weights as vLLM holds them: the checkpoint's bytes, or for a
        full-precision checkpoint under an online ``--quantization`` (``fp8`` and the shorthands
        of `fleet.models.quant.ONLINE_QUANTIZATION`) its linear layers and routed experts at the
        method's width. A quantized checkpoint keeps its own format (vLLM's ``get_quant_config``
        reads the checkpoint's ``quantization_config`` first)."""
        f, method = self.facts, self.settings.quantization
        if not method or f.quantization is not None:
            return f.weight_bytes
        return online_weight_bytes(f.weight_bytes, f.parameters, f.embedding_parameters, f.expert_parameters, method)

    @property
    def weight_bytes(self) -> int:
        """`loaded_weight_bytes` split evenly over TP (vLLM shards every linear layer and the
        vocabulary; norms are replicated and negligible)."""
        return math.ceil(self.loaded_weight_bytes / self.tensor_parallel_size)

    @property
    def kv_dtype_bytes(self) -> float:
        s = self.settings
        if s.kv_cache_dtype != "auto":
            return 1 if s.kv_cache_dtype.startswith("fp8") else DTYPE_BYTES.get(s.kv_cache_dtype, 2)
        if s.dtype not in ("auto", ""):
            return DTYPE_BYTES.get(s.dtype, 2)
        return self.facts.dtype_bytes if self.facts.dtype_bytes <= 2 else 2   # vLLM serves float32 as bf16/fp16

    @property
    def kv_heads_per_gpu(self) -> int:
        """vLLM's ``ModelConfig.get_num_kv_heads``: 1 for MLA, else ``max(1, kv_heads // TP)``."""
        if self.facts.mla:
            return 1
        return max(1, self.facts.kv_heads // self.tensor_parallel_size)

    @property
    def page_bytes(self) -> int:
        """One block of one layer (``AttentionSpec.page_size_bytes``)."""
        f = self.facts
        return int(self.settings.block_size * self.kv_heads_per_gpu * (f.head_size + f.value_head_size)
                   * self.kv_dtype_bytes)

    @property
    def kv_bytes_per_token(self) -> float:
        """KV cache bytes one token takes on one GPU, all layers."""
        return self.page_bytes * self.facts.layers / self.settings.block_size

    @property
    def block_bytes(self) -> int:
        """One block across all layers: the unit ``num_blocks`` counts."""
        return self.page_bytes * self.facts.layers

    @property
    def blocks_per_sequence(self) -> int:
        return math.ceil(self.context_tokens / self.settings.block_size)

    @property
    def sliding_blocks_per_sequence(self) -> int:
        """Blocks a sliding-window layer holds for one sequence (``SlidingWindowSpec.
        max_admission_blocks_per_request``): ``ceil(min(window - 1 + in-flight tokens,
        max_model_len) / block_size) + 1``, in-flight tokens ``2 x max_num_batched_tokens``
        (async scheduling's two batches; 8192 when unset, the larger of vLLM's defaults)."""
        window = self.facts.sliding_window or 0
        in_flight = 2 * (self.settings.max_num_batched_tokens or 8192)
        tokens = min(window - 1 + in_flight, self.context_tokens)
        return math.ceil(tokens / self.settings.block_size) + 1

    @property
    def sequence_kv_bytes(self) -> int:
        """One ``max_model_len`` sequence (full-attention layers its whole length, sliding-window
        layers their window) plus the null block vLLM holds back (``check_enough_kv_cache_memory``)."""
        f = self.facts
        sliding = min(f.sliding_layers, f.layers) if f.sliding_window else 0
        pages = (f.layers - sliding) * self.blocks_per_sequence + sliding * self.sliding_blocks_per_sequence
        return pages * self.page_bytes + self.block_bytes

    def overhead_bytes(self, device_memory_mib: int) -> int:
        """Estimated non-KV, non-weight memory per GPU: the profiling pass's activation peak,
        non-torch memory and the CUDA-graph reserve.

        Activation peak: the larger of the forward pass over ``max_num_batched_tokens`` tokens
        (per token: the MLP's gate/up output and activation, ``3 x intermediate / TP``, MoE: times
        experts per token; the QKV projection's output; four hidden-size buffers; 2 bytes each)
        and the sampler's dummy pass over ``max_num_seqs`` sequences
        (``_dummy_sampler_run`` in vllm/v1/worker/gpu_model_runner.py: float32 logits of the whole
        vocabulary through top-k and top-p, which sort them: values, int64 indices, probabilities,
        their cumulative sum, masks; `SAMPLER_BYTES_PER_LOGIT` a sequence and vocabulary entry).
        """
        f = self.facts
        tp = self.tensor_parallel_size
        seqs, tokens = self.settings.batch_limits(device_memory_mib)
        inter = (f.moe_intermediate_size * max(1, f.experts_per_token)) if f.experts else f.intermediate_size
        qkv = (f.attention_heads + 2 * f.kv_heads) * f.head_size
        forward = tokens * ((3 * inter + qkv) / tp + 4 * f.hidden_size) * 2   # bf16/fp16 activations
        sampler = seqs * f.vocab_size * SAMPLER_BYTES_PER_LOGIT
        non_torch = NON_TORCH_BYTES + (NON_TORCH_TP_BYTES if self.tensor_parallel_size > 1 else 0)
        graphs = 0 if self.settings.enforce_eager else CUDA_GRAPH_BYTES
        return int(max(forward, sampler) + non_torch + graphs)

    def budget_bytes(self, device_memory_mib: int) -> int:
        """What vLLM takes of the device: ``ceil(total x gpu_memory_utilization)``."""
        return math.ceil(device_memory_mib * MIB * self.settings.gpu_memory_utilization)

    def kv_cache_bytes(self, device_memory_mib: int) -> int:
        """KV cache memory per GPU: the budget less weights and overheads (may be negative)."""
        return self.budget_bytes(device_memory_mib) - self.weight_bytes - self.overhead_bytes(device_memory_mib)

    def needed_bytes(self, device_memory_mib: int) -> int:
        """Per GPU: weights + overheads + one ``max_model_len`` sequence; compare with
        `budget_bytes`."""
        return self.weight_bytes + self.overhead_bytes(device_memory_mib) + self.sequence_kv_bytes

    def fits(self, device_memory_mib: int) -> str | None:
        """Why one replica cannot start on devices of ``device_memory_mib`` (needed vs available
        per GPU, and the longest context that would fit), or None when it can.

        Also refuses a TP size vLLM refuses for the model (`fleet.models.facts.tp_problem`).
        """
        if (problem := tp_problem(self.facts, self.tensor_parallel_size)) is not None:
            return problem
        need = self.needed_bytes(device_memory_mib)
        have = self.budget_bytes(device_memory_mib)
        if need <= have:
            return None
        u = self.settings.gpu_memory_utilization
        tp = self.tensor_parallel_size
        longest = self.longest_context(device_memory_mib)
        hint = (f"; at most ~{longest:,} tokens of context fit (--max-model-len)" if longest > 0
                else "; the weights alone do not fit: more GPUs (tensorParallelSize) or a larger GPU")
        return (f"needs {_gib(need)} per GPU at TP={tp} (weights {_gib(self.weight_bytes)}, one "
                f"{self.context_tokens:,}-token sequence {_gib(self.sequence_kv_bytes)}, engine overhead "
                f"~{_gib(self.overhead_bytes(device_memory_mib))}), {_gib(have)} available "
                f"({device_memory_mib} MiB x gpu_memory_utilization {u:g}){hint}")

    def longest_context(self, device_memory_mib: int) -> int:
        """The longest ``max_model_len`` (whole blocks) whose one sequence fits beside weights and
        overheads, at most the model's own maximum (`fleet.models.maxlen`); 0 when none does."""
        budget = self.budget_bytes(device_memory_mib)
        most = self.facts.model_max_len.limit or self.facts.model_max_len.default
        lo, hi = 0, math.ceil(most / self.settings.block_size)
        while lo < hi:   # blocks of context; needed_bytes grows with it
            mid = (lo + hi + 1) // 2
            trial = replace(self, settings=replace(self.settings, max_model_len=mid * self.settings.block_size))
            if trial.needed_bytes(device_memory_mib) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.settings.block_size

    @property
    def hybrid(self) -> bool:
        """Whether layers of full and sliding-window attention are mixed or windows are shorter
        than the context: concurrency is then bytes per sequence, an approximation of vLLM's
        hybrid allocator (it groups layers and shares one pool of blocks)."""
        return bool(self.facts.sliding_layers and self.facts.sliding_window)

    def num_blocks(self, device_memory_mib: int) -> int:
        """vLLM's ``num_gpu_blocks`` on such a device: KV cache bytes // block bytes (0 if none)."""
        return max(0, self.kv_cache_bytes(device_memory_mib)) // self.block_bytes if self.block_bytes else 0

    def concurrency(self, device_memory_mib: int) -> float:
        """Sequences of the full context the KV cache holds at once: vLLM's start-up "Maximum
        concurrency for N tokens per request" (``num_blocks / blocks per sequence``); 0 when one
        does not fit."""
        if self.fits(device_memory_mib) is not None:
            return 0.0
        if self.hybrid:
            return self.kv_cache_bytes(device_memory_mib) / (self.sequence_kv_bytes - self.block_bytes)
        return self.num_blocks(device_memory_mib) / self.blocks_per_sequence

    def capacity_of(self, kv_cache_bytes: int) -> tuple[int, int, float]:
        """(blocks, tokens, concurrency) of a KV cache of ``kv_cache_bytes`` (vLLM's CPU backend
        takes it from ``VLLM_CPU_KVCACHE_SPACE``): what vLLM logs as "KV cache size: N tokens,
        Maximum concurrency for L tokens per request: Cx" (``get_kv_cache_capacity``)."""
        blocks = kv_cache_bytes // self.block_bytes
        concurrency = blocks / self.blocks_per_sequence
        return blocks, int(concurrency * self.context_tokens), concurrency
