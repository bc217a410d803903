"""Per-step time of the engine SIMULATOR: what one scheduler iteration costs.

Owns `StepFeatures` (what a step computes, as counted by `fleet.enginesim.model`) and `StepCost`
(seconds as a function of those features). Used by `fleet.enginesim.model` and fitted by
`loadtests/calibrate_sim.py`; parameters live in `fleet.enginesim.profiles`. Pure arithmetic.

The form is a roofline-style sum (the same decomposition as the analytic models in the
Sarathi-Serve paper, Agrawal et al., OSDI 2024, section 3, and DistServe, Zhong et al., OSDI
2024, section 3.1)::

    duration_s = fixed_s
               + per_seq_s            * num_seqs
               + per_decode_ctx_s     * decode_context_tokens     # KV reads of decodes
               + per_prefill_pair_s   * prefill_attention_pairs   # causal attention of prefills
               + max(weights_floor_s, per_token_s * num_tokens)   # linear layers

``weights_floor_s`` is the time to stream the weights once (memory-bound decode); the
``per_token_s`` term takes over once a step has enough tokens to be compute-bound (prefill).
A CPU fit sets ``weights_floor_s`` to 0 and the formula is linear in all five parameters.

``admission_s`` is not a step cost: it is the time from a request's arrival until the
scheduler can see it (the API server parsing and tokenizing it and handing it to the engine
core); `fleet.enginesim.model.EngineModel` holds new requests back for that long.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepFeatures:
    """What one scheduler step computes.

    Attributes:
        num_tokens: tokens computed in the step (prefill chunks + one per decode).
        num_seqs: requests in the step's batch.
        decode_context_tokens: sum of the context lengths (tokens whose KV is read) of the
            decode requests in the batch.
        prefill_attention_pairs: sum over prefill chunks of ``n * (computed + (n + 1) / 2)``:
            query-key pairs of causal attention for a chunk of ``n`` new tokens after
            ``computed`` cached or already computed ones.
    """

    num_tokens: int = 0
    num_seqs: int = 0
    decode_context_tokens: int = 0
    prefill_attention_pairs: float = 0.0

    def vector(self) -> tuple[float, float, float, float, float]:
        """(1, num_seqs, decode_context_tokens, prefill_attention_pairs, num_tokens): the
        regressors of a linear fit (`StepCost.from_vector`)."""
        return (1.0, float(self.num_seqs), float(self.decode_context_tokens),
                float(self.prefill_attention_pairs), float(self.num_tokens))  # fmt: skip


@dataclass(frozen=True)
class StepCost:
    """Seconds per scheduler step as a function of `StepFeatures` (formula in the module doc)."""

    fixed_s: float = 0.0
    per_seq_s: float = 0.0
    per_decode_ctx_s: float = 0.0
    per_prefill_pair_s: float = 0.0
    per_token_s: float = 0.0
    weights_floor_s: float = 0.0
    admission_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if value < 0:
                raise ValueError(f"StepCost.{name} must be >= 0, got {value}")

    def duration_s(self, f: StepFeatures) -> float:
        """Seconds the step described by ``f`` takes (0 for an empty step)."""
        if f.num_tokens == 0:
            return 0.0
        return (
            self.fixed_s
            + self.per_seq_s * f.num_seqs
            + self.per_decode_ctx_s * f.decode_context_tokens
            + self.per_prefill_pair_s * f.prefill_attention_pairs
            + max(self.weights_floor_s, self.per_token_s * f.num_tokens)
        )

    @classmethod
    def from_vector(cls, theta: list[float] | tuple[float, ...], admission_s: float = 0.0) -> StepCost:
        """The linear cost (no weights floor) whose parameters follow `StepFeatures.vector`."""
        fixed, per_seq, per_ctx, per_pair, per_token = (max(0.0, float(x)) for x in theta)
        return cls(fixed_s=fixed, per_seq_s=per_seq, per_decode_ctx_s=per_ctx, per_prefill_pair_s=per_pair,
                   per_token_s=per_token, admission_s=max(0.0, float(admission_s)))  # fmt: skip
