"""A model's facts as vLLM reads them: from ``config.json`` and the safetensors weights.

Owns `ModelFacts` (layers, attention heads, KV heads, head size, MLA latent size, experts,
dtype, context length, parameters, weight bytes), `facts_from_config` (a parsed ``config.json``
-> facts, the nested ``text_config`` of multimodal models included), `safetensors_weight_bytes`
(the tensor bytes a safetensors file's header declares) and `tp_problem` (a tensor parallel
size vLLM refuses for the model). Pure: the files are read by `fleet.models.read`; the memory a
shape needs is `fleet.models.memory`.

Where each fact comes from follows vLLM 0.32's
``vllm/transformers_utils/model_arch_config_convertor.py`` (``get_total_num_kv_heads``: the first
of ``n_head_kv``, ``num_kv_heads``, ``num_key_value_heads``, ``multi_query_group_num``, else the
attention heads; ``get_head_size``: ``head_dim``, else ``hidden_size // num_attention_heads``; for
DeepSeek-style MLA models ``kv_lora_rank + qk_rope_head_dim``, one latent "head" per token and
layer, ``is_deepseek_mla``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, replace

from fleet.models.maxlen import ModelMaxLen, derive_max_len
from fleet.models.quant import checkpoint_quantization

GIB = 1024 ** 3
MIB = 1024 ** 2

# torch dtype names in config.json and safetensors headers -> bytes per element.
DTYPE_BYTES: dict[str, float] = {
    "float32": 4, "float": 4, "F32": 4, "float16": 2, "half": 2, "F16": 2, "bfloat16": 2, "BF16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "int8": 1, "I8": 1, "U8": 1,
    "F64": 8, "I64": 8, "I32": 4, "I16": 2, "BOOL": 1,
}

# model_type values vLLM treats as DeepSeek MLA (model_arch_config_convertor.is_deepseek_mla, the
# ones with public configs).
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "glm4_moe_lite", "longcat_flash"})

_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num")
_USUALLY_WRITTEN = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "max_position_embeddings",
                    "intermediate_size")
_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


class ModelConfigError(ValueError):
    """A config.json Fleet cannot size the model from; the message names the file and field."""


@dataclass(frozen=True)
class ModelFacts:
    """What sizes a model in GPU memory. Counts are whole-model (before tensor parallelism).

    ``kv_heads`` and ``head_size`` are what one layer's KV cache stores per token: for MLA models
    one latent of ``kv_lora_rank + qk_rope_head_dim`` (``kv_heads`` 1, ``mla`` True: the same on
    every TP rank, not split). ``weight_bytes`` is what the checkpoint holds (safetensors headers
    or the index's ``metadata.total_size``) or, failing those, ``parameters x dtype bytes``;
    ``weight_source`` says which.
    """

    source: str
    architecture: str
    model_type: str
    layers: int
    attention_heads: int
    kv_heads: int
    head_size: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    dtype_bytes: float
    parameters: int
    weight_bytes: int
    weight_source: str                 # "safetensors headers", "safetensors index", "config.json"
    mla: bool = False
    experts: int = 0                   # routed experts (0: dense)
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    sliding_layers: int = 0            # layers with a sliding window (`sliding_layer_count`)
    quantization: str | None = None    # the checkpoint's quant_method (config.json quantization_config)
    embedding_parameters: int = 0      # of ``parameters``: embeddings and an untied LM head
    expert_parameters: int = 0         # of ``parameters``: routed experts
    max_len: ModelMaxLen | None = None
    """The longest ``--max-model-len`` vLLM takes and its default (`fleet.models.maxlen`); None:
    ``max_position_embeddings`` for both (`model_max_len`)."""

    @property
    def value_head_size(self) -> int:
        """Bytes-wise width of V beside K per head: 0 for MLA (one latent, no V: vLLM's
        ``MLAAttentionSpec.head_size_v``), else ``head_size``."""
        return 0 if self.mla else self.head_size

    @property
    def model_max_len(self) -> ModelMaxLen:
        """`max_len`, or ``max_position_embeddings`` as limit and default where it was not derived."""
        n = self.max_position_embeddings
        return self.max_len or ModelMaxLen(n, f"max_position_embeddings={n}", n)

    def with_weights(self, weight_bytes: int, source: str) -> ModelFacts:
        return replace(self, weight_bytes=weight_bytes, weight_source=source)


def _text_config(config: dict) -> tuple[dict, str]:
    """The language model's config (``text_config`` / ``llm_config`` of multimodal models, as
    vLLM's ``get_hf_text_config``), with the top level's dtype as fallback; and the path prefix
    for error messages."""
    for key in ("text_config", "llm_config", "language_config"):
        sub = config.get(key)
        if isinstance(sub, dict):
            merged = dict(sub)
            for k in ("torch_dtype", "dtype", "quantization_config", "compression_config", "tie_word_embeddings"):
                if k not in merged and k in config:
                    merged[k] = config[k]
            return merged, f"{key}."
    return config, ""


def _defaults_from_transformers(cfg: dict) -> dict:
    """``cfg`` with the fields it leaves out filled from its ``model_type``'s transformers config
    class (llava-hf configs omit the Llama defaults), when transformers is installed."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return cfg
    try:
        defaults = AutoConfig.for_model(cfg["model_type"]).to_dict()
    except (KeyError, ValueError, TypeError):
        return cfg
    return {**{k: v for k, v in defaults.items() if v is not None}, **cfg}


def _int(cfg: dict, where: str, *keys: str, default: int | None = None) -> int:
    for key in keys:
        v = cfg.get(key)
        if v is not None:
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ModelConfigError(f"{where}{key}: expected a non-negative integer, got {v!r}")
            return v
    if default is not None:
        return default
    raise ModelConfigError(f"{where}{keys[0]}: required to size the model, missing")


def _weight_dtype_bytes(cfg: dict, dtype: str) -> float:
    """Bytes per parameter of the checkpoint: the quantization's width when quantized
    (`fleet.models.quant.checkpoint_quantization`), else the dtype's."""
    _, width = checkpoint_quantization(cfg)
    return width if width is not None else DTYPE_BYTES.get(dtype, 2)


def facts_from_config(config: dict, source: str = "config.json") -> ModelFacts:
    """`ModelFacts` of a parsed ``config.json``; weights estimated from the parameter count
    (`fleet.models.read` replaces them by the checkpoint's own bytes when it has them).

    Raises ModelConfigError naming ``source`` and the field (missing or not an integer).
    """
    if not isinstance(config, dict):
        raise ModelConfigError(f"{source}: expected a JSON object")
    cfg, prefix = _text_config(config)
    if cfg.get("model_type") and any(k not in cfg for k in _USUALLY_WRITTEN):
        cfg = _defaults_from_transformers(cfg)
    where = f"{source} {prefix}"
    archs = config.get("architectures") or cfg.get("architectures") or ["?"]
    model_type = str(cfg.get("model_type") or config.get("model_type") or "")
    layers = _int(cfg, where, "num_hidden_layers", "n_layer", "num_layers")
    heads = _int(cfg, where, "num_attention_heads", "n_head")
    hidden = _int(cfg, where, "hidden_size", "n_embd", "d_model")
    if heads == 0 or layers == 0 or hidden == 0:
        raise ModelConfigError(f"{where}: num_hidden_layers, num_attention_heads and hidden_size must be > 0")
    kv_heads = _int(cfg, where, *_KV_HEAD_KEYS, default=heads)
    head_dim = cfg.get("head_dim")
    head_size = head_dim if isinstance(head_dim, int) and head_dim > 0 else hidden // heads
    mla = model_type in MLA_MODEL_TYPES and cfg.get("kv_lora_rank") is not None
    vocab = _int(cfg, where, "vocab_size")
    inter = _int(cfg, where, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    experts = _int(cfg, where, *_EXPERT_KEYS, default=0)
    per_token = _int(cfg, where, "num_experts_per_tok", "moe_topk", default=0) if experts else 0
    moe_inter = _int(cfg, where, "moe_intermediate_size", default=inter) if experts else 0
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    window = window if isinstance(window, int) and not isinstance(window, bool) and window > 0 else None
    facts = ModelFacts(
        source=source, architecture=str(archs[0]), model_type=model_type, layers=layers, attention_heads=heads,
        kv_heads=1 if mla else kv_heads,
        head_size=(_int(cfg, where, "kv_lora_rank") + _int(cfg, where, "qk_rope_head_dim")) if mla else head_size,
        hidden_size=hidden, intermediate_size=inter, vocab_size=vocab,
        max_position_embeddings=_int(cfg, where, "max_position_embeddings", "n_positions", "max_seq_len",
                                     default=2048),
        dtype=dtype, dtype_bytes=DTYPE_BYTES.get(dtype, 2), parameters=0, weight_bytes=0,
        weight_source="config.json", mla=mla, experts=experts, experts_per_token=per_token,
        moe_intermediate_size=moe_inter, sliding_window=window,
        sliding_layers=sliding_layer_count(cfg, model_type, layers) if window else 0,
        quantization=checkpoint_quantization(cfg)[0],
        max_len=derive_max_len(cfg, model_type),
    )
    embedding, linear, routed = parameter_parts(cfg, facts, where)
    params = embedding + linear + routed
    return replace(facts, parameters=params, weight_bytes=int(params * _weight_dtype_bytes(cfg, dtype)),
                   embedding_parameters=embedding, expert_parameters=routed)


def sliding_layer_count(cfg: dict, model_type: str, layers: int) -> int:
    """How many layers attend through a sliding window (the rest: full attention), as vLLM's
    model implementations decide: ``layer_types`` when the config lists one per layer
    (``"sliding_attention"``); Gemma 3 every layer but each ``sliding_window_pattern``-th (6);
    Gemma 2 every other layer; Mistral every layer. Other models: none (their full-attention
    KV cache is the larger, so the memory check never passes a shape that cannot hold them)."""
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return sum(1 for t in types if t == "sliding_attention")
    if model_type in ("gemma3", "gemma3_text"):
        pattern = cfg.get("sliding_window_pattern") or 6
        return sum(1 for i in range(layers) if (i + 1) % pattern)
    if model_type == "gemma2":
        return (layers + 1) // 2
    if model_type == "mistral":
        return layers
    return 0


def parameter_count(cfg: dict, facts: ModelFacts, where: str = "") -> int:
    """Parameters of the language model: the sum of `parameter_parts`."""
    return sum(parameter_parts(cfg, facts, where))


def parameter_parts(cfg: dict, facts: ModelFacts, where: str = "") -> tuple[int, int, int]:
    """(embedding, linear, routed expert) parameters of the language model as a decoder-only
    transformer: embeddings (and an untied LM head); the linear layers: per layer attention (Q,
    K, V, O; MLA's low-rank projections), the dense MLP (gated: 3 matrices), shared experts and
    the router; every routed expert of the MoE layers. Norms and biases are left out (< 0.1 %). Vision towers and MTP layers (not loaded by vLLM unless
    speculative decoding asks) are not counted.
    """
    h, heads, layers = facts.hidden_size, facts.attention_heads, facts.layers
    embed = facts.vocab_size * h
    head = 0 if cfg.get("tie_word_embeddings", False) else embed
    if facts.mla:
        nope = _int(cfg, where, "qk_nope_head_dim")
        rope = _int(cfg, where, "qk_rope_head_dim")
        v_dim = _int(cfg, where, "v_head_dim")
        kv_rank = _int(cfg, where, "kv_lora_rank")
        q_rank = cfg.get("q_lora_rank")
        q = (h * q_rank + q_rank * heads * (nope + rope)) if q_rank else h * heads * (nope + rope)
        attn = q + h * (kv_rank + rope) + kv_rank * heads * (nope + v_dim) + heads * v_dim * h
    else:
        attn = 2 * h * heads * facts.head_size + 2 * h * facts.kv_heads * facts.head_size
    dense_mlp = 3 * h * facts.intermediate_size
    if not facts.experts:
        return embed + head, layers * (attn + dense_mlp), 0
    dense_layers = min(layers, int(cfg.get("first_k_dense_replace") or 0))
    dense_layers += len(cfg.get("mlp_only_layers") or [])
    shared = int(cfg.get("n_shared_experts") or 0) * 3 * h * facts.moe_intermediate_size
    shared += 3 * h * int(cfg.get("shared_expert_intermediate_size") or 0)
    routed = facts.experts * 3 * h * facts.moe_intermediate_size
    moe_layers = layers - dense_layers
    return (embed + head, layers * attn + dense_layers * dense_mlp + moe_layers * (shared + h * facts.experts),
            moe_layers * routed)


def safetensors_header(data: bytes, name: str = "model.safetensors") -> dict:
    """The JSON header of a safetensors file given its first bytes (8-byte little-endian header
    length, then the header; huggingface/safetensors' format). Raises ModelConfigError."""
    if len(data) < 8:
        raise ModelConfigError(f"{name}: shorter than a safetensors header")
    (n,) = struct.unpack("<Q", data[:8])
    if n > 100 * MIB or len(data) < 8 + n:
        raise ModelConfigError(f"{name}: safetensors header of {n} bytes is cut or implausible")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as err:
        raise ModelConfigError(f"{name}: safetensors header is not JSON: {err}") from None
    if not isinstance(header, dict):
        raise ModelConfigError(f"{name}: safetensors header is not a JSON object")
    return header


def safetensors_weight_bytes(header: dict) -> int:
    """Bytes of the tensors a safetensors header declares (``data_offsets`` end - start)."""
    total = 0
    for key, t in header.items():
        if key == "__metadata__" or not isinstance(t, dict):
            continue
        start, end = t.get("data_offsets", (0, 0))
        total += int(end) - int(start)
    return total


def tp_problem(facts: ModelFacts, tensor_parallel_size: int) -> str | None:
    """Why vLLM refuses ``tensor_parallel_size`` for this model, or None.

    vLLM 0.32: ``ModelConfig.verify_with_parallel_config`` (vllm/config/model.py) requires the
    attention heads to be divisible by the TP size; ``QKVParallelLinear``
    (vllm/model_executor/layers/linear.py) divides the KV heads by TP, or, when TP is at least the
    KV heads, TP by the KV heads (each KV head replicated on TP / KV-heads ranks).
    """
    tp = tensor_parallel_size
    if facts.attention_heads % tp:
        return (f"tensorParallelSize {tp} does not divide the model's {facts.attention_heads} attention heads "
                f"(vLLM requires heads % TP == 0; try {', '.join(map(str, valid_tp_sizes(facts)))})")
    if not facts.mla and facts.kv_heads:
        kv = facts.kv_heads
        if (tp >= kv and tp % kv) or (tp < kv and kv % tp):
            return (f"tensorParallelSize {tp} and the model's {kv} KV heads: vLLM needs one to divide the "
                    f"other (try {', '.join(map(str, valid_tp_sizes(facts)))})")
    return None


def valid_tp_sizes(facts: ModelFacts, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> list[int]:
    """The sizes among ``sizes`` that `tp_problem` accepts."""
    ok = []
    for tp in sizes:
        heads_ok = facts.attention_heads % tp == 0
        kv = facts.kv_heads
        kv_ok = facts.mla or not kv or (tp % kv == 0 if tp >= kv else kv % tp == 0)
        if heads_ok and kv_ok:
            ok.append(tp)
    return ok
