"""The longest ``--max-model-len`` vLLM accepts for a model, read from its config.json as vLLM
reads it.

Owns `ModelMaxLen` (the derived maximum, the key it came from, vLLM's default when the flag is
unset), `derive_max_len` (a text config -> `ModelMaxLen`), `max_model_len_problem` (why vLLM
refuses a requested ``--max-model-len``, or None) and `allows_long_max_len` (the engine
environment's ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``). Pure. Called by `fleet.models.facts`
(``ModelFacts.max_len``) and `fleet.models.memory` (``MemoryNeed.max_len_problem``: the one call
of the rule, read by placement, ``fleet validate`` and ``fleet up``'s preflight).

A port of vLLM 0.32's rule (paths in the vllm package), checked against vLLM's own function on
several configs by ``tests/integration/test_vllm_engine_args.py``:

- ``transformers_utils/model_arch_config_convertor.py`` ``derive_max_model_len_and_key``: the
  smallest of ``max_position_embeddings``, ``n_positions``, ``max_seq_len``, ``seq_length``,
  ``model_max_length``, ``max_target_positions``, ``max_sequence_length``, ``max_seq_length``,
  ``seq_len``; a ``model_max_length`` (Command-R) overrides them all;
- ``config/model.py`` ``_get_and_verify_max_len``: ``tokenizer_config.json``'s
  ``model_max_length`` lowers it for pooling models with absolute position embeddings only
  (``ModelConfig.get_and_verify_max_len``; Fleet serves generative models, so it is not read);
  none of the keys: 2048 (or the requested length, taken as is); RoPE scaling multiplies it by ``rope_parameters`` / ``rope_scaling`` ``factor``, except
  for the types that leave ``max_position_embeddings`` already scaled (``su``, ``longrope``,
  ``llama3``, ``yarn``, ``deepseek_yarn``, ``deepseek_llama_scaling``) and for Gemma 3; unset,
  the length is that maximum (LongRoPE: ``original_max_position_embeddings``); a requested
  length above it is refused ("User-specified max_model_len ... is greater than the derived
  max_model_len") unless the text config's ``model_max_length`` allows it or the engine
  runs with ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
"""config.json keys vLLM takes the model's maximum length from (the smallest wins)."""
PRESCALED_ROPE_TYPES = frozenset({"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"})
"""RoPE types whose ``factor`` vLLM does not apply to the derived length."""
DEFAULT_MAX_LEN = 2048
"""vLLM's length for a config with none of `MAX_LEN_KEYS`."""
ALLOW_LONG_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass(frozen=True)
class ModelMaxLen:
    """``limit``: the longest ``--max-model-len`` vLLM accepts (None: no key in the config, any
    length is taken); ``key``: where it comes from, as vLLM names it (``max_position_embeddings=32768``,
    times the RoPE factor where one applies); ``default``: vLLM's ``max_model_len`` when the flag
    is unset; ``override``: the config's ``model_max_length``, which lets a longer
    request through."""

    limit: int | None
    key: str
    default: int
    override: int | None = None


def _rope_parameters(cfg: dict) -> list[dict]:
    """The RoPE parameter dicts of a text config (``rope_parameters``, or the older
    ``rope_scaling``; one per layer type when nested), each with ``rope_type``
    (vllm/transformers_utils/config.py ``iter_rope_parameters``)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling")
    if not isinstance(rope, dict) or not rope:
        return []
    dicts = [v for v in rope.values() if isinstance(v, dict) and v] if all(
        isinstance(v, dict) for v in rope.values()) else [rope]
    return [{**d, "rope_type": d.get("rope_type") or d.get("type") or "default"} for d in dicts]


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def derive_max_len(cfg: dict, model_type: str = "", tokenizer_max_length: int | None = None) -> ModelMaxLen:
    """`ModelMaxLen` of the text config ``cfg`` (module docstring; ``get_hf_text_config``'s:
    the language model's part of a multimodal config); ``tokenizer_max_length`` is
    tokenizer_config.json's ``model_max_length`` where it applies (pooling models)."""
    derived, key = math.inf, None
    for k in MAX_LEN_KEYS:
        v = _number(cfg.get(k))
        if v is not None:
            if v < derived:
                key = k
            derived = min(derived, v)
    if (mml := _number(cfg.get("model_max_length"))) is not None and mml:
        derived, key = mml, "model_max_length"
    if tokenizer_max_length is not None and tokenizer_max_length < derived:
        derived, key = float(tokenizer_max_length), "tokenizer_config.json model_max_length"
    if derived == math.inf:
        return ModelMaxLen(None, "no maximum length in config.json", DEFAULT_MAX_LEN)
    source = f"{key}={int(derived)}"
    ropes = _rope_parameters(cfg)
    if ropes and "gemma3" not in model_type:
        factor = 1.0
        for rp in ropes:
            if rp["rope_type"] not in PRESCALED_ROPE_TYPES:
                factor = rp.get("factor", factor)
        factor = 1.0 if factor is None else float(factor)
        if factor != 1.0:
            source += f" x rope factor {factor:g}"
        derived *= factor
    default = int(derived)
    if any(rp["rope_type"] == "longrope" for rp in ropes):
        default = int(cfg.get("original_max_position_embeddings") or derived)
    override = _number(cfg.get("model_max_length"))
    return ModelMaxLen(int(derived), source, default, int(override) if override else None)


def allows_long_max_len(env: Mapping[str, str] | None) -> bool:
    """Whether the engine environment ``env`` (``spec.engine.env``) sets
    ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` to a true value ("1" or "true", any case: vllm/envs.py),
    with which vLLM takes any ``--max-model-len`` with a warning."""
    return str((env or {}).get(ALLOW_LONG_ENV, "")).strip().lower() in ("1", "true")


def max_model_len_problem(max_len: ModelMaxLen, requested: int | None, allow_long: bool = False) -> str | None:
    """Why vLLM refuses ``--max-model-len requested`` for this model (module docstring), or
    None. ``allow_long``: the engine runs with ``VLLM_ALLOW_LONG_MAX_MODEL_LEN`` set
    (`allows_long_max_len`), which lets any length through."""
    if requested is None or requested == -1 or max_len.limit is None or requested <= max_len.limit:
        return None
    if max_len.override is not None and requested <= max_len.override:
        return None
    if allow_long:
        return None
    return (f"--max-model-len {requested:,} is above the model's maximum {max_len.limit:,} ({max_len.key} in "
            f"config.json): vLLM refuses it at start (_get_and_verify_max_len in vllm/config/model.py); lower it, "
            f"or set {ALLOW_LONG_ENV}=1 in spec.engine.env if the model extrapolates")
