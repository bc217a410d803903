"""Fleet's control plane: one folder per concern (docs/architecture.md has the layers).

`spec` (the deployment document) and `sources` (model source strings) are read by every part;
`controller` converges replicas through a backend, `local` (`fleet up`) or `k8s` (`fleet
operator`); `placement` and `inventory` decide where replicas run; `rollout` judges canaries;
`agent` is the node agent (weight cache, GPU health); `engines` starts vLLM, `enginesim` simulates
it; `tracesim` replays traces through the real policies in virtual time; `observability` holds the
dashboard, rules and `fleet top`; `cli` is the `fleet` command; `testing` holds stand-ins for
tests and benchmarks only. The data plane (`router/`), the scaling policies (`autoscaler/`) and
the warm-up gate (`warmup/`) sit beside this package and import nothing from it.
"""
