"""The bytes a model's weights take once vLLM has loaded them: a quantized checkpoint's own
format, or the online quantization ``--quantization`` asks for.

Owns `checkpoint_quantization` (``config.json``'s ``quantization_config`` -> the method and the
bytes per quantized weight), `ONLINE_QUANTIZATION` (vLLM's ``--quantization`` shorthands that
quantize a full-precision checkpoint while it loads, with the bytes each stores per weight of a
linear layer and of a routed expert) and `online_weight_bytes` (the loaded weights of a
full-precision checkpoint under one of them). Pure. Called by `fleet.models.facts` (the
checkpoint's format) and `fleet.models.memory` (``MemoryNeed.weight_bytes``).

Sources (vLLM 0.32, paths in the vllm package):

- ``model_executor/model_loader/weight_utils.py`` ``get_quant_config``: a checkpoint with a
  ``quantization_config`` (or ``compression_config``) in config.json is loaded in that format
  whatever ``--quantization`` says; without one, ``--quantization fp8`` is taken as
  ``fp8_per_tensor`` (a deprecation warning) and the names of ``config/quantization.py``
  ``_ONLINE_SHORTHANDS`` build an ``OnlineQuantizationConfig``;
- ``model_executor/layers/quantization/online/base.py``: online methods quantize ``LinearBase``
  layers (the ``linear`` spec) and ``RoutedExperts`` (the ``moe`` spec); embeddings and the LM
  head (``VocabParallelEmbedding``, ``ParallelLMHead``) stay at the model's dtype;
- the stored formats (``online/fp8.py``, ``mxfp8.py``, ``mxfp4.py``, ``int8.py``, ``nvfp4.py``):
  fp8 and int8 one byte per weight; MX formats one scale byte per 32 weights; NVFP4 half a byte
  and one fp8 scale per 16 weights.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OnlineQuantization:
    """Bytes per weight an online method stores: ``linear`` for linear layers, ``moe`` for routed
    experts; None leaves that kind at the model's dtype."""

    linear: float | None
    moe: float | None


ONLINE_QUANTIZATION: dict[str, OnlineQuantization] = {
    "fp8": OnlineQuantization(1, 1),               # taken as fp8_per_tensor (get_quant_config)
    "fp8_per_tensor": OnlineQuantization(1, 1),
    "fp8_per_block": OnlineQuantization(1, 1),
    "fp8_per_channel": OnlineQuantization(1, 1),
    "mxfp8": OnlineQuantization(1 + 1 / 32, 1 + 1 / 32),
    "mxfp4": OnlineQuantization(0.5 + 1 / 32, 0.5 + 1 / 32),
    "int8_per_channel_weight_only": OnlineQuantization(None, 1),
    "nvfp4_per_token": OnlineQuantization(None, 0.5 + 1 / 16),
}
"""``--quantization`` values that quantize a full-precision checkpoint as it loads (module
docstring)."""

_FP8_METHODS = ("fp8", "fbgemm_fp8", "modelopt", "deepseek_v4_fp8")


def checkpoint_quantization(config: dict) -> tuple[str | None, float | None]:
    """(quant_method, bytes per quantized weight) of a config.json's ``quantization_config``
    (or ``compression_config``); (None, None) for a full-precision checkpoint; bytes None when
    the method is named but its width is not written.

    Widths: GPTQ/AWQ and others' ``bits`` (4 -> 0.5); fp8 methods 1; compressed-tensors the
    ``num_bits`` of its first ``config_groups`` entry's ``weights``.
    """
    q = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(q, dict):
        return None, None
    method = str(q.get("quant_method") or "").lower() or None
    if isinstance(q.get("bits"), int) and not isinstance(q.get("bits"), bool):
        return method, q["bits"] / 8
    named = f"{q.get('fmt', '')} {q.get('quant_algo', '')}".lower()
    if method in _FP8_METHODS or "fp8" in named:
        return method, 1
    groups = q.get("config_groups")
    if isinstance(groups, dict):
        for group in groups.values():
            bits = (group.get("weights") or {}).get("num_bits") if isinstance(group, dict) else None
            if isinstance(bits, int) and not isinstance(bits, bool):
                return method, bits / 8
    return method, None


def online_weight_bytes(weight_bytes: int, parameters: int, embedding_parameters: int, expert_parameters: int,
                        method: str) -> int:
    """The loaded bytes of a full-precision checkpoint of ``weight_bytes`` under the online
    ``method`` (a key of `ONLINE_QUANTIZATION`; others: ``weight_bytes`` unchanged).

    ``parameters`` splits into embeddings (and an untied LM head), routed experts, and the linear
    layers (the rest); each part keeps the checkpoint's bytes per parameter unless the method
    quantizes it.
    """
    q = ONLINE_QUANTIZATION.get(method)
    if q is None or parameters <= 0:
        return weight_bytes
    per_param = weight_bytes / parameters
    linear = max(0, parameters - embedding_parameters - expert_parameters)
    total = (embedding_parameters * per_param
             + linear * (q.linear if q.linear is not None else per_param)
             + expert_parameters * (q.moe if q.moe is not None else per_param))
    return int(min(total, weight_bytes))
