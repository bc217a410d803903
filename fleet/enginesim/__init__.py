"""The engine SIMULATOR: a stand-in for vLLM in tests and in scale experiments.

Nothing here runs a model. It serves vLLM's OpenAI-compatible HTTP surface and its `vllm:`
Prometheus metrics, with latencies from a model of vLLM's scheduler (continuous batching,
chunked prefill, paged KV cache with prefix caching, preemption) and a per-step cost fitted to
real vLLM or derived from published GPU measurements. It says it is a simulator wherever it
appears (`/v1/models`, metric help texts, `system_fingerprint`, its start-up lines).

Layers, each importing only the ones above it:

- `fleet.enginesim.cost`: the per-step time model (`StepFeatures` -> seconds). Pure.
- `fleet.enginesim.kvcache`: KV-cache blocks, LRU free queue, prefix-cache block hashes, KV cache events. Pure.
- `fleet.enginesim.model`: `EngineModel`, the scheduler; driven by `step(now_s)` in real or virtual
  time. Pure: no I/O, no clock, no asyncio.
- `fleet.enginesim.profiles`: named profiles (scheduler limits, KV capacity, step cost) with sources.
- `fleet.enginesim.tokens`: the simulator's deterministic tokenizer and filler text.
- `fleet.enginesim.metrics`: vLLM's metric names, labels and buckets over prometheus-client.
- `fleet.enginesim.faults`: fault switches for reliability tests.
- `fleet.enginesim.kvpublish`: KV cache events on vLLM's wire (``--kv-events-config``, PUB and replay sockets).
- `fleet.enginesim.api`: vLLM's request checks and error documents.
- `fleet.enginesim.responses`: vLLM's response documents and SSE streams.
- `fleet.enginesim.server`: `SimReplica`, the asyncio/aiohttp shell of one replica.
- `fleet.enginesim.runner`: the process: options, ports, many replicas until a signal.
- `fleet.enginesim.__main__`: the vLLM-compatible single-replica command line (`engine.kind: sim`).
"""
