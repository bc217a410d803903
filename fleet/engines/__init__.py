"""Engines: how a replica's engine is started, and what it needs to run here.

Modules: `kinds` (the registry of `spec.engine.kind`: `vllm`, and `sim`, the engine SIMULATOR of
`fleet.enginesim`), `vllm_serve` (``vllm serve`` for both vLLM builds, GPU and CPU),
`tinymodel` (a tiny random-weights Llama that real vLLM serves without a GPU or a model hub),
`vllm_args` (``spec.engine.args`` checked by the installed vLLM's own parser: `fleet validate`).
"""
