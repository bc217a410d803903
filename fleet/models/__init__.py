"""Model facts and the memory a replica needs: what placement and `fleet validate` know of a model.

Modules: `facts` (``config.json`` and safetensors headers -> `ModelFacts`; the TP sizes vLLM
accepts), `read` (a ``spec.model.source`` -> facts: local or cached directory, ``hf://`` through
`huggingface_hub` fetching only ``config.json`` and the safetensors index), `memory` (vLLM's
memory accounting per GPU: `MemoryNeed.fits`, `MemoryNeed.concurrency`), `quant` (the bytes
weights take once loaded: a quantized checkpoint, ``--quantization``'s online formats),
`maxlen` (the longest ``--max-model-len`` vLLM accepts for the model), `advise` (shapes that
fit, and the cheapest for a target). Imported by `fleet.cli` and `fleet.placement.shapes`
(``PlacementRequest.memory``); imports nothing of placement or the controller.
"""

from fleet.models.facts import ModelConfigError, ModelFacts, facts_from_config, tp_problem, valid_tp_sizes
from fleet.models.memory import EngineArgError, EngineMemorySettings, MemoryNeed

__all__ = [
    "EngineArgError", "EngineMemorySettings", "MemoryNeed", "ModelConfigError", "ModelFacts", "facts_from_config",
    "tp_problem", "valid_tp_sizes",
]
