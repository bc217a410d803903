"""The simulator's command line parsed in-process (fleet/enginesim/__main__.py). The command lines
run as real processes are in tests/integration/test_sim_cli.py."""

from __future__ import annotations

from fleet.enginesim.__main__ import options_from_args


def test_vllm_style_flags_are_parsed_and_unknown_vllm_flags_ignored():
    opts, ignored = options_from_args([
        "--model", "sim://h100x4-llama-70b", "--served-model-name", "big", "--port", "0", "--tensor-parallel-size",
        "4", "--max-model-len", "4096", "--enforce-eager", "--gpu-memory-utilization", "0.9", "--seed", "5",
    ])  # fmt: skip
    assert ignored == ["--enforce-eager", "--gpu-memory-utilization", "0.9"]
    (s,) = opts.replica_settings()
    assert s.profile.name == "h100x4-llama-70b" and s.profile.config.max_model_len == 4096
    assert s.served_model_name == "big" and s.seed == 5
